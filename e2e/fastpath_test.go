package e2e

import (
	"fmt"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// fastDeleted is kpipe_fast_path_deleted_rules_total of IPv4.
const fastDeleted = "kpipe_fast_path_deleted_rules_total"

// Endpoint churn on many services under traffic (issue 24, item 1): 1,000
// services of four endpoints each; the first 100 go through endpoints
// removed (the first, a middle one, all but the last), unready, terminating
// (the last, which the delete-only fast path leaves to the walked write) and
// re-added, and the last 100 services are deleted meanwhile. A client loop
// to eight of the churned services' ClusterIPs (a new connection every 10 ms
// each) sees no failure: the pods taken out of the endpoints keep serving, so
// a fresh render at any instant would answer every connection; an
// un-DNATed or refused one would be the fast path's.
func TestEndpointChurnOnManyServicesCostsNoConnection(t *testing.T) {
	e := setup(t)
	const n, churned, deleted, looped = 1000, 100, 100, 8
	services := e.manyServices(n, local(1, 2, 3, 4))
	var targets []target
	for i := range looped {
		svc := services[i*churned/looped]
		targets = append(targets, target{svc.Name, tcp2, tb.Pod(clientPod).NS, testbed.ClusterAddr(svc, 80)})
	}
	tr := newTraffic(t, 10*time.Millisecond, podIPs(1, 2, 3, 4), targets...)
	tr.start(podIPs(1, 2, 3, 4))
	notReady := func(pods ...int) []testbed.Endpoint {
		eps := tb.ReadyEndpoints(pods...)
		for i := range eps {
			eps[i].Ready, eps[i].Serving = false, false
		}
		return eps
	}
	all := local(1, 2, 3, 4)
	for _, phase := range []struct {
		name string
		eps  []testbed.Endpoint
		fast bool // the removals go by the fast path
	}{
		{"the first endpoint removed", local(2, 3, 4), true},
		{"re-added", all, false},
		{"a middle endpoint unready", append(local(1, 3, 4), notReady(2)...), true},
		{"ready again", all, false},
		{"the last endpoint terminating", append(local(1, 2, 3), terminating(testbed.NodeName, 4)...), false},
		{"re-added after terminating", all, false},
		{"all but the last removed", local(4), true},
		{"all re-added", all, false},
	} {
		before := metricSum(t, fastDeleted, map[string]string{"ip_family": "IPv4"})
		e.churn(services[:churned], phase.eps)
		if phase.name == "the first endpoint removed" {
			e.deleteServices(services[n-deleted:])
		}
		time.Sleep(1500 * time.Millisecond)
		tr.endPhase(phase.name)
		if after := metricSum(t, fastDeleted, map[string]string{"ip_family": "IPv4"}); phase.fast && after <= before {
			t.Errorf("%s: %s stayed at %v; the removals did not go by the fast path", phase.name, fastDeleted, after)
		}
	}
	tr.expectEndpoints("after the churn", 1, 2, 3, 4)
	tr.finish()
}

// manyServices creates n services with a TCP port 80 and endpoints eps, a
// few at a time.
func (e *env) manyServices(n int, eps []testbed.Endpoint) []*corev1.Service {
	e.t.Helper()
	out := make([]*corev1.Service, n)
	e.eachService(n, func(i int) error {
		svc, err := tb.CreateService(e.ctx, testbed.Service(e.ns, fmt.Sprintf("churn%d", i), testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
		if err == nil {
			out[i] = svc
			_, err = tb.SetEndpoints(e.ctx, svc, eps)
		}
		return err
	})
	return out
}

// churn sets the endpoints of every service to eps, a few at a time.
func (e *env) churn(services []*corev1.Service, eps []testbed.Endpoint) {
	e.t.Helper()
	e.eachService(len(services), func(i int) error {
		_, err := tb.SetEndpoints(e.ctx, services[i], eps)
		return err
	})
}

// deleteServices deletes the services, a few at a time.
func (e *env) deleteServices(services []*corev1.Service) {
	e.t.Helper()
	e.eachService(len(services), func(i int) error {
		return tb.DeleteService(e.ctx, services[i].Namespace, services[i].Name)
	})
}

// eachService runs f for 0..n-1 on eight goroutines; the first error fails
// the test.
func (e *env) eachService(n int, f func(i int) error) {
	e.t.Helper()
	const workers = 8
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < n && errs[w] == nil; i += workers {
				if err := f(i); err != nil {
					errs[w] = err
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			e.t.Fatal(err)
		}
	}
}
