package coalesce

import (
	"context"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

func newTestFamily() *familyState {
	return &familyState{Pipeline: Pipeline{Family: bus.IPv4, Out: bus.NewMailbox[*bus.Snapshot](), Results: bus.NewMailbox[bus.Result](),
		Resync: bus.NewResyncFlag(), Resend: bus.NewResendFlag()}}
}

// startForward runs forward for f until the returned stop is called; stop
// waits for it to return.
func startForward(t *testing.T, f *familyState, signals chan familySignal) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); forward(ctx, f, signals) }()
	return func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("forward did not return after its context ended")
		}
	}
}

// TestForwardHandsOnEachSignalAsItsKind: every signal of the family reaches
// the loop, named for what was raised.
func TestForwardHandsOnEachSignalAsItsKind(t *testing.T) {
	f := newTestFamily()
	signals := make(chan familySignal)
	stop := startForward(t, f, signals)
	defer stop()
	for _, tc := range []struct {
		raise func()
		want  signalKind
	}{
		{f.Resync.Raise, resyncWanted},
		{f.Resend.Raise, resendWanted},
		{func() { f.Results.Put(bus.Result{Generation: 1}) }, resultReady},
	} {
		tc.raise()
		select {
		case sig := <-signals:
			if sig.f != f || sig.kind != tc.want {
				t.Errorf("got signal %v of %p; want %v of %p", sig.kind, sig.f, tc.want, f)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("signal %v not handed on", tc.want)
		}
	}
}

// TestForwardGivesBackAFlagItCouldNotHandOn: a flag the forwarder took while
// the Run ended is raised again, for the next Run (a Resync lost there would
// leave flushed tables unrepaired until the hourly full sync).
func TestForwardGivesBackAFlagItCouldNotHandOn(t *testing.T) {
	for _, tc := range []struct {
		name string
		flag func(f *familyState) *bus.Flag
	}{
		{"resync", func(f *familyState) *bus.Flag { return &f.Resync.Flag }},
		{"resend", func(f *familyState) *bus.Flag { return &f.Resend.Flag }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newTestFamily()
			flag := tc.flag(f)
			stop := startForward(t, f, make(chan familySignal)) // no loop reads it
			flag.Raise()
			deadline := time.Now().Add(5 * time.Second)
			for len(flag.C()) > 0 { // until the forwarder has taken it
				if time.Now().After(deadline) {
					t.Fatal("the forwarder did not take the flag")
				}
				time.Sleep(time.Millisecond)
			}
			stop()
			if !flag.Lower() {
				t.Error("the flag the forwarder took is down after the Run ended: the signal is lost")
			}
		})
	}
}
