package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// A restarted kubelet reports every pod on its node not ready until the pod's
// next readiness probe (kubernetes#100277). In a real cluster
// (e2e/clustertest, TestNodeEvents) the EndpointSlice of a service whose two
// pods run there went, within 45 ms: one not ready, both, the first back,
// both back. kube-proxy (a sync slower than that) never programs the moment
// with none; kpipe used to, and then, its burst spent, kept the REJECT for its
// min-sync-period: a second of refused and (ICMP being rate-limited) timed-out
// connections in about one kubelet restart in six.
//
// Here the same sequence of slices, as fast as the apiserver takes them, five
// times, with kube-proxy's default min-sync-period of 1 s and a new
// connection every 10 ms through the ClusterIP (TCP and UDP) and the NodePort:
// not one fails.
func TestReadinessFlapCostsNoConnection(t *testing.T) {
	e := setup(t)
	e.restartKpipe("--iptables-min-sync-period", "1s")
	svc := e.echoNodePort("flap")
	tr := newTraffic(t, 10*time.Millisecond, podIPs(1, 2), nodePortTargets(svc)...)
	tr.start(podIPs(1, 2))
	notReady := func(pods ...int) []testbed.Endpoint {
		eps := tb.ReadyEndpoints(pods...)
		for i := range eps {
			eps[i].Ready, eps[i].Serving = false, false
		}
		return eps
	}
	for i := range 5 {
		time.Sleep(2500 * time.Millisecond) // the burst refills: the flap's first change goes at once
		e.setEndpoints(svc, notReady(1), local(2))
		e.setEndpoints(svc, notReady(1, 2))
		time.Sleep(15 * time.Millisecond)
		e.setEndpoints(svc, local(1), notReady(2))
		e.setEndpoints(svc, local(1, 2))
		time.Sleep(1500 * time.Millisecond)
		tr.endPhase(fmt.Sprintf("flap %d", i+1))
	}
	tr.expectEndpoints("after the flaps", 1, 2)
	tr.finish()
}
