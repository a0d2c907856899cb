package canary

import (
	"context"
	"errors"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	nf "github.com/kpipe/kpipe/netfilter"
)

const svc = "KUBE-SVC-AAAAAAAAAAAAAAAA"

// What another writer's changes ask commit to repair: only kpipe's chains and
// jumps, everything when a table went or changes were lost; nothing for other
// agents' chains, other tables, or chains and tables merely created.
func TestRepairFor(t *testing.T) {
	ch := func(k nf.ChangeKind, table, chain string) nf.Change {
		return nf.Change{Kind: k, Table: table, Chain: chain}
	}
	tests := []struct {
		name     string
		in       tamper
		chains   map[string][]string
		jumps    []string
		lost     bool
		canaries bool
	}{
		{name: "nat flushed", in: tamper{changes: []nf.Change{
			ch(nf.RuleDeleted, "nat", "PREROUTING"), ch(nf.RuleDeleted, "nat", "OUTPUT"), ch(nf.RuleDeleted, "nat", nf.ChainServices),
			ch(nf.RuleDeleted, "nat", svc), ch(nf.RuleDeleted, "nat", nf.ChainCanary), ch(nf.RuleDeleted, "nat", "AGENT")}},
			chains: map[string][]string{"nat": {nf.ChainServices, svc}}, jumps: []string{"nat"}, lost: true, canaries: true},
		{name: "a kpipe chain deleted", in: tamper{changes: []nf.Change{ch(nf.ChainDeleted, "nat", svc)}},
			chains: map[string][]string{"nat": {svc}}},
		{name: "nat table deleted", in: tamper{changes: []nf.Change{ch(nf.RuleDeleted, "nat", svc), ch(nf.ChainDeleted, "nat", svc),
			ch(nf.ChainDeleted, "nat", "PREROUTING"), ch(nf.TableDeleted, "nat", "")}},
			chains: map[string][]string{"nat": {svc}}, jumps: []string{"nat"}, lost: true, canaries: true},
		// Another agent's rule: kpipe's jumps are all there, wherever it put it.
		{name: "a rule inserted in a built-in chain", in: tamper{changes: []nf.Change{ch(nf.RuleAdded, "nat", "PREROUTING")}}},
		{name: "a rule deleted from a built-in chain", in: tamper{changes: []nf.Change{ch(nf.RuleDeleted, "filter", "FORWARD")}},
			jumps: []string{"filter"}},
		{name: "another agent moved its rule first (-D, -I)", in: tamper{changes: []nf.Change{
			ch(nf.RuleDeleted, "nat", "PREROUTING"), ch(nf.RuleAdded, "nat", "PREROUTING")}}, jumps: []string{"nat"}},
		{name: "filter and mangle flushed", in: tamper{changes: []nf.Change{ch(nf.RuleDeleted, "filter", "INPUT"),
			ch(nf.RuleDeleted, "filter", nf.ChainForward), ch(nf.RuleDeleted, "filter", nf.ChainCanary), ch(nf.RuleDeleted, "mangle", "PREROUTING")}},
			chains: map[string][]string{"filter": {nf.ChainForward}}, jumps: []string{"filter"}, lost: true, canaries: true},
		{name: "the mangle canary deleted", in: tamper{changes: []nf.Change{ch(nf.ChainDeleted, "mangle", nf.ChainCanary)}}, lost: true, canaries: true},
		{name: "changes lost", in: tamper{overflowed: true}, jumps: []string{"filter", "nat"}},
		{name: "changes lost, a canary gone", in: tamper{overflowed: true, lost: true}, jumps: []string{"filter", "nat"}, lost: true, canaries: true},
		{name: "other agents and tables", in: tamper{changes: []nf.Change{ch(nf.RuleAdded, "nat", "AGENT"), ch(nf.ChainDeleted, "filter", "AGENT"),
			ch(nf.RuleDeleted, "raw", "PREROUTING"), ch(nf.RuleDeleted, "security", svc), ch(nf.TableDeleted, "raw", ""),
			ch(nf.RuleDeleted, "mangle", svc), ch(nf.RuleAdded, "mangle", "PREROUTING")}}},
		{name: "created, not changed", in: tamper{changes: []nf.Change{ch(nf.TableAdded, "nat", ""), ch(nf.ChainAdded, "nat", "PREROUTING"),
			ch(nf.ChainAdded, "nat", nf.ChainCanary), ch(nf.RuleAdded, "nat", nf.ChainCanary)}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rep, canaries := repairFor(tt.in)
			got := map[string][]string{}
			for table, cs := range rep.Chains {
				got[table] = slices.Sorted(maps.Keys(cs))
			}
			if tt.chains == nil {
				tt.chains = map[string][]string{}
			}
			if !maps.EqualFunc(got, tt.chains, slices.Equal) {
				t.Errorf("chains %v; want %v", got, tt.chains)
			}
			if jumps := slices.Sorted(maps.Keys(rep.Jumps)); !slices.Equal(jumps, tt.jumps) {
				t.Errorf("jumps %v; want %v", jumps, tt.jumps)
			}
			if rep.Lost != tt.lost || canaries != tt.canaries {
				t.Errorf("lost %v, canaries %v; want %v, %v", rep.Lost, canaries, tt.lost, tt.canaries)
			}
			if rep.Empty() != (len(tt.chains) == 0 && len(tt.jumps) == 0 && !tt.lost) {
				t.Errorf("Empty() = %v for %+v", rep.Empty(), rep)
			}
		})
	}
}

// fakeChanges hands out what the test sends it.
type fakeChanges struct {
	c      chan []nf.Change
	errs   chan error
	closed chan struct{}
}

func newFakeChanges() *fakeChanges {
	return &fakeChanges{c: make(chan []nf.Change), errs: make(chan error), closed: make(chan struct{})}
}

func (f *fakeChanges) Next(ctx context.Context) ([]nf.Change, error) {
	select {
	case cs := <-f.c:
		return cs, nil
	case err := <-f.errs:
		return nil, err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (f *fakeChanges) Close() error { close(f.closed); return nil }

// tamperStage runs a canary stage whose IPv4 family is subscribed to sub (or, with
// sub nil, on the legacy backend) until the test ends.
func tamperStage(t *testing.T, sub *fakeChanges, interval time.Duration) (*fakeCanaries, *bus.Mailbox[bus.Repair], *bus.ResyncFlag, chan error) {
	fake := &fakeCanaries{alive: true}
	resync, repairs := bus.NewResyncFlag(), bus.NewMergingMailbox(bus.MergeRepairs)
	subscribe := func(context.Context) (Changes, error) { return nil, nf.ErrNotNFTables }
	if sub != nil {
		subscribe = func(context.Context) (Changes, error) { return sub, nil }
	}
	s := NewStage(Params{Interval: interval, Resync: map[bus.Family]*bus.ResyncFlag{bus.IPv4: resync},
		Tools: map[bus.Family]Canaries{bus.IPv4: fake}, Repairs: map[bus.Family]*bus.Mailbox[bus.Repair]{bus.IPv4: repairs},
		Subscribe: map[bus.Family]Subscribe{bus.IPv4: subscribe}, Env: bus.Envs{Board: bus.NewBoard()}.For(bus.Canary)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return fake, repairs, resync, done
}

// Changes that come close together make one repair request, sent within the
// debounce; a canary flushed is put back and commit rewrites everything (no
// resync through coalesce); lost changes ask for the jumps to be checked, and for
// everything when a canary is gone; a subscription that fails fails the stage (to be restarted).
func TestChangesBecomeOneRepair(t *testing.T) {
	sub := newFakeChanges()
	fake, repairs, resync, done := tamperStage(t, sub, time.Hour)
	fake.set(false, nil)
	start := time.Now()
	sub.c <- []nf.Change{{Kind: nf.RuleDeleted, Table: "nat", Chain: "PREROUTING"}, {Kind: nf.RuleDeleted, Table: "nat", Chain: nf.ChainCanary}}
	sub.c <- []nf.Change{{Kind: nf.ChainDeleted, Table: "nat", Chain: svc}}
	r := bustest.Take(t, repairs, "repair asked for")
	if took := time.Since(start); took > patience+200*time.Millisecond {
		t.Errorf("the repair was asked for %v after the change", took)
	}
	if !r.Chains["nat"][svc] || !r.Jumps["nat"] || !r.Lost || r.Since.Before(start) {
		t.Errorf("repair %+v; want %s, the nat jumps and (the canary flushed) everything", r, svc)
	}
	time.Sleep(2 * patience)
	if _, again := repairs.TryTake(); again {
		t.Error("one tamper made two repair requests")
	}
	fake.mu.Lock()
	alive := fake.alive
	fake.mu.Unlock()
	if !alive || resync.Lower() {
		t.Errorf("canary put back %v, full resync asked for %v; want true, false", alive, !alive)
	}

	sub.errs <- nf.ErrLost
	if r := bustest.Take(t, repairs, "repair asked for"); r.Lost || !r.Jumps["nat"] || !r.Jumps["filter"] {
		t.Errorf("lost changes with the canaries in place asked for %+v; want the jumps checked, not everything", r)
	}
	fake.set(false, nil)
	sub.errs <- nf.ErrLost
	if r := bustest.Take(t, repairs, "repair asked for"); !r.Lost {
		t.Errorf("lost changes with a canary gone asked for %+v; want everything", r)
	}
	broken := errors.New("netlink: broken")
	sub.errs <- broken
	select {
	case err := <-done:
		if !errors.Is(err, broken) {
			t.Errorf("Run = %v; want the subscription's error", err)
		}
		done <- err // for the cleanup
	case <-time.After(5 * time.Second):
		t.Fatal("Run went on after its subscription failed")
	}
}

// On the legacy backend the canaries are polled, and a flush asks for a full resync.
func TestLegacyPolls(t *testing.T) {
	fake, repairs, resync, _ := tamperStage(t, nil, 5*time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	fake.set(false, nil)
	deadline := time.Now().Add(5 * time.Second)
	for !resync.Lower() {
		if time.Now().After(deadline) {
			t.Fatal("a flushed canary asked for no resync on the legacy backend")
		}
		time.Sleep(time.Millisecond)
	}
	if _, ok := repairs.TryTake(); ok {
		t.Error("the legacy backend asked commit for a repair")
	}
}

// A write sends one notification a rule (kpipe's own full sync: hundreds of
// thousands); each change is collected once.
func TestTamperCollectsEachChangeOnce(t *testing.T) {
	var tm tamper
	rule := nf.Change{Kind: nf.RuleAdded, Table: nf.TableNAT, Chain: svc}
	for range 1000 {
		tm.add([]nf.Change{rule, rule})
	}
	tm.add([]nf.Change{{Kind: nf.RuleDeleted, Table: nf.TableNAT, Chain: svc}})
	if len(tm.changes) != 2 {
		t.Errorf("collected %d changes; want 2 (one per kind, table and chain)", len(tm.changes))
	}
}
