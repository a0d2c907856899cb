package commit

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render"
)

// busyOn makes k's Digests unable to read chain of table while another writer
// keeps changing the ruleset (netfilter.ErrBusy, the other chains answered).
func busyOn(k *fakekernel.Kernel, table, chain string) {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	k.Busy = func(tb, c string) bool { return tb == table && c == chain }
}

// TestRefreshWhileTheRulesetKeepsChanging: a periodic sync whose read of a
// checked chain never gets a still ruleset (another agent keeps writing)
// succeeds, and rewrites that chain only: it could not confirm it.
func TestRefreshWhileTheRulesetKeepsChanging(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	st := render.SyntheticState(20, 2)
	if err := s.apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	busyOn(k, nf.TableNAT, nf.ChainServices)
	k.Payloads = nil
	if err := s.apply(context.Background(), render.Render(fakeConfig, &bus.Snapshot{Generation: 2, State: st, Refresh: true})); err != nil {
		t.Fatalf("the periodic sync failed: %v", err)
	}
	requireFresh(t, k, st, "after the periodic sync")
	if got, want := regexpDeclared(strings.Join(k.Payloads, "")), []string{nf.ChainServices}; !slices.Equal(got, want) {
		t.Errorf("the periodic sync rewrote %v; want only the unread %v", got, want)
	}
}

// TestFullSyncWhileTheRulesetKeepsChanging: a restarted commit (a new ledger)
// whose read of one chain never gets a still ruleset writes that chain, and
// none of those it could compare with the kernel.
func TestFullSyncWhileTheRulesetKeepsChanging(t *testing.T) {
	k := fakekernel.New()
	st := render.SyntheticState(20, 2)
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	svc := serviceChain(k)
	busyOn(k, nf.TableNAT, svc)
	k.Payloads = nil
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, st, "after the restart")
	if got := regexpDeclared(strings.Join(k.Payloads, "")); !slices.Equal(got, []string{svc}) {
		t.Errorf("the restarted commit wrote %d chains; want only the unread %s", len(got), svc)
	}
}
