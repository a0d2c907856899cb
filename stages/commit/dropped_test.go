package commit

import (
	"context"
	"maps"
	"slices"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// TestDroppedHintDeletesOnlyWhatThePlanDropped: plans from one renderer name
// the chains they dropped, and commit deletes those without going through its
// whole ledger. A hint it cannot trust (one that leaves a chain out, or names
// a chain the plan has) changes nothing: the kernel ends up as a fresh kpipe
// writes the state every time.
func TestDroppedHintDeletesOnlyWhatThePlanDropped(t *testing.T) {
	full := rendertest.SyntheticState(6, 2)
	fewer := full
	fewer.Services = maps.Clone(full.Services)
	delete(fewer.Services, bus.ServiceKey{Namespace: "ns1", Name: "svc1"})
	delete(fewer.Services, bus.ServiceKey{Namespace: "ns4", Name: "svc4"})

	for _, c := range []struct {
		name string
		hint func(p *bus.Plan) // changes the renderer's hint
	}{
		{"as rendered", func(*bus.Plan) {}},
		{"one chain left out", func(p *bus.Plan) { p.Table(nf.TableNAT).Dropped = p.Table(nf.TableNAT).Dropped[1:] }},
		{"none", func(p *bus.Plan) { p.Table(nf.TableNAT).Dropped, p.Table(nf.TableFilter).Dropped = nil, nil }},
		{"a chain the plan has instead of one it dropped", func(p *bus.Plan) {
			i := slices.IndexFunc(p.Table(nf.TableNAT).Chains, func(c bus.Chain) bool { return nf.KindOf(c.Name) == nf.KindService })
			p.Table(nf.TableNAT).Dropped = append(p.Table(nf.TableNAT).Dropped[1:], p.Table(nf.TableNAT).Chains[i].Name)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := fakekernel.New()
			s := testStage(k)
			rr := render.NewRenderer(fakeConfig)
			if err := s.apply(context.Background(), rr.Render(&bus.Snapshot{Generation: 1, State: full, Full: true})); err != nil {
				t.Fatal(err)
			}
			p := rr.Render(&bus.Snapshot{Generation: 2, State: fewer})
			if len(p.Table(nf.TableNAT).Dropped) < 2 {
				t.Fatalf("the renderer's hint names %v: the test needs two services' chains", p.Table(nf.TableNAT).Dropped)
			}
			c.hint(p)
			if err := s.apply(context.Background(), p); err != nil {
				t.Fatal(err)
			}
			requireFresh(t, k, fewer, "after two services went")
			// And back: every chain comes back, none is deleted twice.
			back := rr.Render(&bus.Snapshot{Generation: 3, State: full})
			if err := s.apply(context.Background(), back); err != nil {
				t.Fatal(err)
			}
			requireFresh(t, k, full, "after they came back")
		})
	}
}
