package commit

import (
	"context"
	"fmt"
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
