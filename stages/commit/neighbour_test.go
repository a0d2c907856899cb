package commit

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
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
	st := rendertest.SyntheticState(20, 2)
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
	st := rendertest.SyntheticState(20, 2)
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

// TestForeignChangeDuringAWriteIsRepaired: another agent changes a checked
// chain during a long full sync, after the step that wrote it; the next
// periodic sync rewrites it. KUBE-MARK-MASQ is written in the first nat step,
// and changed before the last; on nf_tables KUBE-SERVICES is also changed
// the moment the last step commits (on legacy, where no digest is known
// without reading, that moment stays: the chains a step wrote are read back
// right after it).
func TestForeignChangeDuringAWriteIsRepaired(t *testing.T) {
	foreign := func(k *fakekernel.Kernel, chain string) {
		k.Tables[nf.TableNAT][chain] = append(k.Tables[nf.TableNAT][chain], "-A "+chain+" -j ACCEPT")
	}
	lastStep := func(payload string) bool {
		return strings.Contains(payload, "*nat\n") && strings.Contains(payload, ":"+nf.ChainServices+" ")
	}
	cases := []struct {
		name, chain string
		legacy      bool
		change      func(k *fakekernel.Kernel)
	}{
		{"between steps", nf.ChainMarkMasq, false, func(k *fakekernel.Kernel) {
			k.BeforeRestore = func(_ int, payload string) error {
				if lastStep(payload) {
					k.Mu.Lock()
					defer k.Mu.Unlock()
					foreign(k, nf.ChainMarkMasq)
				}
				return nil
			}
		}},
		{"between steps, legacy", nf.ChainMarkMasq, true, nil},
		{"as the last step commits", nf.ChainServices, false, func(k *fakekernel.Kernel) {
			k.Observe = func(table string, chains map[string][]string) {
				if table == nf.TableNAT && len(chains[nf.ChainServices]) > 0 && !slices.ContainsFunc(chains[nf.ChainServices], func(r string) bool { return strings.HasSuffix(r, " -j ACCEPT") }) {
					foreign(k, nf.ChainServices) // k.Mu is held
				}
			}
		}},
	}
	cases[1].change = cases[0].change
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k := fakekernel.New()
			var kernel Kernel = k
			if c.legacy {
				kernel = &legacyKernel{Kernel: k}
			}
			st := rendertest.SyntheticState(400, 2)
			s := testStage(kernel)
			c.change(k)
			if err := s.apply(context.Background(), planOf(st, 1, true)); err != nil {
				t.Fatal(err)
			}
			if n := len(k.Payloads); n < 3 {
				t.Fatalf("the full sync took %d steps; the test needs several", n)
			}
			k.Mu.Lock()
			k.BeforeRestore, k.Observe = nil, nil
			changed := slices.Contains(k.Tables[nf.TableNAT][c.chain], "-A "+c.chain+" -j ACCEPT")
			k.Payloads = nil
			k.Mu.Unlock()
			if !changed {
				t.Fatalf("the other agent's rule is not in %s: the test did not test", c.chain)
			}
			if err := s.apply(context.Background(), render.Render(fakeConfig, &bus.Snapshot{Generation: 2, State: st, Refresh: true})); err != nil {
				t.Fatal(err)
			}
			if got := regexpDeclared(strings.Join(k.Payloads, "")); !slices.Equal(got, []string{c.chain}) {
				t.Errorf("the periodic sync rewrote %v; want %s, changed by another agent during the full sync", got, c.chain)
			}
			requireFresh(t, k, st, "after the periodic sync")
		})
	}
}

// probingTool is the real kernel as the legacy backend answers (no digest
// known without reading: a full sync writes every chain, in steps), which
// calls probe after each step the kernel took.
type probingTool struct {
	nf.Tool
	probe func() error
	err   error
}

func (p *probingTool) ExpectedDigest(context.Context, string, string) (uint64, bool) { return 0, false }

func (p *probingTool) Prepare(payload []byte) func(context.Context) error {
	write := p.Tool.Prepare(payload)
	return func(ctx context.Context) error {
		err := write(ctx)
		if err == nil && p.err == nil {
			p.err = p.probe()
		}
		return err
	}
}

// TestRestartedFullSyncNeverLeavesAGap: in the real kernel, a new kpipe (a
// new ledger) writes a full sync in steps over the rules of an earlier one, in
// which a service lost its endpoints and a load balancer got source ranges.
// After every step, the service has its DNAT or its REJECT, and the new
// KUBE-FW- chain is not reachable without its DROP.
func TestRestartedFullSyncNeverLeavesAGap(t *testing.T) {
	requireNFTables(t)
	before := largeState(maxChainsPerRestore/2 + 200)
	after, gaps := gapScenario(before)
	netnstest.New(t).Run(t, func() error {
		ctx := context.Background()
		tool := nf.Tool{Family: bus.IPv4}
		if err := testStage(tool).apply(ctx, render.Render(largeConfig, &bus.Snapshot{State: before, Full: true})); err != nil {
			return err
		}
		steps := 0
		probing := &probingTool{Tool: tool, probe: func() error {
			steps++
			g, err := gapsIn(ctx, tool, gaps)
			if err != nil {
				return err
			}
			if len(g) > 0 {
				return fmt.Errorf("after step %d: %s", steps, strings.Join(g, "; "))
			}
			return nil
		}}
		if err := testStage(probing).apply(ctx, render.Render(largeConfig, &bus.Snapshot{Generation: 2, State: after, Full: true})); err != nil {
			return err
		}
		if probing.err != nil {
			return probing.err
		}
		if steps < 3 {
			return fmt.Errorf("the full sync took %d steps; the test needs several", steps)
		}
		return nil
	})
}
