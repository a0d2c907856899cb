package watch

import (
	"context"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/supervise"
)

// refused is what a client gets while the apiserver is down.
var refused = &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}

// TestRelistsAsSoonAsTheAPIServerAnswersAgain: the apiserver goes away (its
// watches end, lists and watches are refused) long enough for client-go's
// reflectors to back off to many seconds between attempts (0.8 s doubling to
// 30 s, up to twice that with jitter: after a one-minute outage the next try
// may come a minute later). A Service created meanwhile must reach coalesce
// within a few seconds of the apiserver answering again, not when the
// reflectors next try: watch probes the apiserver while it is lost and, once
// it answers, lists everything anew and replays it (same Run, no restart).
// The test waits for that replay, which the reflectors' own retry never sends.
func TestRelistsAsSoonAsTheAPIServerAnswersAgain(t *testing.T) {
	var down atomic.Bool
	h := startStageWith(t, func(s *Stage) {
		s.probeBackoff = supervise.Backoff{Initial: 100 * time.Millisecond, Max: 500 * time.Millisecond}
		s.probe = func(context.Context) error {
			if down.Load() {
				return refused
			}
			return nil
		}
	}, service("web", "10.96.0.10", nil), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	for _, verb := range []string{"list", "watch"} {
		h.client.PrependReactor(verb, "*", func(k8stesting.Action) (bool, runtime.Object, error) {
			if down.Load() {
				return true, nil, refused
			}
			return false, nil, nil
		})
	}
	h.client.PrependWatchReactor("*", func(k8stesting.Action) (bool, k8swatch.Interface, error) {
		if down.Load() {
			return true, nil, refused
		}
		return false, nil, nil
	})
	down.Store(true)
	h.stopWatches() // the apiserver ends its watches as it goes
	const outage = 12 * time.Second
	time.Sleep(outage / 2)
	if err := h.client.Tracker().Add(service("late", "10.96.0.11", nil)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(outage / 2)
	down.Store(false)
	back := time.Now()
	// A replay, not a change: a reflector that happened to retry within the
	// window would bring service late as a change, and new informers as a replay.
	h.next("a replay with service late, created during the outage", func(c bus.Change) bool {
		return c.Kind == bus.Replayed && c.Replay.Services[bus.ServiceKey{Namespace: "ns", Name: "late"}] != nil
	})
	if took := time.Since(back); took > 2*time.Second {
		t.Fatalf("service late reached coalesce %v after the apiserver answered again; want within 2s", took.Round(time.Millisecond))
	} else {
		t.Logf("service late reached coalesce %v after the apiserver answered again", took.Round(time.Millisecond))
	}
	select {
	case err := <-h.done:
		t.Fatalf("Run returned %v: the stage restarted", err)
	default:
	}
}
