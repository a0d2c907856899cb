package canary

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
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
	s := NewStage(Params{Interval: time.Hour, Resync: map[bus.Family]*bus.ResyncFlag{bus.IPv4: resync}, Env: bus.Envs{Board: bus.NewBoard()}.For(bus.Canary)})
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
	fake := &fakeCanaries{alive: true}
	s, resync := fakeStage(fake)
	if err := s.check(context.Background(), bus.IPv4, fake); err != nil { // seen alive
		t.Fatal(err)
	}
	fake.set(false, nil)
	fake.ensureErr = errors.New("iptables: lock")
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

// tableCanaries keeps a canary per table, as iptables does; a table in noTable
// cannot hold one (a legacy kernel without that table's module): making it fails
// with noTableErr, and asking about it answers as noTable says.
type tableCanaries struct {
	mu      sync.Mutex
	alive   map[string]bool
	noTable map[string]noTableAnswer
	asked   map[string]int // EnsureCanaries and CanaryAlive calls, by table
}

// noTableAnswer is how CanaryAlive answers about a table that cannot exist.
type noTableAnswer int

const (
	answersGone  noTableAnswer = iota + 1 // false, nil: "No chain by that name" (nf_tables)
	answersError                          // the error (legacy: "Table does not exist")
)

// noTableErr is legacy iptables' answer for a table whose module is not loaded.
var noTableErr = fmt.Errorf("iptables -w 5 -t mangle -S KUBE-PROXY-CANARY 1: exit status 3: "+
	"iptables v1.8.9 (legacy): can't initialize iptables table `mangle': Table does not exist (do you need to insmod?): %w", nf.ErrNoTable)

func newTableCanaries(noTable map[string]noTableAnswer) *tableCanaries {
	return &tableCanaries{alive: map[string]bool{}, noTable: noTable, asked: map[string]int{}}
}

func (f *tableCanaries) EnsureCanaries(ctx context.Context, tables []string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, t := range tables {
		f.asked[t]++
		if f.noTable[t] != 0 {
			return noTableErr
		}
		f.alive[t] = true
	}
	return nil
}

func (f *tableCanaries) CanaryAlive(ctx context.Context, table string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.asked[table]++
	if f.noTable[table] == answersError {
		return false, noTableErr
	}
	return f.alive[table], nil
}

// flush removes table's canary, as iptables -F does.
func (f *tableCanaries) flush(table string) {
	f.mu.Lock()
	f.alive[table] = false
	f.mu.Unlock()
}

// calls is how often table was asked about.
func (f *tableCanaries) calls(table string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.asked[table]
}
