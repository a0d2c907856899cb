package watch

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netlink"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/bus"
)

// fakeAddrWatch stands in for the netlink address subscription: each subscribe
// hands out a channel the test closes to end it, as the kernel socket can.
type fakeAddrWatch struct{ subs chan chan netlink.AddrUpdate }

func newFakeAddrWatch() *fakeAddrWatch {
	return &fakeAddrWatch{subs: make(chan chan netlink.AddrUpdate, 4)}
}

func (f *fakeAddrWatch) subscribe(<-chan struct{}) (<-chan netlink.AddrUpdate, error) {
	ch := make(chan netlink.AddrUpdate)
	f.subs <- ch
	return ch, nil
}

// TestStageReturnsWhenAddressWatchCloses: a Run that fails with its context live
// must return (so the supervisor restarts it), and the restarted Run replays.
func TestStageReturnsWhenAddressWatchCloses(t *testing.T) {
	addrs := newFakeAddrWatch()
	h := startStageWith(t, func(s *Stage) { s.watchAddrs = true; s.subscribe = addrs.subscribe },
		service("web", "10.96.0.10", nil), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	close(<-addrs.subs)
	if err := h.exit(); err == nil {
		t.Fatal("Run returned nil after the address subscription closed; want an error")
	}

	h.run() // the supervisor's restart
	if st := h.nextReplay(); st.Services[webKey] == nil {
		t.Errorf("replay after restart = %v; want web", st.Services)
	}
}

// panicOnce makes beforeSend panic on the first change of kind.
func panicOnce(kind bus.ChangeKind) func(*Stage) {
	var done atomic.Bool
	return func(s *Stage) {
		s.beforeSend = func(c bus.Change) {
			if c.Kind == kind && done.CompareAndSwap(false, true) {
				panic("conversion bug")
			}
		}
	}
}

// TestStageHandlerPanicBecomesError: a panic in an informer handler (client-go's
// goroutine) must not kill the process; Run returns an error and the restart replays.
func TestStageHandlerPanicBecomesError(t *testing.T) {
	h := startStageWith(t, panicOnce(bus.ServiceChanged), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	if _, err := h.client.CoreV1().Services("ns").Create(context.Background(), service("web", "10.96.0.10", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := h.exit(); err == nil {
		t.Fatal("Run returned nil after a handler panicked; want an error")
	}

	h.run()
	if st := h.nextReplay(); st.Services[webKey] == nil {
		t.Errorf("replay after restart = %v; want web", st.Services)
	}
}

// TestStageReplayPanicBecomesError: a panic while building a replay is an error
// from Run, and the next Run's replay goes through.
func TestStageReplayPanicBecomesError(t *testing.T) {
	h := startStageWith(t, panicOnce(bus.Replayed), service("web", "10.96.0.10", nil), node("node-1"))
	if err := h.exit(); err == nil {
		t.Fatal("Run returned nil after the replay panicked; want an error")
	}

	h.run()
	if st := h.nextReplay(); st.Services[webKey] == nil {
		t.Errorf("replay after restart = %v; want web", st.Services)
	}
}
