package bus_test

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// within is how long a test waits for something that should happen; it bounds a hang,
// never a speed.
const within = 5 * time.Second

func TestMailboxLatestWins(t *testing.T) {
	m := bus.NewMailbox[int]()
	m.Put(1)
	m.Put(2)
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	v, err := m.Take(ctx)
	if err != nil || v != 2 {
		t.Fatalf("Take after Put(1), Put(2) = %d, %v; want 2, nil", v, err)
	}
	if v, ok := m.TryTake(); ok {
		t.Fatalf("TryTake after the only value was taken = %d, true; want nothing", v)
	}
}

func TestMailboxTakeBlocksUntilPut(t *testing.T) {
	m := bus.NewMailbox[string]()
	got := make(chan string, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), within)
		defer cancel()
		v, err := m.Take(ctx)
		if err != nil {
			v = "error: " + err.Error()
		}
		got <- v
	}()
	select {
	case v := <-got:
		t.Fatalf("Take returned %q before anything was put", v)
	case <-time.After(100 * time.Millisecond):
	}
	m.Put("hello")
	select {
	case v := <-got:
		if v != "hello" {
			t.Fatalf("Take = %q; want hello", v)
		}
	case <-time.After(within):
		t.Fatal("Take did not return after Put")
	}
}

func TestMailboxTakeReturnsContextErrorOnCancel(t *testing.T) {
	m := bus.NewMailbox[int]()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := m.Take(ctx)
		errc <- err
	}()
	time.Sleep(20 * time.Millisecond)
	cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Take after cancel returned %v; want context.Canceled", err)
		}
	case <-time.After(within):
		t.Fatal("Take did not return after its context was cancelled")
	}
	// The mailbox still works for the next consumer (a restarted stage).
	m.Put(7)
	ctx2, cancel2 := context.WithTimeout(context.Background(), within)
	defer cancel2()
	if v, err := m.Take(ctx2); err != nil || v != 7 {
		t.Fatalf("Take after a cancelled Take = %d, %v; want 7, nil", v, err)
	}
}

func TestMailboxTakeWithDeadlineReturnsDeadlineExceeded(t *testing.T) {
	m := bus.NewMailbox[int]()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := m.Take(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Take on an empty mailbox past its deadline = %v; want DeadlineExceeded", err)
	}
}

func TestMailboxReadyAndTryTake(t *testing.T) {
	m := bus.NewMailbox[int]()
	if v, ok := m.TryTake(); ok {
		t.Fatalf("TryTake on an empty mailbox = %d, true", v)
	}
	select {
	case <-m.Ready():
		t.Fatal("Ready signalled on a mailbox nothing was put in")
	default:
	}
	m.Put(3)
	m.Put(4)
	select {
	case <-m.Ready():
	case <-time.After(within):
		t.Fatal("Ready not signalled after Put")
	}
	if v, ok := m.TryTake(); !ok || v != 4 {
		t.Fatalf("TryTake = %d, %v; want 4, true", v, ok)
	}
	if v, ok := m.TryTake(); ok {
		t.Fatalf("second TryTake = %d, true; want empty", v)
	}
	// A value put while nobody listens is still announced to a later listener.
	m.Put(5)
	select {
	case <-m.Ready():
	case <-time.After(within):
		t.Fatal("Ready not signalled for a value put before the listener came")
	}
	if v, ok := m.TryTake(); !ok || v != 5 {
		t.Fatalf("TryTake = %d, %v; want 5, true", v, ok)
	}
}

func TestMailboxTakeAfterStaleReadyWaitsForNextPut(t *testing.T) {
	m := bus.NewMailbox[int]()
	m.Put(1)
	if _, ok := m.TryTake(); !ok { // leaves the Ready token behind
		t.Fatal("TryTake after Put found nothing")
	}
	got := make(chan int, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), within)
		defer cancel()
		v, _ := m.Take(ctx)
		got <- v
	}()
	select {
	case v := <-got:
		t.Fatalf("Take returned %d from an empty mailbox (stale Ready signal)", v)
	case <-time.After(100 * time.Millisecond):
	}
	m.Put(2)
	select {
	case v := <-got:
		if v != 2 {
			t.Fatalf("Take = %d; want 2", v)
		}
	case <-time.After(within):
		t.Fatal("Take did not return after Put")
	}
}

// Many producers and consumers: no value is taken twice, a consumer never takes a
// producer's value older than one it already took from that producer, and the
// very last value put is taken.
func TestMailboxConcurrentLatestWins(t *testing.T) {
	type msg struct{ producer, seq int }
	const producers, perProducer, consumers = 8, 500, 4
	m := bus.NewMailbox[msg]()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var mu sync.Mutex
	seen := map[msg]bool{}
	var dup, backwards atomic.Int64
	var cwg sync.WaitGroup
	for range consumers {
		cwg.Add(1)
		go func() {
			defer cwg.Done()
			last := make([]int, producers) // per consumer: takes are sequential
			for {
				v, err := m.Take(ctx)
				if err != nil {
					return
				}
				if v.producer >= 0 {
					if v.seq <= last[v.producer] {
						backwards.Add(1)
					}
					last[v.producer] = v.seq
				}
				mu.Lock()
				if seen[v] {
					dup.Add(1)
				}
				seen[v] = true
				mu.Unlock()
			}
		}()
	}
	var pwg sync.WaitGroup
	for p := range producers {
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			for i := 1; i <= perProducer; i++ {
				m.Put(msg{p, i})
			}
		}()
	}
	pwg.Wait()
	final := msg{-1, 0}
	m.Put(final) // after every other Put: latest wins, so it must be taken
	deadline := time.Now().Add(within)
	for {
		mu.Lock()
		done := seen[final]
		mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the last value put was never taken")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	cwg.Wait()
	if dup.Load() != 0 {
		t.Errorf("%d values were taken twice", dup.Load())
	}
	if backwards.Load() != 0 {
		t.Errorf("%d times a consumer took a value older than one it had taken", backwards.Load())
	}
}

// A merging mailbox loses nothing: with a summing merge, what the consumers take adds
// up to everything the producers put, however Puts and Takes interleave.
func TestMergingMailboxConcurrentLosesNothing(t *testing.T) {
	const producers, perProducer, consumers = 8, 1000, 3
	m := bus.NewMergingMailbox(func(a, b int) int { return a + b })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var total atomic.Int64
	var cwg sync.WaitGroup
	for range consumers {
		cwg.Add(1)
		go func() {
			defer cwg.Done()
			for {
				v, err := m.Take(ctx)
				if err != nil {
					return
				}
				total.Add(int64(v))
			}
		}()
	}
	var pwg sync.WaitGroup
	for range producers {
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			for range perProducer {
				m.Put(1)
			}
		}()
	}
	pwg.Wait()
	want := int64(producers * perProducer)
	deadline := time.Now().Add(within)
	for total.Load() != want {
		if time.Now().After(deadline) {
			t.Fatalf("consumers took %d in all; want %d", total.Load(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	cwg.Wait()
	if v, ok := m.TryTake(); ok {
		t.Fatalf("mailbox still holds %d after everything was counted", v)
	}
	if total.Load() != want {
		t.Fatalf("consumers took %d in all; want %d", total.Load(), want)
	}
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func TestMergingMailboxStaleFlows(t *testing.T) {
	a, b, c := ap("10.0.0.1:53"), ap("10.0.0.2:53"), ap("0.0.0.0:30053")
	epA := []netip.AddrPort{ap("10.244.1.5:53")}

	tests := []struct {
		name     string
		puts     []bus.StaleFlows
		wantNow  map[netip.AddrPort][]netip.AddrPort
		wantGone []netip.AddrPort
	}{
		{
			name:    "single value passes through",
			puts:    []bus.StaleFlows{{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{a: epA}, Gone: map[netip.AddrPort]bool{b: true}}},
			wantNow: map[netip.AddrPort][]netip.AddrPort{a: epA}, wantGone: []netip.AddrPort{b},
		},
		{
			name: "gone in either stays gone",
			puts: []bus.StaleFlows{
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{a: epA}, Gone: map[netip.AddrPort]bool{b: true}},
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{}, Gone: map[netip.AddrPort]bool{a: true}},
			},
			wantNow: map[netip.AddrPort][]netip.AddrPort{}, wantGone: []netip.AddrPort{a, b},
		},
		{
			name: "gone then back is not gone",
			puts: []bus.StaleFlows{
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{}, Gone: map[netip.AddrPort]bool{a: true, c: true}},
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{a: epA}, Gone: map[netip.AddrPort]bool{}},
			},
			wantNow: map[netip.AddrPort][]netip.AddrPort{a: epA}, wantGone: []netip.AddrPort{c},
		},
		{
			name: "back then gone again is gone",
			puts: []bus.StaleFlows{
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{}, Gone: map[netip.AddrPort]bool{a: true}},
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{a: epA}},
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{}, Gone: map[netip.AddrPort]bool{a: true}},
			},
			wantNow: map[netip.AddrPort][]netip.AddrPort{}, wantGone: []netip.AddrPort{a},
		},
		{
			name: "newest endpoints win",
			puts: []bus.StaleFlows{
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{a: epA}},
				{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{a: {ap("10.244.2.9:53")}}},
			},
			wantNow: map[netip.AddrPort][]netip.AddrPort{a: {ap("10.244.2.9:53")}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := bus.NewMergingMailbox(bus.MergeStaleFlows)
			for _, p := range tt.puts {
				m.Put(p)
			}
			got, ok := m.TryTake()
			if !ok {
				t.Fatal("nothing to take after Puts")
			}
			if got.Family != bus.IPv4 {
				t.Errorf("Family = %v; want IPv4", got.Family)
			}
			if len(got.Now) != len(tt.wantNow) {
				t.Errorf("Now = %v; want %v", got.Now, tt.wantNow)
			}
			for k, want := range tt.wantNow {
				if g := got.Now[k]; len(g) != len(want) || (len(g) > 0 && g[0] != want[0]) {
					t.Errorf("Now[%v] = %v; want %v", k, g, want)
				}
			}
			if len(got.Gone) != len(tt.wantGone) {
				t.Errorf("Gone = %v; want exactly %v", got.Gone, tt.wantGone)
			}
			for _, g := range tt.wantGone {
				if !got.Gone[g] {
					t.Errorf("Gone = %v; want it to hold %v", got.Gone, g)
				}
			}
		})
	}
}

func TestMergeStaleFlowsDoesNotModifyInputs(t *testing.T) {
	a, b := ap("10.0.0.1:53"), ap("10.0.0.2:53")
	prev := bus.StaleFlows{Family: bus.IPv4, Gone: map[netip.AddrPort]bool{a: true}}
	next := bus.StaleFlows{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{a: nil}, Gone: map[netip.AddrPort]bool{b: true}}
	_ = bus.MergeStaleFlows(prev, next)
	if len(prev.Gone) != 1 || !prev.Gone[a] || len(next.Gone) != 1 || !next.Gone[b] {
		t.Fatalf("merge changed its inputs: prev.Gone=%v next.Gone=%v", prev.Gone, next.Gone)
	}
}

func TestMergingMailboxHealthCheckUpdates(t *testing.T) {
	key := bus.ServiceKey{Namespace: "ns", Name: "lb"}
	v4old := bus.HealthChecks{Family: bus.IPv4, Services: map[bus.ServiceKey]bus.HealthCheck{key: {NodePort: 30000, LocalEndpoints: 1}}}
	v6 := bus.HealthChecks{Family: bus.IPv6, Services: map[bus.ServiceKey]bus.HealthCheck{key: {NodePort: 30000, LocalEndpoints: 3}}}
	v4new := bus.HealthChecks{Family: bus.IPv4, Services: map[bus.ServiceKey]bus.HealthCheck{key: {NodePort: 30000, LocalEndpoints: 0}}}

	m := bus.NewMergingMailbox(bus.MergeHealthCheckUpdates)
	m.Put(bus.HealthCheckUpdates{bus.IPv4: v4old})
	m.Put(bus.HealthCheckUpdates{bus.IPv6: v6})
	m.Put(bus.HealthCheckUpdates{bus.IPv4: v4new})
	got, ok := m.TryTake()
	if !ok {
		t.Fatal("nothing to take")
	}
	if len(got) != 2 {
		t.Fatalf("got %d families; want 2: %v", len(got), got)
	}
	if n := got[bus.IPv4].Services[key].LocalEndpoints; n != 0 {
		t.Errorf("IPv4 local endpoints = %d; want the newest (0)", n)
	}
	if n := got[bus.IPv6].Services[key].LocalEndpoints; n != 3 {
		t.Errorf("IPv6 local endpoints = %d; want 3 (kept from an earlier put)", n)
	}
	// Taken: the next Put starts afresh.
	m.Put(bus.HealthCheckUpdates{bus.IPv6: v6})
	got, _ = m.TryTake()
	if _, ok := got[bus.IPv4]; ok || len(got) != 1 {
		t.Fatalf("after a Take, the next value = %v; want only IPv6", got)
	}
}

// staleFlowsGen is generation gen of the UDP front-ends: 10.96.0.10:53 answered by
// an endpoint whose port is gen, and a front-end of its own gone.
func staleFlowsGen(gen int) bus.StaleFlows {
	return bus.StaleFlows{Family: bus.IPv4,
		Now:  map[netip.AddrPort][]netip.AddrPort{ap("10.96.0.10:53"): {netip.AddrPortFrom(netip.MustParseAddr("10.244.1.5"), uint16(gen))}},
		Gone: map[netip.AddrPort]bool{netip.AddrPortFrom(netip.MustParseAddr("10.96.1.1"), uint16(gen)): true}}
}

func genOf(v bus.StaleFlows) int { return int(v.Now[ap("10.96.0.10:53")][0].Port()) }

// A value put back with Requeue is the older one: what was put meanwhile wins
// (MergeStaleFlows keeps the newer endpoints), and nothing gone is forgotten.
func TestMailboxRequeueIsOlder(t *testing.T) {
	m := bus.NewMergingMailbox(bus.MergeStaleFlows)
	m.Put(staleFlowsGen(1))
	taken, _ := m.TryTake()
	m.Put(staleFlowsGen(2)) // a commit while the consumer was failing
	m.Requeue(taken)
	got, ok := m.TryTake()
	if !ok {
		t.Fatal("nothing to take after Requeue")
	}
	if genOf(got) != 2 {
		t.Errorf("after a Requeue of generation 1 over generation 2, the endpoints are generation %d's; want 2's", genOf(got))
	}
	for _, gen := range []int{1, 2} {
		for k := range staleFlowsGen(gen).Gone {
			if !got.Gone[k] {
				t.Errorf("Gone = %v lost generation %d's %v", got.Gone, gen, k)
			}
		}
	}

	// Nothing waiting: the value comes back as it was.
	m.Requeue(taken)
	if got, ok := m.TryTake(); !ok || genOf(got) != 1 || len(got.Gone) != 1 {
		t.Errorf("Requeue into an empty mailbox then TryTake = %v, %v; want generation 1", got, ok)
	}

	// Latest-wins: a value put back never replaces a newer one.
	lw := bus.NewMailbox[int]()
	lw.Put(2)
	lw.Requeue(1)
	if v, _ := lw.TryTake(); v != 2 {
		t.Errorf("latest-wins Requeue(1) over 2 left %d; want 2", v)
	}
	lw.Requeue(1)
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	if v, err := lw.Take(ctx); err != nil || v != 1 {
		t.Errorf("Take after Requeue into an empty mailbox = %d, %v; want 1", v, err)
	}
}

// With the real, order-dependent merge, a consumer that puts back what it took
// (a failed pass) never afterwards works on endpoints older than what was put before
// it put the value back, and at the end it has seen every gone front-end.
func TestMergingMailboxRequeueConcurrent(t *testing.T) {
	const gens = 3000
	m := bus.NewMergingMailbox(bus.MergeStaleFlows)
	var lastPut atomic.Int64
	go func() {
		for gen := 1; gen <= gens; gen++ {
			m.Put(staleFlowsGen(gen))
			lastPut.Store(int64(gen))
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	gone := map[netip.AddrPort]bool{}
	floor, takes := 0, 0
	for done := 0; done < gens; {
		v, err := m.Take(ctx)
		if err != nil {
			t.Fatalf("consumer stuck after generation %d: %v", done, err)
		}
		takes++
		if gen := genOf(v); gen < floor {
			t.Fatalf("took generation %d after putting back a value when generation %d was already put", gen, floor)
		}
		if takes%2 == 1 {
			floor = int(lastPut.Load()) // all of these were put before the Requeue
			m.Requeue(v)
			continue
		}
		for k := range v.Gone {
			gone[k] = true
		}
		done = genOf(v)
	}
	if len(gone) != gens {
		t.Errorf("consumer saw %d gone front-ends; want %d", len(gone), gens)
	}
}
