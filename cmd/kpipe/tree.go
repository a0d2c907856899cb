package main

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"
	k8sevents "k8s.io/client-go/tools/events"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/stages/canary"
	"github.com/kpipe/kpipe/stages/coalesce"
	"github.com/kpipe/kpipe/stages/commit"
	"github.com/kpipe/kpipe/stages/conntrack"
	"github.com/kpipe/kpipe/stages/events"
	"github.com/kpipe/kpipe/stages/health"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/watch"
	"github.com/kpipe/kpipe/supervise"
)

// deps are what the tree needs from outside the process: the apiserver, the
// kernel of each IP family kpipe programs, what start-up learned about the host,
// and where logs and metrics go. serve makes the real ones (realDeps); tests fake them.
type deps struct {
	client kubernetes.Interface
	// broadcaster sends what recorder records (events on the Node) through
	// client, once the events stage starts it.
	broadcaster k8sevents.EventBroadcaster
	recorder    k8sevents.EventRecorder
	written     *events.Written // what broadcaster has written
	// fatal receives an error that stops kpipe at once (a port bindAddressHardFail
	// requires); runReloading makes one per tree, nil: the stage returns it.
	fatal    chan error
	kernels  map[bus.Family]commit.Kernel   // one per family kpipe programs
	canaries map[bus.Family]canary.Canaries // nil: iptables
	// conntrack opens the conntrack connection; nil: netlink.
	conntrack func() (conntrack.Clearer, error)
	host      hostFacts
	// setupFailures are the node set-up steps that failed (recorded as events).
	setupFailures []events.SetupFailure
	log           *slog.Logger
	registry      *prometheus.Registry
	// metrics are registered once in registry: every tree reports to them.
	metrics *metrics.Metrics
	board   *bus.Board // the stages' reports (required: runReloading makes one per tree)
	// pending is the work one tree's stages leave another; nil: new mailboxes.
	pending *pendingWork
	// reloads keeps the config file's last reload for /status across the
	// trees it replaces; nil: none told.
	reloads *health.Reloads
	// afterSync is done once every family has made its first full sync
	// (removeNFTablesMode); nil: nothing.
	afterSync func(context.Context, *slog.Logger)
}

// connect makes d use client, with an event recorder of its own.
func (d *deps) connect(client kubernetes.Interface) {
	d.client = client
	d.broadcaster, d.recorder, d.written = events.NewRecorder(client)
}

// stopFatal is sent an error that must stop kpipe at once; nil without d.fatal.
func (d deps) stopFatal() func(error) {
	if d.fatal == nil {
		return nil
	}
	return func(err error) {
		select {
		case d.fatal <- err:
		default: // one is enough to stop
		}
	}
}

// reloadReporter reports the config file's changes while a tree built from o runs.
func (d deps) reloadReporter(o *Options) reloadReporter {
	return reloadReporter{path: o.ConfigFile, node: o.HostnameOverride, log: d.log, metrics: d.metrics, recorder: d.recorder,
		reloads: d.reloads}
}

// families are the families kpipe programs, IPv4 first.
func (d deps) families() []bus.Family {
	var out []bus.Family
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		if d.kernels[f] != nil {
			out = append(out, f)
		}
	}
	return out
}

// pendingWork holds the merging mailboxes of work a stage leaves another to do,
// per family: stale UDP flows (commit → conntrack) and repairs (canary →
// commit). runReloading makes them once, so what one tree left pending (its
// conntrack stage down, or stopped before its commit) is done by the next, as a
// restarted stage finds it in its mailbox. A family's values go only to that
// family's stages.
type pendingWork struct {
	flows   map[bus.Family]*bus.Mailbox[bus.StaleFlows]
	repairs map[bus.Family]*bus.Mailbox[bus.Repair]
}

func newPendingWork() *pendingWork {
	return &pendingWork{flows: map[bus.Family]*bus.Mailbox[bus.StaleFlows]{}, repairs: map[bus.Family]*bus.Mailbox[bus.Repair]{}}
}

// of gives family f's mailboxes, made on first use.
func (p *pendingWork) of(f bus.Family) (*bus.Mailbox[bus.StaleFlows], *bus.Mailbox[bus.Repair]) {
	if p.flows[f] == nil {
		p.flows[f], p.repairs[f] = bus.NewMergingMailbox(bus.MergeStaleFlows), bus.NewMergingMailbox(bus.MergeRepairs)
	}
	return p.flows[f], p.repairs[f]
}

// buildTree makes the mailboxes (all but d.pending's) and the stages and puts
// them under their supervisors (see arrange). Control edges are typed: resend
// (render, commit → coalesce), resync (canary → coalesce), replay (coalesce →
// watch), and repairs (canary → commit).
func buildTree(o *Options, d deps) *supervise.Supervisor {
	board, pending := bus.MustBoard(d.board, "buildTree"), d.pending
	if pending == nil {
		pending = newPendingWork()
	}
	envs := bus.Envs{Log: d.log, Metrics: d.metrics, Board: board}
	changes, replay := bus.NewChangeQueue(), bus.NewReplayFlag()
	checks := bus.NewMergingMailbox(bus.MergeHealthCheckUpdates)
	resync := map[bus.Family]*bus.ResyncFlag{}
	repairs := map[bus.Family]*bus.Mailbox[bus.Repair]{}
	var r treeRunners
	var coalesceIO []coalesce.Pipeline
	for _, f := range d.families() {
		snapshots, plans := bus.NewMailbox[*bus.Snapshot](), bus.NewMailbox[*bus.Plan]()
		results, resend := bus.NewMailbox[bus.Result](), bus.NewResendFlag()
		flows, familyRepairs := pending.of(f)
		resync[f], repairs[f] = bus.NewResyncFlag(), familyRepairs
		coalesceIO = append(coalesceIO, coalesce.Pipeline{Family: f, Out: snapshots, Results: results, Resync: resync[f], Resend: resend})
		opts := o.forFamily(f, d.host)
		rs := render.NewStage(render.Params{Config: opts.render, In: snapshots, Out: plans, Resend: resend,
			Env: envs.For(bus.Render.Of(f))})
		cs := commit.NewStage(commit.Params{Family: f, LocalhostNodePorts: opts.localhostNodePorts, In: plans, Results: results,
			Resend: resend, Flows: flows, HealthChecks: checks, Repairs: repairs[f], Ledger: commit.NewLedger(), Kernel: d.kernels[f],
			Env: envs.For(bus.Commit.Of(f))})
		ct := conntrack.NewStage(conntrack.Params{Family: f, In: flows, Dial: d.conntrack, Env: envs.For(bus.Conntrack.Of(f))})
		r.families = append(r.families, familyRunners{family: f, render: rs.Run, commit: cs.Run, conntrack: ct.Run})
	}
	r.watch = watch.NewStage(watch.Params{Client: d.client, NodeName: o.HostnameOverride, Out: changes, Replay: replay,
		WatchAddrs: len(o.nodePortCIDRs) > 0, Env: envs.For(bus.Watch)}).Run
	r.coalesce = coalesce.NewStage(coalesce.Params{Config: coalesce.Config{MinSyncPeriod: o.MinSyncPeriod, SyncPeriod: o.SyncPeriod, Burst: 2},
		In: changes, Replay: replay, Families: coalesceIO, Env: envs.For(bus.Coalesce)}).Run
	r.events = events.NewStage(events.Params{Broadcaster: d.broadcaster, Recorder: d.recorder, Node: o.HostnameOverride,
		SetupFailures: d.setupFailures, Families: d.families(), Board: board, Env: envs.For(events.Name)}).Run
	r.canary = canary.NewStage(canary.Params{Interval: o.CanaryInterval, Resync: resync, Repairs: repairs, Tools: d.canaries,
		Env: envs.For(bus.Canary)}).Run

	var root *supervise.Supervisor
	var stagesHandler http.Handler
	if o.EnableDebugHandlers {
		stagesHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { supervise.Handler(root).ServeHTTP(w, r) })
	}
	r.health = health.NewStage(health.Params{Config: health.Config{
		HealthzAddr: o.HealthzBindAddress, MetricsAddr: o.MetricsBindAddress, BindHardFail: o.BindAddressHardFail,
		Profiling: o.EnableProfiling, DebugAddr: o.debugAddr(),
		SyncPeriod: o.SyncPeriod, NodeName: o.HostnameOverride, Families: d.families(), Configz: o.configz(), SideStages: r.sideStages(),
	}, Board: board, Gatherer: metrics.Served(d.registry), SetVerbosity: setVerbosity, Checks: checks, Stages: stagesHandler,
		StageStatus: func() []supervise.Status { return root.Status() }, Reloads: d.reloads,
		Env: envs.For(bus.Health), Recorder: d.recorder, Fatal: d.stopFatal()}).Run

	onRestart := func(stage string, err error) {
		envs.Metrics.StageRestarts.WithLabelValues(stage).Inc()
		board.Reporter(bus.StageName(stage)).Failed(err, time.Now())
	}
	onEvent := func(ev supervise.Event) {
		if ev.Kind == supervise.Escalated {
			envs.Metrics.Escalations.WithLabelValues(ev.Supervisor).Inc()
		}
	}
	root = arrange(r, func(s supervise.Strategy) supervise.Options {
		return supervise.Options{Strategy: s, Logger: d.log, OnRestart: onRestart, OnEvent: onEvent}
	})
	return root
}

// runner is a stage's Run method.
type runner func(ctx context.Context) error

// familyRunners are the stages of one IP family.
type familyRunners struct {
	family                    bus.Family
	render, commit, conntrack runner
}

// treeRunners are the stages the supervisor tree runs.
type treeRunners struct {
	watch, coalesce runner
	families        []familyRunners
	canary, health  runner
	events          runner // nil: no events stage
}

// arrange puts the stages under their supervisors; opts gives a supervisor's
// options for its strategy.
//
//	kpipe (one_for_one)
//	├── pipeline (rest_for_one): watch, coalesce, families (one_for_one)
//	│                                              └── ipv4, ipv6 (rest_for_one): render, commit
//	├── side (one_for_one, never gives up): conntrack-ipv4, conntrack-ipv6, canary, events
//	└── health
//
// The side stages only help the rules (stale UDP flows, flushed tables) or report
// on them (events on the Node): their
// failures restart them alone, show on /healthz and in kpipe_stage_restarts_total,
// and never restart the rule path or stop the process.
func arrange(r treeRunners, opts func(supervise.Strategy) supervise.Options) *supervise.Supervisor {
	var familyTrees, side []supervise.Child
	for _, f := range r.families {
		familyTrees = append(familyTrees, supervise.Tree(f.family.Lower(), opts(supervise.RestForOne),
			leaf(bus.Render.Of(f.family), f.render), leaf(bus.Commit.Of(f.family), f.commit)))
		side = append(side, leaf(bus.Conntrack.Of(f.family), f.conntrack))
	}
	side = append(side, leaf(bus.Canary, r.canary))
	if r.events != nil {
		side = append(side, leaf(events.Name, r.events))
	}
	sideOpts := opts(supervise.OneForOne)
	sideOpts.NeverEscalate = true
	return supervise.Tree("kpipe", opts(supervise.OneForOne),
		supervise.Tree("pipeline", opts(supervise.RestForOne),
			leaf(bus.Watch, r.watch), leaf(bus.Coalesce, r.coalesce),
			supervise.Tree("families", opts(supervise.OneForOne), familyTrees...)),
		supervise.Tree("side", sideOpts, side...),
		leaf(bus.Health, r.health))
}

// leaf is a supervised stage, named as its Env and its board entry are.
func leaf(name bus.StageName, run runner) supervise.Child { return supervise.Leaf(string(name), run) }

// sideStages names the stages of the side supervisor.
func (r treeRunners) sideStages() []bus.StageName {
	out := []bus.StageName{bus.Canary}
	if r.events != nil {
		out = append(out, events.Name)
	}
	for _, f := range r.families {
		out = append(out, bus.Conntrack.Of(f.family))
	}
	return out
}
