package main

import (
	"context"

	"github.com/kpipe/kpipe/supervise"
)

// runner is a stage's Run method.
type runner func(ctx context.Context) error

// familyRunners are the stages of one IP family.
type familyRunners struct {
	name                      string // "ipv4", "ipv6"
	render, commit, conntrack runner
}

// treeRunners are the stages the supervisor tree runs.
type treeRunners struct {
	watch, coalesce runner
	families        []familyRunners
	canary, health  runner
}

// buildTree puts the stages under their supervisors; opts gives a supervisor's
// options for its strategy.
//
//	kpipe (one_for_one)
//	├── pipeline (rest_for_one): watch, coalesce, families (one_for_one)
//	│                                              └── ipv4, ipv6 (rest_for_one): render, commit
//	├── side (one_for_one, never gives up): conntrack-ipv4, conntrack-ipv6, canary
//	└── health
//
// The side stages only help the rules (stale UDP flows, flushed tables): their
// failures restart them alone, show on /healthz and in kpipe_stage_restarts_total,
// and never restart the rule path or stop the process.
func buildTree(r treeRunners, opts func(supervise.Strategy) supervise.Options) *supervise.Supervisor {
	var familyTrees, side []supervise.Child
	for _, f := range r.families {
		familyTrees = append(familyTrees, supervise.Tree(f.name, opts(supervise.RestForOne),
			supervise.Leaf("render-"+f.name, f.render), supervise.Leaf("commit-"+f.name, f.commit)))
		side = append(side, supervise.Leaf("conntrack-"+f.name, f.conntrack))
	}
	side = append(side, supervise.Leaf("canary", r.canary))
	sideOpts := opts(supervise.OneForOne)
	sideOpts.NeverEscalate = true
	return supervise.Tree("kpipe", opts(supervise.OneForOne),
		supervise.Tree("pipeline", opts(supervise.RestForOne),
			supervise.Leaf("watch", r.watch), supervise.Leaf("coalesce", r.coalesce),
			supervise.Tree("families", opts(supervise.OneForOne), familyTrees...)),
		supervise.Tree("side", sideOpts, side...),
		supervise.Leaf("health", r.health))
}

// sideStages names the stages of the side supervisor.
func (r treeRunners) sideStages() []string {
	out := []string{"canary"}
	for _, f := range r.families {
		out = append(out, "conntrack-"+f.name)
	}
	return out
}
