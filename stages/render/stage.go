package render

import (
	"context"
	"log/slog"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// Stage renders every snapshot it is handed into a plan for commit.
type Stage struct {
	cfg    Config
	in     *bus.Mailbox[*bus.Snapshot]
	out    *bus.Mailbox[*bus.Plan]
	resend *bus.Flag
	log    *slog.Logger
}

// NewStage makes the render stage of one family.
func NewStage(cfg Config, in *bus.Mailbox[*bus.Snapshot], out *bus.Mailbox[*bus.Plan], resend *bus.Flag, log *slog.Logger) *Stage {
	return &Stage{cfg: cfg, in: in, out: out, resend: resend, log: log}
}

// Run renders until ctx ends.
func (s *Stage) Run(ctx context.Context) error {
	// A snapshot taken by a previous run that crashed is lost: ask for it again.
	s.resend.Raise()
	renderer := NewRenderer(s.cfg)
	for {
		snap, err := s.in.Take(ctx)
		if err != nil {
			return nil
		}
		start := time.Now()
		plan := renderer.Render(snap)
		plan.Started = start
		s.log.Debug("rendered", "generation", plan.Generation, "full", plan.Full, "took", time.Since(start),
			"nat_chains", len(plan.Tables[0].Chains), "filter_chains", len(plan.Tables[1].Chains))
		s.out.Put(plan)
	}
}
