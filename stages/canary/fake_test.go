package canary

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// fakeCanaries answers CanaryAlive from its fields.
type fakeCanaries struct {
	mu        sync.Mutex
	alive     bool
	err       error // CanaryAlive's error, when set
	ensured   int   // EnsureCanaries calls
	ensureErr error
}

func (f *fakeCanaries) EnsureCanaries(ctx context.Context, tables []string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ensured++
	if f.ensureErr != nil {
		return f.ensureErr
	}
	f.alive = true
	return nil
}

func (f *fakeCanaries) CanaryAlive(ctx context.Context, table string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.alive, f.err
}

func (f *fakeCanaries) set(alive bool, err error) {
	f.mu.Lock()
	f.alive, f.err = alive, err
	f.mu.Unlock()
}

func fakeStage(fake *fakeCanaries) (*Stage, *bus.ResyncFlag) {
	resync := bus.NewResyncFlag()
	s := NewStage(Params{Interval: time.Hour, Resync: map[bus.Family]*bus.ResyncFlag{bus.IPv4: resync}, Env: bus.Envs{}.For(bus.Canary)})
	s.tools = map[bus.Family]Canaries{bus.IPv4: fake}
	return s, resync
}

// An iptables error is not a flush: it asks for no resync, however often it
// happens, and after a few in a row the stage fails (so the supervisor backs off
// and restarts it) instead of going on as if nothing were wrong.
func TestCheckErrorIsNotAFlush(t *testing.T) {
	fake := &fakeCanaries{alive: true}
	s, resync := fakeStage(fake)
	ctx := context.Background()
	iptablesDown := errors.New("iptables: Resource temporarily unavailable")
	for round := range 3 {
		fake.set(false, iptablesDown)
		for i := 1; i <= maxFailures; i++ {
			err := s.check(ctx, bus.IPv4, fake)
			if i < maxFailures && err != nil {
				t.Fatalf("round %d: check failure %d returned %v; want nil until %d in a row", round, i, err, maxFailures)
			}
			if i == maxFailures && !errors.Is(err, iptablesDown) {
				t.Fatalf("round %d: check failure %d returned %v; want the iptables error", round, i, err)
			}
			if resync.Lower() {
				t.Fatalf("round %d: check failure %d asked for a full resync", round, i)
			}
		}
		// A good check in between starts the count again.
		fake.set(true, nil)
		if err := s.check(ctx, bus.IPv4, fake); err != nil || resync.Lower() {
			t.Fatalf("round %d: check with the canary in place = %v, resync %v", round, err, !resync.Lower())
		}
		fake.set(false, iptablesDown)
		if err := s.check(ctx, bus.IPv4, fake); err != nil {
			t.Fatalf("round %d: the first failure after a good check returned %v", round, err)
		}
		fake.set(true, nil)
		if err := s.check(ctx, bus.IPv4, fake); err != nil {
			t.Fatal(err)
		}
	}
}

// A flush is noticed even when putting the canary back fails: the resync is
// asked for first, so it is not lost with the error.
func TestFlushResyncsEvenIfRepairFails(t *testing.T) {
	fake := &fakeCanaries{alive: false, ensureErr: errors.New("iptables: lock")}
	s, resync := fakeStage(fake)
	if err := s.check(context.Background(), bus.IPv4, fake); err == nil {
		t.Error("check hid the failure to put the canary back")
	}
	if !resync.Lower() {
		t.Error("a flushed canary asked for no resync because putting it back failed")
	}
}

// Run fails, for the supervisor to back off, when iptables keeps failing; it never
// asks for a resync meanwhile.
func TestRunFailsAfterRepeatedErrors(t *testing.T) {
	fake := &fakeCanaries{}
	s, resync := fakeStage(fake)
	s.interval = time.Millisecond
	fake.ensureErr = nil
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	go func() {
		// After the start-up EnsureCanaries, every check fails.
		for ctx.Err() == nil {
			fake.mu.Lock()
			ensured := fake.ensured
			fake.mu.Unlock()
			if ensured > 0 {
				fake.set(false, errors.New("iptables: exit status 4"))
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	if err := s.Run(ctx); err == nil {
		t.Fatal("Run went on for 5s with every check failing")
	}
	if resync.Lower() {
		t.Error("failing checks asked for a resync")
	}
}
