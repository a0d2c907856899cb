package commit

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// chainOf is the nat chain of kind whose rules carry comment.
func chainOf(t *testing.T, k *fakekernel.Kernel, kind nf.Kind, comment string) string {
	t.Helper()
	for c, rules := range k.Tables[nf.TableNAT] {
		if nf.KindOf(c) == kind && slices.ContainsFunc(rules, func(r string) bool { return strings.Contains(r, comment) }) {
			return c
		}
	}
	t.Fatalf("no %v chain with %q", kind, comment)
	return ""
}

// withoutChains is a kernel dump without the lines of the named nat chains.
func withoutChains(dump string, chains ...string) string {
	var out []string
	for _, l := range strings.Split(dump, "\n") {
		if !slices.ContainsFunc(chains, func(c string) bool {
			return l == "nat :"+c || strings.HasPrefix(l, "nat -A "+c+" ")
		}) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// syncedStage is a stage that has synced the synthetic state of 20 services
// into a fake kernel.
func syncedStage(t *testing.T) (*fakekernel.Kernel, *Stage, bus.State) {
	t.Helper()
	k := fakekernel.New()
	s := testStage(k)
	st := rendertest.SyntheticState(20, 2)
	if err := s.apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	return k, s, st
}

// restoresSince are the payloads written since the first n.
func restoresSince(k *fakekernel.Kernel, n int) []string {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	return slices.Clone(k.Payloads[n:])
}

// TestUndeletableChainHoldsUpNothing: another agent's rule jumps to the
// service chain of svc19, and svc19 goes (in a partial commit, or found stale
// by a full sync). The kernel refuses to delete that chain. The commit
// succeeds all the same: everything else is as a fresh kpipe writes it, the
// chain is emptied and left (so the endpoint chains it jumped to go too) and
// counted in kpipe_undeletable_chains. Later plans do not try it again; each
// periodic sync does, and the one after the agent's rule went deletes it.
func TestUndeletableChainHoldsUpNothing(t *testing.T) {
	for _, full := range []bool{false, true} {
		t.Run(map[bool]string{false: "dropped by a partial commit", true: "stale in a full sync"}[full], func(t *testing.T) {
			k, s, st := syncedStage(t)
			ctx := context.Background()
			stuck := chainOf(t, k, nf.KindService, "ns19/svc19:http")
			k.Mu.Lock()
			k.Tables[nf.TableNAT]["AGENT"] = []string{"-A AGENT -j " + stuck}
			k.Mu.Unlock()
			undeletable := func() float64 { return value(t, s.metrics.UndeletableChains.WithLabelValues("IPv4")) }

			st2 := with(st, nil, []string{"svc19"}, "svc3")
			if err := s.apply(ctx, planOf(st2, 2, full)); err != nil {
				t.Fatalf("the commit that drops svc19 failed: %v", err)
			}
			agentOnly := func(want bus.State, when string) {
				t.Helper()
				if got, fresh := withoutChains(k.Dump(), "AGENT", stuck), freshKernel(t, want); got != fresh {
					t.Fatalf("%s: besides the agent's chain and %s, the kernel is not what a fresh kpipe writes:\n%s", when, stuck, lineDiff(fresh, got))
				}
			}
			agentOnly(st2, "after svc19 went")
			k.Mu.Lock()
			rules, there := k.Tables[nf.TableNAT][stuck]
			k.Mu.Unlock()
			if !there || len(rules) > 0 {
				t.Errorf("%s: in the kernel %v, rules %q; want it there, emptied", stuck, there, rules)
			}
			if n := undeletable(); n != 1 {
				t.Errorf("kpipe_undeletable_chains = %v; want 1", n)
			}

			// Partial commits leave it alone: nothing refused, nothing retried.
			n := len(k.Payloads)
			st3 := with(st2, nil, nil, "svc4")
			if err := s.apply(ctx, planOf(st3, 3, false)); err != nil {
				t.Fatal(err)
			}
			for _, p := range restoresSince(k, n) {
				if strings.Contains(p, stuck) {
					t.Errorf("a partial commit after it tried %s again:\n%s", stuck, p)
				}
			}
			// A periodic sync tries again, and keeps it while the agent's rule stays.
			refresh := func(gen uint64) {
				t.Helper()
				p := planOf(st3, gen, false)
				p.Refresh = true
				if err := s.apply(ctx, p); err != nil {
					t.Fatalf("periodic sync %d: %v", gen, err)
				}
			}
			n = len(k.Payloads)
			refresh(4)
			if !slices.ContainsFunc(restoresSince(k, n), func(p string) bool { return strings.Contains(p, "-X "+stuck) }) {
				t.Errorf("the periodic sync did not try to delete %s", stuck)
			}
			if n := undeletable(); n != 1 {
				t.Errorf("kpipe_undeletable_chains = %v after a periodic sync; want 1", n)
			}
			k.Mu.Lock()
			delete(k.Tables[nf.TableNAT], "AGENT")
			k.Mu.Unlock()
			refresh(5)
			requireFresh(t, k, st3, "after the agent's rule went and a periodic sync")
			if n := undeletable(); n != 0 {
				t.Errorf("kpipe_undeletable_chains = %v after it went; want 0", n)
			}
		})
	}
}

// TestJumpsBeforeStaleChains: a full sync puts back missing jumps before it
// deletes stale chains, and a write the kernel refuses still has them put back.
func TestJumpsBeforeStaleChains(t *testing.T) {
	k, s, st := syncedStage(t)
	ctx := context.Background()
	k.Mu.Lock()
	k.Events, k.Payloads = nil, nil
	k.Mu.Unlock()
	if err := s.apply(ctx, planOf(with(st, nil, []string{"svc7"}, ""), 2, true)); err != nil {
		t.Fatal(err)
	}
	restores := 0
	for _, e := range k.Events {
		if e == "jumps" {
			break
		}
		restores++
	}
	if restores == len(k.Events) {
		t.Fatalf("no jumps ensured by a full sync: %q", k.Events)
	}
	for i, p := range k.Payloads[:restores] {
		if strings.Contains(p, "\n-X ") {
			t.Errorf("restore %d deletes stale chains before the jumps were ensured:\n%s", i+1, p)
		}
	}

	k.Mu.Lock()
	k.Events = nil
	k.BeforeCommit = func(table string) error {
		if table == nf.TableNAT {
			return errors.New("injected: nat refused")
		}
		return nil
	}
	k.Mu.Unlock()
	if err := s.apply(ctx, planOf(with(st, nil, nil, "svc2"), 3, false)); err == nil {
		t.Fatal("the injected refusal did not fail the commit")
	}
	if !slices.Contains(k.Events, "jumps") {
		t.Errorf("a failed write did not put missing jumps back: events %q", k.Events)
	}
}
