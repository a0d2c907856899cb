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
			st := render.SyntheticState(400, 2)
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
