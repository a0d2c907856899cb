package coalesce_test

import (
	"net/netip"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/coalesce"
)

// twoPods is service a's slice with endpoints 10.244.0.7 and .8 on node-1,
// ready as given.
func twoPods(ready7, ready8 bool) bus.Change {
	ep := func(ip string, ready bool) bus.Endpoint {
		return bus.Endpoint{Addr: netip.MustParseAddr(ip), NodeName: "node-1", Ready: ready, Serving: ready}
	}
	sl := &bus.EndpointSlice{Service: keyA, Name: "a-1", Family: bus.IPv4,
		Ports: []bus.EndpointPort{{Name: "http", Protocol: bus.TCP, Port: 8080}},
		Items: []bus.Endpoint{ep("10.244.0.7", ready7), ep("10.244.0.8", ready8)}}
	return bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: sl.Name, Slice: sl}
}

// readyIn says how many of a's endpoints snapshot s has ready.
func readyIn(s *bus.Snapshot) int {
	n := 0
	for _, sl := range s.State.Slices[keyA] {
		for _, e := range sl.Items {
			if e.Ready {
				n++
			}
		}
	}
	return n
}

// servedThenOneFlaps starts with a served by two ready pods and committed,
// the burst spent down to one token by a first flap (pod .7 not ready),
// committed too; what kube-proxy's limiter would let through at once is one
// more snapshot.
func servedThenOneFlaps(t *testing.T, cfg coalesce.Config) *harness {
	h := start(t, cfg)
	replay := replayOf(svc(keyA, "10.96.0.1"))
	replay.Replay.Slices[keyA] = map[string]*bus.EndpointSlice{"a-1": twoPods(true, true).Slice}
	h.send(replay)
	h.answer(bus.IPv4, h.take(bus.IPv4), true)
	time.Sleep(2 * cfg.MinSyncPeriod) // the bucket refills: a burst of two
	h.send(twoPods(false, true))
	s := h.take(bus.IPv4)
	if readyIn(s) != 1 {
		t.Fatalf("snapshot after .7's flap has %d of a's endpoints ready; want 1", readyIn(s))
	}
	h.answer(bus.IPv4, s, true)
	return h
}

// A restarted kubelet flaps every pod on its node not ready for tens of
// milliseconds. kpipe must not program the moment a service had no endpoint
// (and then, with its burst spent, hold that REJECT for a min-sync-period):
// the snapshot after the flap has the pods ready. It failed before outage.go:
// the second snapshot went at once with a's endpoints gone.
func TestFlapOfEveryEndpointIsNotProgrammed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := servedThenOneFlaps(t, coalesce.Config{MinSyncPeriod: time.Second, Burst: 2})
		h.send(twoPods(false, false))
		time.Sleep(20 * time.Millisecond)
		h.send(twoPods(true, false))
		s := h.take(bus.IPv4)
		if readyIn(s) == 0 {
			t.Fatalf("snapshot %d programs a with no endpoint though the API had one back 20 ms later", s.Generation)
		}
	})
}

// An outage that lasts is programmed once it has settled (250 ms), not held
// back for a min-sync-period.
func TestLastingLossIsProgrammedAfterSettling(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := servedThenOneFlaps(t, coalesce.Config{MinSyncPeriod: time.Second, Burst: 2})
		lost := time.Now()
		h.send(twoPods(false, false))
		s := h.take(bus.IPv4)
		if readyIn(s) != 0 {
			t.Fatalf("snapshot has %d of a's endpoints ready; want none", readyIn(s))
		}
		if waited := time.Since(lost); waited < 250*time.Millisecond || waited > 300*time.Millisecond {
			t.Errorf("the loss went out after %v; want it to settle for 250 ms", waited)
		}
	})
}

// With the min-sync-period 0 (sync on every change, as the operator asked),
// a loss goes out at once.
func TestNoSettlingWithoutMinSyncPeriod(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := servedThenOneFlaps(t, coalesce.Config{MinSyncPeriod: 0, Burst: 2})
		lost := time.Now()
		h.send(twoPods(false, false))
		if s := h.take(bus.IPv4); readyIn(s) != 0 || time.Since(lost) > 10*time.Millisecond {
			t.Errorf("snapshot with %d ready after %v; want none ready, at once", readyIn(s), time.Since(lost))
		}
	})
}

// Once an outage is programmed, the endpoints coming back go out at once
// even with no token left (kube-proxy would hold the REJECT until its next
// token), but only once per token: a second outage ended that way must wait
// for the bucket. It failed before outage.go: nothing came within the hour.
func TestOutageEndsWithoutWaitingForAToken(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := servedThenOneFlaps(t, coalesce.Config{MinSyncPeriod: time.Minute, SyncPeriod: time.Hour, Burst: 2})
		h.send(twoPods(false, false))
		s := h.take(bus.IPv4) // the last token, once settled
		if readyIn(s) != 0 {
			t.Fatalf("snapshot has %d of a's endpoints ready; want none", readyIn(s))
		}
		h.answer(bus.IPv4, s, true)
		back := time.Now()
		h.send(twoPods(true, true))
		s = h.take(bus.IPv4)
		if readyIn(s) != 2 || time.Since(back) > 10*time.Millisecond {
			t.Fatalf("snapshot with %d ready %v after the pods came back; want both, at once", readyIn(s), time.Since(back))
		}
		h.answer(bus.IPv4, s, true)

		// No token, bypass spent: the next outage and its end wait for a token.
		h.send(twoPods(false, false))
		time.Sleep(time.Second)
		h.send(twoPods(true, true))
		h.none(bus.IPv4, "a second token-free snapshot with no token spent in between")
		time.Sleep(time.Minute) // a token
		if s = h.take(bus.IPv4); readyIn(s) != 2 {
			t.Errorf("snapshot with a token has %d of a's endpoints ready; want 2", readyIn(s))
		}
	})
}
