package commit

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/stages/commit/fakekernel"
)

// overlapKernel is the fake kernel whose write of a step waits (up to a
// while) for the next step's Prepare, and counts the writes that waited in
// vain: only the last step's may, when the next step is prepared meanwhile.
type overlapKernel struct {
	*fakekernel.Kernel
	mu       sync.Mutex
	prepared int
	writes   int
	alone    int           // writes no Prepare overlapped
	more     chan struct{} // a Prepare happened
}

func (k *overlapKernel) Prepare(payload []byte) func(context.Context) error {
	k.mu.Lock()
	k.prepared++
	n := k.prepared
	k.mu.Unlock()
	select {
	case k.more <- struct{}{}:
	default:
	}
	write := k.Kernel.Prepare(payload)
	return func(ctx context.Context) error {
		deadline := time.After(time.Second)
		for {
			k.mu.Lock()
			ahead := k.prepared > n
			k.mu.Unlock()
			if ahead {
				break
			}
			select {
			case <-k.more:
				continue
			case <-deadline:
			}
			k.mu.Lock()
			k.alone++
			k.mu.Unlock()
			break
		}
		k.mu.Lock()
		k.writes++
		k.mu.Unlock()
		return write(ctx)
	}
}

// TestLargeWritePreparesAhead: a full sync of several steps prepares each
// step (its payload and translation) while the kernel takes the one before,
// and leaves what a fresh kpipe writes.
func TestLargeWritePreparesAhead(t *testing.T) {
	st := largeState(maxChainsPerRestore)
	k := &overlapKernel{Kernel: fakekernel.New(), more: make(chan struct{}, 1)}
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	if k.writes < 3 {
		t.Fatalf("%d steps; the test needs a write of several", k.writes)
	}
	if k.alone != 1 {
		t.Errorf("%d of %d steps were written with no next step prepared meanwhile; want only the last", k.alone, k.writes)
	}
	requireFresh(t, k.Kernel, st, "after the write")
}
