package commit

import (
	"context"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// BenchmarkWorkOutChanges is what commit spends, besides the kernel, to find
// what one changed service means at 10,000 services: comparing every chain of
// the plan with its ledger, ordering and assembling the write (the kernel does
// nothing here).
func BenchmarkWorkOutChanges(b *testing.B) {
	st := rendertest.SyntheticState(10000, 10)
	// From one renderer, as the render stage makes them: each plan names the
	// chains the one before had and it does not (an endpoint's chain).
	rr := render.NewRenderer(fakeConfig)
	first := rr.Render(&bus.Snapshot{State: st})
	changed := rr.Render(&bus.Snapshot{State: withOneChange(st)})
	back := rr.Render(&bus.Snapshot{State: st})
	s := testStage(nullKernel{})
	if err := s.apply(context.Background(), first); err != nil {
		b.Fatal(err)
	}
	i := 0
	for b.Loop() {
		if err := s.apply(context.Background(), []*bus.Plan{changed, back}[i%2]); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// nullKernel takes every write and holds nothing.
type nullKernel struct{}

func (nullKernel) Prepare([]byte) func(context.Context) error {
	return func(context.Context) error { return nil }
}
func (nullKernel) Digests(context.Context, string, []string) (map[string]uint64, error) {
	return map[string]uint64{}, nil
}
func (nullKernel) ExpectedDigest(context.Context, string, string) (uint64, bool) { return 0, false }
func (nullKernel) ChainNames(context.Context, string) ([]string, error)          { return nil, nil }
func (nullKernel) ListChain(context.Context, string, string) ([]string, error) {
	return nil, nf.ErrNoChain
}
func (nullKernel) EnsureJumps(context.Context, []nf.Jump) error { return nil }
func (nullKernel) WriteSysctl(string, string) error             { return nil }
