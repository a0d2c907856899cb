package commit

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// TestRefreshWritesACountPreservingChange: a periodic sync whose plan also carries
// a real change that keeps every chain's number of rules (one remote endpoint's
// address replaced by another: its service chains' DNAT rules change text, not
// number) writes that change, and still repairs a checked chain changed by hand;
// a further periodic sync then writes nothing.
func TestRefreshWritesACountPreservingChange(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	svc := bus.ServiceKey{Namespace: "ns0", Name: "svc0"}
	before := rendertest.SyntheticState(20, 2)
	if err := s.apply(context.Background(), planOf(before, 1, true)); err != nil {
		t.Fatal(err)
	}

	after := rendertest.SyntheticState(20, 2)
	ep := &after.Slices[svc]["svc0-1"].Items[0]
	oldAddr, newAddr := ep.Addr, netip.MustParseAddr("10.250.0.7")
	ep.Addr = newAddr
	periodic := render.Render(fakeConfig, &bus.Snapshot{Generation: 2, State: after, Refresh: true})
	changed := countPreservingChanges(t, planOf(before, 1, false), periodic)

	// A checked chain changed by hand: the periodic check must still find it.
	k.Mu.Lock()
	k.Tables[nf.TableNAT][nf.ChainNodePorts] = append(k.Tables[nf.TableNAT][nf.ChainNodePorts], "-A "+nf.ChainNodePorts+" -j "+nf.ChainMarkMasq)
	k.Payloads = nil
	k.Mu.Unlock()

	if err := s.apply(context.Background(), periodic); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, after, "after a periodic sync carrying the endpoint's new address")
	for _, name := range changed {
		rules := strings.Join(k.Tables[nf.TableNAT][name], "\n")
		if !strings.Contains(rules, newAddr.String()+":") || strings.Contains(rules, oldAddr.String()+":") {
			t.Errorf("%s in the kernel after the periodic sync:\n%s\nwant the DNAT to %s, none to %s", name, rules, newAddr, oldAddr)
		}
	}
	if got, want := regexpDeclared(strings.Join(k.Payloads, "")), sorted(append(changed, nf.ChainNodePorts)); !slices.Equal(got, want) {
		t.Errorf("periodic sync rewrote %v; want the changed service chains and the tampered chain, %v", got, want)
	}

	// Converged: the next periodic syncs write nothing and leave the kernel as it is.
	k.Payloads = nil
	for gen := uint64(3); gen <= 5; gen++ {
		if err := s.apply(context.Background(), render.Render(fakeConfig, &bus.Snapshot{Generation: gen, State: after, Refresh: true})); err != nil {
			t.Fatal(err)
		}
		if len(k.Payloads) != 0 {
			t.Fatalf("periodic sync %d with nothing changed wrote:\n%s", gen, k.Payloads)
		}
		requireFresh(t, k, after, "after a periodic sync with nothing changed")
	}
}

// countPreservingChanges names the nat chains whose rules differ between two plans,
// and fails the test unless there are some and each keeps its number of rules (the
// premise: a change no rule count can see).
func countPreservingChanges(t *testing.T, from, to *bus.Plan) []string {
	t.Helper()
	was := map[string]bus.Chain{}
	for _, c := range natChains(from) {
		was[c.Name] = c
	}
	var changed []string
	for _, c := range natChains(to) {
		old, ok := was[c.Name]
		if !ok {
			t.Fatalf("chain %s is new: the change is not count-preserving", c.Name)
		}
		if old.Rules == c.Rules {
			continue
		}
		if n, m := strings.Count(old.Rules, "\n"), strings.Count(c.Rules, "\n"); n != m {
			t.Fatalf("chain %s goes from %d to %d rules: the change is not count-preserving", c.Name, n, m)
		}
		changed = append(changed, c.Name)
	}
	if len(changed) == 0 {
		t.Fatal("the two plans have the same rules")
	}
	return changed
}

func natChains(p *bus.Plan) []bus.Chain {
	for _, tp := range p.Tables {
		if tp.Table == nf.TableNAT {
			return tp.Chains
		}
	}
	return nil
}
