package render

import (
	"context"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Params wire the render stage of one family.
type Params struct {
	Config Config
	In     *bus.Mailbox[*bus.Snapshot]
	Out    *bus.Mailbox[*bus.Plan]
	Resend *bus.ResendFlag // raised on every start: the snapshot in flight may be lost
	Env    bus.Env
}

// Stage renders every snapshot it is handed into a plan for commit.
type Stage struct{ p Params }

// NewStage makes the render stage of one family.
func NewStage(p Params) *Stage { return &Stage{p: p} }

// Run renders until ctx ends.
func (s *Stage) Run(ctx context.Context) error {
	// A snapshot taken by a previous run that crashed is lost: ask for it again.
	s.p.Resend.Raise()
	renderer := NewRenderer(s.p.Config)
	for {
		snap, err := s.p.In.Take(ctx)
		if err != nil {
			return nil
		}
		start := time.Now()
		plan := renderer.Render(snap)
		plan.Started = start
		s.p.Env.Log.Debug("rendered", "generation", plan.Generation, "full", plan.Full, "took", time.Since(start),
			"nat_chains", len(plan.Table(nf.TableNAT).Chains), "filter_chains", len(plan.Table(nf.TableFilter).Chains))
		s.p.Out.Put(plan)
	}
}
