package conntrack

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
)

// fakeConntrack fails its first pass; while that pass runs a newer commit puts its
// front-ends in the stage's mailbox. It records what every pass was asked.
type fakeConntrack struct {
	in     *bus.Mailbox[bus.StaleFlows]
	newer  bus.StaleFlows
	passes []nf.StaleUDP
	later  func() // called after every later pass
}

func (f *fakeConntrack) ClearStaleUDP(s nf.StaleUDP) (int, error) {
	f.passes = append(f.passes, s)
	if len(f.passes) == 1 {
		f.in.Put(f.newer)
		return 0, errors.New("netlink: no buffer space available")
	}
	f.later()
	return 0, nil
}

func (f *fakeConntrack) Close() error { return nil }

// After a failed pass the stage keeps its work, but as the older value: the pass
// after the restart clears against the newest endpoints (the older ones would
// delete live flows to endpoints added since) and still clears everything gone.
func TestFailedPassKeepsNewerEndpoints(t *testing.T) {
	fe, gone1, gone2 := netip.MustParseAddrPort("10.96.0.10:53"), netip.MustParseAddrPort("10.96.0.20:53"), netip.MustParseAddrPort("10.96.0.30:53")
	oldEP, newEP := netip.MustParseAddrPort("10.244.1.5:53"), netip.MustParseAddrPort("10.244.2.9:53")
	in := bus.NewMergingMailbox(bus.MergeStaleFlows)
	fake := &fakeConntrack{in: in, newer: bus.StaleFlows{Family: bus.IPv4,
		Now: map[netip.AddrPort][]netip.AddrPort{fe: {newEP}}, Gone: map[netip.AddrPort]bool{gone2: true}}}
	s := NewStage(Params{Family: bus.IPv4, In: in, Env: bus.Envs{Metrics: metrics.New(prometheus.NewRegistry()), Board: bus.NewBoard()}.For(bus.Conntrack.Of(bus.IPv4))})
	s.dial = func() (Clearer, error) { return fake, nil }
	in.Put(bus.StaleFlows{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{fe: {oldEP}}, Gone: map[netip.AddrPort]bool{gone1: true}})

	if err := s.Run(context.Background()); err == nil {
		t.Fatal("Run hid the failed pass")
	}
	// The supervisor restarts the stage.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	fake.later = cancel
	if err := s.Run(ctx); err != nil {
		t.Fatalf("Run after the restart = %v", err)
	}
	if len(fake.passes) < 2 {
		t.Fatalf("%d passes; want a second one after the restart", len(fake.passes))
	}
	second := fake.passes[1]
	if eps := second.Now[fe]; len(eps) != 1 || eps[0] != newEP {
		t.Errorf("the pass after the restart kept %v for %v; want the newer %v", eps, fe, newEP)
	}
	if !second.Gone[gone1] || !second.Gone[gone2] {
		t.Errorf("the pass after the restart clears gone %v; want both %v and %v", second.Gone, gone1, gone2)
	}
}

// cancellingConntrack fails its pass after the stage was told to stop (a
// config reload stops the whole tree).
type cancellingConntrack struct{ cancel context.CancelFunc }

func (c cancellingConntrack) ClearStaleUDP(nf.StaleUDP) (int, error) {
	c.cancel()
	return 0, errors.New("netlink: interrupted")
}

func (cancellingConntrack) Close() error { return nil }

// A pass that fails while the stage is being stopped keeps its work too: the
// next stage on the mailbox (a reload's next tree) finds it.
func TestPassFailedWhileStoppingKeepsItsWork(t *testing.T) {
	gone := netip.MustParseAddrPort("10.96.0.20:53")
	in := bus.NewMergingMailbox(bus.MergeStaleFlows)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := NewStage(Params{Family: bus.IPv4, In: in, Dial: func() (Clearer, error) { return cancellingConntrack{cancel}, nil },
		Env: bus.Envs{Metrics: metrics.New(prometheus.NewRegistry()), Board: bus.NewBoard()}.For(bus.Conntrack.Of(bus.IPv4))})
	in.Put(bus.StaleFlows{Family: bus.IPv4, Gone: map[netip.AddrPort]bool{gone: true}})
	_ = s.Run(ctx) // its error is the pass's; the supervisor stopping it ignores it
	if left, ok := in.TryTake(); !ok || !left.Gone[gone] {
		t.Errorf("after a pass failed while stopping, the mailbox holds %v (%v); want the flows to %v to clear", left, ok, gone)
	}
}
