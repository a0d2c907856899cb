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
// not one fails. A flap whose moment with none lasted, as the apiserver took
// it, longer than kpipe waits for a loss to settle (250 ms) is a lasting loss,
// which kpipe must program: a loaded machine makes some (a CI run at load 10
// took one 0.75 s). Its phase is logged, not failed, and another flap is made
// in its place.
func TestReadinessFlapCostsNoConnection(t *testing.T) {
	const (
		flaps    = 5
		attempts = 10
		// fastFlap is the longest moment with none that is still a flap to
		// kpipe, with a margin for the watch's delivery of the two changes.
		fastFlap = 150 * time.Millisecond
	)
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
	var slow []time.Duration
	for counted := 0; counted < flaps; {
		if len(slow) == attempts-flaps+1 {
			tr.finish()
			t.Skipf("the apiserver took too long to flap: the moments with none lasted %v (> %v), not a flap to kpipe", slow, fastFlap)
		}
		time.Sleep(2500 * time.Millisecond) // the burst refills: the flap's first change goes at once
		e.setEndpoints(svc, notReady(1), local(2))
		noneFrom := time.Now()
		e.setEndpoints(svc, notReady(1, 2))
		time.Sleep(15 * time.Millisecond)
		e.setEndpoints(svc, local(1), notReady(2))
		none := time.Since(noneFrom)
		e.setEndpoints(svc, local(1, 2))
		time.Sleep(1500 * time.Millisecond)
		if none > fastFlap {
			slow = append(slow, none)
			tr.endPhaseTolerating(fmt.Sprintf("slow flap (none for %v)", none.Round(time.Millisecond)), time.Now())
			continue
		}
		counted++
		tr.endPhase(fmt.Sprintf("flap %d (none for %v)", counted, none.Round(time.Millisecond)))
	}
	tr.expectEndpoints("after the flaps", 1, 2)
	tr.finish()
}
