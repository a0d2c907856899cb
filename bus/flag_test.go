package bus_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

func TestFlagRaiseTwiceIsOneReceive(t *testing.T) {
	f := bus.NewFlag()
	select {
	case <-f.C():
		t.Fatal("a new flag is up")
	default:
	}
	f.Raise()
	f.Raise()
	select {
	case <-f.C():
	case <-time.After(within):
		t.Fatal("raised flag not seen")
	}
	select {
	case <-f.C():
		t.Fatal("two raises gave two receives; want one")
	case <-time.After(50 * time.Millisecond):
	}
}

func TestFlagLowerReportsWhetherItWasUp(t *testing.T) {
	f := bus.NewFlag()
	if f.Lower() {
		t.Fatal("Lower on a new flag = true; want false")
	}
	f.Raise()
	if !f.Lower() {
		t.Fatal("Lower on a raised flag = false; want true")
	}
	if f.Lower() {
		t.Fatal("second Lower = true; want false")
	}
	select {
	case <-f.C():
		t.Fatal("lowered flag still receivable")
	default:
	}
	f.Raise()
	<-f.C()
	if f.Lower() {
		t.Fatal("Lower after the raise was received = true; want false")
	}
}

// A raise is never lost: whatever a raiser wrote before raising, the receiver reads
// after a receive that follows it. Each raiser bumps a counter and raises; the
// receiver, on each receive, reads the counter. Once every raiser is done, the
// receiver must come to see the final count.
func TestFlagRaiseNeverLostUnderConcurrency(t *testing.T) {
	const raisers, perRaiser = 8, 2000
	f := bus.NewFlag()
	var written, observed atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var rwg sync.WaitGroup
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case <-f.C():
				storeMax(&observed, written.Load())
			}
		}
	}()
	// A second consumer that lowers now and then: a Lower that returns true must
	// also be followed by a read.
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		for ctx.Err() == nil {
			if f.Lower() {
				storeMax(&observed, written.Load())
			}
			time.Sleep(time.Millisecond)
		}
	}()
	var wg sync.WaitGroup
	for range raisers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range perRaiser {
				written.Add(1)
				f.Raise()
			}
		}()
	}
	wg.Wait()
	want := int64(raisers * perRaiser)
	deadline := time.Now().Add(within)
	for observed.Load() < want {
		if time.Now().After(deadline) {
			t.Fatalf("after all raises, the receivers saw %d of %d: a raise was lost", observed.Load(), want)
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	rwg.Wait()
}

func storeMax(v *atomic.Int64, n int64) {
	for {
		o := v.Load()
		if o >= n || v.CompareAndSwap(o, n) {
			return
		}
	}
}
