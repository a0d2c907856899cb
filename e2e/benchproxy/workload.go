package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kpipe/kpipe/e2e/testbed"
)

const (
	benchNamespace   = "bench"
	portName         = "http"
	endpointsPerSvc  = 10
	nodePortEvery    = 10   // every tenth service is a NodePort,
	maxNodePorts     = 2000 // up to this many: the default range holds 2,768
	servicePort      = 80
	apiWorkers       = 16
	remoteNodes      = 100 // endpoints are spread over this many other nodes
	remoteNodePrefix = "kpbench-node-"
)

// workload is the API side: the services, their one EndpointSlice each, and
// what the endpoints are now (what the kernel must come to show).
type workload struct {
	tb   *testbed.Testbed
	bulk kubernetes.Interface // a client without the test bed's 200 writes a second, for grow
	svcs []*benchService
}

type benchService struct {
	mu      sync.Mutex
	spec    *corev1.Service            // what it is created from
	svc     *corev1.Service            // as stored: its ClusterIP
	slice   *discoveryv1.EndpointSlice // as stored: its resourceVersion is current
	ips     []string                   // the endpoints' addresses, sorted
	deleted bool                       // the Service is deleted (its slice stays)
}

// want are the endpoints s's chain must send to now: none while the Service
// is deleted.
func (s *benchService) want() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.deleted {
		return nil
	}
	return s.ips
}

func (s *benchService) clusterIP() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.svc.Spec.ClusterIP
}

func newWorkload(ctx context.Context, tb *testbed.Testbed) (*workload, error) {
	if err := tb.CreateNamespace(ctx, benchNamespace); err != nil {
		return nil, err
	}
	cfg := tb.RESTConfig()
	cfg.QPS = -1 // no client-side limit: 50,000 services are 100,000 writes
	bulk, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &workload{tb: tb, bulk: bulk}, nil
}

// grow creates services up to n in all (the apiserver allocates their
// ClusterIPs and NodePorts), each with endpointsPerSvc endpoints on other
// nodes.
func (w *workload) grow(ctx context.Context, n int) error {
	from := len(w.svcs)
	if n <= from {
		return nil
	}
	w.svcs = append(w.svcs, make([]*benchService, n-from)...)
	return parallel(n-from, func(k int) error {
		i := from + k
		spec := testbed.Service(benchNamespace, fmt.Sprintf("svc-%05d", i), testbed.Port(portName, corev1.ProtocolTCP, servicePort, testbed.EchoPort))
		if i%nodePortEvery == nodePortEvery-1 && i < maxNodePorts*nodePortEvery {
			spec.Spec.Type = corev1.ServiceTypeNodePort
		}
		svc, err := w.bulk.CoreV1().Services(benchNamespace).Create(ctx, spec, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create service %s: %w", spec.Name, err)
		}
		ips := randomIPs(endpointsPerSvc, nil)
		s := &benchService{spec: spec, svc: svc}
		slice, err := w.bulk.DiscoveryV1().EndpointSlices(benchNamespace).Create(ctx, s.sliceWith(ips), metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create endpoint slice of %s: %w", svc.Name, err)
		}
		s.slice, s.ips = slice, sorted(ips)
		w.svcs[i] = s
		return nil
	})
}

// clusterIPOnly are the services that are not NodePorts: a ClusterIP
// service's chain is reached from the dispatch alone (see kernel.reached).
func (w *workload) clusterIPOnly() []*benchService {
	var out []*benchService
	for _, s := range w.svcs {
		if s.spec.Spec.Type == corev1.ServiceTypeClusterIP {
			out = append(out, s)
		}
	}
	return out
}

// sliceWith is the service's EndpointSlice holding ips, each on one of the
// remote nodes; it carries the stored slice's resourceVersion once there is one.
func (s *benchService) sliceWith(ips []string) *discoveryv1.EndpointSlice {
	eps := make([]testbed.Endpoint, len(ips))
	for i, ip := range ips {
		eps[i] = testbed.Endpoint{IP: ip, Ready: true, Serving: true, NodeName: fmt.Sprintf("%s%d", remoteNodePrefix, ipNode(ip))}
	}
	slice := testbed.EndpointSlice(s.svc, "", eps)
	if s.slice != nil {
		slice.ResourceVersion = s.slice.ResourceVersion
	}
	return slice
}

// replaceEndpoint swaps one endpoint of s for a new address: one
// EndpointSlice update.
func (w *workload) replaceEndpoint(ctx context.Context, s *benchService) error {
	return w.updateEndpoints(ctx, s, func(ips []string) []string {
		ips[rand.IntN(len(ips))] = randomIPs(1, ips)[0]
		return ips
	})
}

// removeEndpoint takes one endpoint out of s: one EndpointSlice update.
func (w *workload) removeEndpoint(ctx context.Context, s *benchService) error {
	return w.updateEndpoints(ctx, s, func(ips []string) []string {
		return slices.Delete(ips, 0, 1)
	})
}

// addEndpoint gives s one endpoint more: one EndpointSlice update.
func (w *workload) addEndpoint(ctx context.Context, s *benchService) error {
	return w.updateEndpoints(ctx, s, func(ips []string) []string {
		return append(ips, randomIPs(1, ips)...)
	})
}

// updateEndpoints writes s's slice with the endpoints edit makes of a copy
// of its addresses.
func (w *workload) updateEndpoints(ctx context.Context, s *benchService, edit func([]string) []string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ips := edit(slices.Clone(s.ips))
	slice, err := w.tb.Client().DiscoveryV1().EndpointSlices(benchNamespace).Update(ctx, s.sliceWith(ips), metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("update endpoint slice of %s: %w", s.svc.Name, err)
	}
	s.slice, s.ips = slice, sorted(ips)
	return nil
}

// deleteService deletes s's Service; its EndpointSlice stays (nothing
// collects it here), ready for createService.
func (w *workload) deleteService(ctx context.Context, s *benchService) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := w.tb.DeleteService(ctx, benchNamespace, s.svc.Name); err != nil {
		return err
	}
	s.deleted = true
	return nil
}

// createService creates s's Service again, over its EndpointSlice: one
// write makes a whole service, ClusterIP and endpoints, appear.
func (w *workload) createService(ctx context.Context, s *benchService) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	svc, err := w.tb.CreateService(ctx, s.spec.DeepCopy())
	if err != nil {
		return err
	}
	s.svc, s.deleted = svc, false
	return nil
}

// randomIPs are n distinct pod addresses of other nodes' pod ranges
// (10.244.1.0-10.244.255.255, the node's own being 10.244.0.0/24), none in
// avoid.
func randomIPs(n int, avoid []string) []string {
	out := make([]string, 0, n)
	for len(out) < n {
		ip := fmt.Sprintf("10.244.%d.%d", 1+rand.IntN(255), 1+rand.IntN(254))
		if !slices.Contains(out, ip) && !slices.Contains(avoid, ip) {
			out = append(out, ip)
		}
	}
	return out
}

// ipNode is the remote node an address's pod runs on (one /24 a node).
func ipNode(ip string) int {
	var a, b, c, d int
	fmt.Sscanf(ip, "%d.%d.%d.%d", &a, &b, &c, &d)
	return c % remoteNodes
}

func sorted(ips []string) []string {
	out := slices.Clone(ips)
	slices.Sort(out)
	return out
}

// parallel runs fn(0..n-1) on apiWorkers goroutines and returns the first
// error.
func parallel(n int, fn func(i int) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		next  = make(chan int)
	)
	for range min(apiWorkers, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := fn(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return first
}

// churn makes total endpoint changes at random services, paced evenly over
// d (as far as the apiserver keeps up), and returns when the last was
// written, which service that was, and how long the churn took.
func (w *workload) churn(ctx context.Context, total int, d time.Duration) (last time.Time, lastSvc *benchService, took time.Duration, err error) {
	var mu sync.Mutex
	start := time.Now()
	err = parallel(total, func(k int) error {
		time.Sleep(time.Until(start.Add(d * time.Duration(k) / time.Duration(total))))
		s := w.svcs[rand.IntN(len(w.svcs))]
		if err := w.replaceEndpoint(ctx, s); err != nil {
			return err
		}
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		if now.After(last) {
			last, lastSvc = now, s
		}
		return nil
	})
	return last, lastSvc, last.Sub(start), err
}
