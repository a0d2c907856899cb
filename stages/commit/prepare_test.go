package commit

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/stages/commit/fakekernel"
)

// overlapKernel is the fake kernel whose write of a step, but the last, waits
// for the next step's Prepare, and fails when that does not come while it
// waits: what a commit that prepares only after each write would do.
type overlapKernel struct {
	*fakekernel.Kernel
	steps    int // the write's number of steps
	mu       sync.Mutex
	prepared int
	more     chan struct{} // closed (and replaced) on each Prepare
}

func (k *overlapKernel) Prepare(payload []byte) func(context.Context) error {
	k.mu.Lock()
	k.prepared++
	n := k.prepared
	close(k.more)
	k.more = make(chan struct{})
	k.mu.Unlock()
	write := k.Kernel.Prepare(payload)
	return func(ctx context.Context) error {
		deadline := time.After(10 * time.Second)
		for n < k.steps {
			k.mu.Lock()
			ahead, more := k.prepared > n, k.more
			k.mu.Unlock()
			if ahead {
				break
			}
			select {
			case <-more:
			case <-deadline:
				return fmt.Errorf("step %d of %d was written without the next one prepared meanwhile", n, k.steps)
			}
		}
		return write(ctx)
	}
}

// TestLargeWritePreparesAhead: a full sync of several steps prepares each
// step (its payload and translation) while the kernel takes the one before,
// and leaves what a fresh kpipe writes.
func TestLargeWritePreparesAhead(t *testing.T) {
	st := largeState(maxChainsPerRestore)
	plan := planOf(st, 1, true)
	counted := fakekernel.New()
	if err := testStage(counted).apply(context.Background(), plan); err != nil {
		t.Fatal(err)
	}
	if counted.Restores < 3 {
		t.Fatalf("%d steps; the test needs a write of several", counted.Restores)
	}
	k := &overlapKernel{Kernel: fakekernel.New(), steps: counted.Restores, more: make(chan struct{})}
	if err := testStage(k).apply(context.Background(), plan); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k.Kernel, st, "after the write")
}

// heldKernel is the fake kernel that counts the steps prepared and not yet
// written, and records the most there were at once.
type heldKernel struct {
	*fakekernel.Kernel
	mu         sync.Mutex
	held, most int
}

func (k *heldKernel) Prepare(payload []byte) func(context.Context) error {
	k.mu.Lock()
	k.held++
	k.most = max(k.most, k.held)
	k.mu.Unlock()
	write := k.Kernel.Prepare(payload)
	return func(ctx context.Context) error {
		time.Sleep(time.Millisecond) // the kernel takes its time: the preparer runs ahead
		err := write(ctx)
		k.mu.Lock()
		k.held--
		k.mu.Unlock()
		return err
	}
}

// TestLargeWriteHoldsTwoSteps: while the kernel takes one step of a large
// write, only the next is prepared (at 10k services a prepared step is tens
// of MB of netlink messages; a third one in hand raised the peak heap by as
// much).
func TestLargeWriteHoldsTwoSteps(t *testing.T) {
	st := largeState(maxChainsPerRestore)
	k := &heldKernel{Kernel: fakekernel.New()}
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	if k.Restores < 4 {
		t.Fatalf("%d steps; the test needs a write of several", k.Restores)
	}
	if k.most > 2 {
		t.Errorf("%d steps were prepared and not yet written at once; want at most 2", k.most)
	}
	requireFresh(t, k.Kernel, st, "after the write")
}

// TestStepSizeFollowsWhatIsReachable: a first sync into a nat table without
// kpipe's chains is written in steps of chainsPerFreshStep chains (nothing
// the kernel validates on each transaction is reachable yet); a full write over
// kpipe's own chains in steps of up to maxChainsPerRestore (each transaction
// then pays the kernel's walk of every reachable chain).
func TestStepSizeFollowsWhatIsReachable(t *testing.T) {
	k := fakekernel.New()
	var sizes []int
	k.BeforeRestore = func(_ int, payload string) error {
		// chains written: the declared ones that are not deleted
		sizes = append(sizes, strings.Count(payload, "\n:")-strings.Count(payload, "\n-X "))
		return nil
	}
	st := largeState(maxChainsPerRestore)
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	if len(sizes) < 4 || slices.Max(sizes) > chainsPerFreshStep {
		t.Errorf("first sync: steps of %v chains; want several, of at most %d", sizes, chainsPerFreshStep)
	}
	requireFresh(t, k, st, "after the first sync")

	// A restarted kpipe (a new ledger) whose every service changed.
	sizes = nil
	changed := largeState(maxChainsPerRestore)
	for key, svc := range changed.Services {
		c := *svc
		c.Ports = slices.Clone(c.Ports)
		c.Ports[0].Port++
		changed.Services[key] = &c
	}
	if err := testStage(k).apply(context.Background(), planOf(changed, 1, true)); err != nil {
		t.Fatal(err)
	}
	if slices.Max(sizes) <= chainsPerFreshStep || slices.Max(sizes) > maxChainsPerRestore {
		t.Errorf("full write over kpipe's chains: steps of %v chains; want one of more than %d, none of more than %d",
			sizes, chainsPerFreshStep, maxChainsPerRestore)
	}
	requireFresh(t, k, changed, "after the rewrite")
}
