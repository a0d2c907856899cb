package watch

import (
	"context"
	"maps"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/supervise"
)

// refused is what a client gets while the apiserver is down.
var refused = &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}

// outage stands for the apiserver going away: while down, every list, watch
// and probe of the stage is refused; up, the probe answers with resourceVersion
// rv.
type outage struct {
	down          atomic.Bool
	rv            string
	refused       chan struct{} // a call or probe was refused (dropped when full)
	refusedCalls  atomic.Int32  // lists and watches refused
	refusedProbes atomic.Int32
}

func newOutage(rv string) *outage { return &outage{rv: rv, refused: make(chan struct{}, 1)} }

// setup makes the stage's probe the fake's, probing every 100-500 ms.
func (o *outage) setup(s *Stage) {
	s.probeBackoff = supervise.Backoff{Initial: 100 * time.Millisecond, Max: 500 * time.Millisecond}
	s.probe = func(context.Context) (string, error) {
		if err := o.refuse(&o.refusedProbes); err != nil {
			return "", err
		}
		return o.rv, nil
	}
}

// refuse is refused (counted in n) while down, and nil otherwise.
func (o *outage) refuse(n *atomic.Int32) error {
	if !o.down.Load() {
		return nil
	}
	n.Add(1)
	select {
	case o.refused <- struct{}{}:
	default:
	}
	return refused
}

// install makes h's fake apiserver refuse lists and watches while down.
func (o *outage) install(h *stageHarness) {
	for _, verb := range []string{"list", "watch"} {
		h.client.PrependReactor(verb, "*", func(k8stesting.Action) (bool, runtime.Object, error) {
			if err := o.refuse(&o.refusedCalls); err != nil {
				return true, nil, err
			}
			return false, nil, nil
		})
	}
	h.client.PrependWatchReactor("*", func(k8stesting.Action) (bool, k8swatch.Interface, error) {
		if err := o.refuse(&o.refusedCalls); err != nil {
			return true, nil, err
		}
		return false, nil, nil
	})
}

// start takes the apiserver away: it ends its watches as it goes. client-go
// lists again after a watch that ended within 1 s with no event (a "very
// short watch"); an apiserver restart ends watches that ran long, so start
// lets them run that long first.
func (o *outage) start(h *stageHarness) {
	o.install(h)
	time.Sleep(1100 * time.Millisecond)
	o.down.Store(true)
	h.stopWatches()
}

// waitRefused waits until the stage met the outage.
func (o *outage) waitRefused(t *testing.T) {
	t.Helper()
	select {
	case <-o.refused:
	case <-time.After(within):
		t.Fatal("no list, watch or probe was refused while the apiserver was down")
	}
}

// lists is how many lists of each resource the stage made so far.
func (h *stageHarness) lists() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := map[string]int{}
	for r, sel := range h.selectors {
		n[r] = len(sel)
	}
	return n
}

// createService creates service name (with resourceVersion rv, "" for none)
// and waits until it arrives, as a change; it returns how many replays came
// meanwhile.
func (h *stageHarness) createService(name, rv string) (replays int) {
	h.t.Helper()
	svc := service(name, "10.96.0.20", nil)
	svc.ResourceVersion = rv
	if _, err := h.client.CoreV1().Services("ns").Create(context.Background(), svc, metav1.CreateOptions{}); err != nil {
		h.t.Fatal(err)
	}
	h.next("service "+name, func(c bus.Change) bool {
		if c.Kind == bus.Replayed {
			replays++
		}
		return c.Kind == bus.ServiceChanged && c.Key.Name == name
	})
	return replays
}

// TestShortOutageResumesWatchesWithoutListing: the apiserver goes away
// briefly (a restart: its watches end, lists and watches are refused) and
// comes back. The informers resume their watches from their resourceVersion,
// as client-go's reflectors do on their own: not one list of Services,
// EndpointSlices or the Node, and no replay (at thousands of nodes, a list of
// everything by each on every apiserver restart is a relist storm). Changes
// made afterwards arrive as changes, and still nothing was listed after each.
func TestShortOutageResumesWatchesWithoutListing(t *testing.T) {
	o := newOutage("250") // later than any resourceVersion the stage saw
	h := startStageWith(t, o.setup, service("web", "10.96.0.10", nil), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	h.createService("before", "200")
	before := h.lists()
	o.start(h)
	o.waitRefused(t)
	o.down.Store(false)
	h.waitWatches()

	replays := 0
	noList := func(when string) {
		t.Helper()
		if after := h.lists(); !maps.Equal(after, before) || replays > 0 {
			t.Fatalf("%s: lists %v (%v before the outage), %d replays; want no list and no replay: the watches resume from their resourceVersion",
				when, after, before, replays)
		}
	}
	noList("once the watches were back")
	for _, name := range []string{"after-1", "after-2", "after-3"} {
		replays += h.createService(name, "")
		noList("once service " + name + " arrived")
	}
}

// TestOutageHoldsListsAndWatches: while the apiserver is away, the informers'
// calls wait for the probes instead of failing: each informer tries once, and
// its reflector never backs off (its backoff reaches 30-60 s, which a change
// made after the outage would wait). Each probe that goes unanswered adds no
// call; once one answers, the watches resume.
func TestOutageHoldsListsAndWatches(t *testing.T) {
	o := newOutage("")
	h := startStageWith(t, o.setup, service("web", "10.96.0.10", nil), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	o.start(h)
	for _, probes := range []int32{3, 6, 9} {
		for o.refusedProbes.Load() < probes {
			o.waitRefused(t)
		}
		if n := o.refusedCalls.Load(); n > 3 {
			t.Fatalf("%d lists and watches refused by the time %d probes were; want at most 3 (one per informer, then held)", n, probes)
		}
	}
	o.down.Store(false)
	h.waitWatches()
	h.createService("after", "")
}

// TestRelistsWhenTheAPIServerWentBackInTime: the apiserver answers again with
// a resourceVersion older than the informers hold (etcd restored from a
// snapshot). Their watches would wait, silent, until the restored store got
// past where they were; the stage lists everything anew and replays it
// instead (same Run, no restart).
func TestRelistsWhenTheAPIServerWentBackInTime(t *testing.T) {
	o := newOutage("150")
	h := startStageWith(t, o.setup, service("web", "10.96.0.10", nil), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	h.createService("later", "200") // taken out of etcd by the restore
	if err := h.client.Tracker().Delete(corev1.SchemeGroupVersion.WithResource("services"), "ns", "later"); err != nil {
		t.Fatal(err)
	}
	o.start(h)
	o.waitRefused(t)
	o.down.Store(false)
	st := h.nextReplay()
	if st.Services[webKey] == nil || st.Services[bus.ServiceKey{Namespace: "ns", Name: "later"}] != nil {
		t.Errorf("replay after the restore = %v; want web and not later", st.Services)
	}
	select {
	case err := <-h.done:
		t.Fatalf("Run returned %v: the stage restarted", err)
	default:
	}
}
