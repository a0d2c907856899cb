package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/canary"
	"github.com/kpipe/kpipe/stages/coalesce"
	"github.com/kpipe/kpipe/stages/commit"
	"github.com/kpipe/kpipe/stages/conntrack"
	"github.com/kpipe/kpipe/stages/health"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/watch"
	"github.com/kpipe/kpipe/supervise"
)

// serve builds the stages and runs them under the supervisor tree (buildTree)
// until ctx ends. Stopping leaves every rule in place: a restarted kpipe takes
// them over.
func serve(ctx context.Context, o *Options) error {
	log := newLogger(os.Stderr, o.LogFormat, o.LogLevel)
	client, err := newClient(o.Kubeconfig)
	if err != nil {
		return err
	}
	families := hostFamilies(log)
	host := prepareHost(o, log)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := bus.NewMetrics(reg)
	board := bus.NewBoard()
	changes := make(chan bus.Change, 1024)
	replay := bus.NewFlag()
	checks := bus.NewMergingMailbox(bus.MergeHealthCheckUpdates)

	onRestart := func(stage string, err error) {
		metrics.StageRestarts.WithLabelValues(stage).Inc()
		board.Update(stage, func(r *bus.Report) { r.Errors++; r.LastError, r.LastErrorAt = err.Error(), time.Now() })
	}
	opts := func(s supervise.Strategy) supervise.Options {
		return supervise.Options{Strategy: s, Logger: log, OnRestart: onRestart}
	}
	runners := treeRunners{}
	var coalesceIO []coalesce.Family
	resync := map[bus.Family]*bus.Flag{}
	for _, f := range families {
		name := lower(f)
		snapshots, plans := bus.NewMailbox[*bus.Snapshot](), bus.NewMailbox[*bus.Plan]()
		results, flows := bus.NewMailbox[bus.Result](), bus.NewMergingMailbox(bus.MergeStaleFlows)
		resync[f] = bus.NewFlag()
		resend := bus.NewFlag()
		coalesceIO = append(coalesceIO, coalesce.Family{Family: f, Out: snapshots, Results: results, Resync: resync[f], Resend: resend})
		rs := render.NewStage(o.renderConfig(f, host), snapshots, plans, resend, log.With("stage", "render-"+name))
		cs := commit.NewStage(f, o.localhostNodePorts(), plans, commit.Outputs{Results: results, Resend: resend, Flows: flows, HealthChecks: checks},
			commit.NewLedger(), nf.Tool{Family: f}, board, metrics, log.With("stage", "commit-"+name))
		ct := conntrack.NewStage(f, flows, metrics, log.With("stage", "conntrack-"+name))
		runners.families = append(runners.families, familyRunners{name: name, render: rs.Run, commit: cs.Run, conntrack: ct.Run})
	}
	ws := watch.NewStage(client, o.HostnameOverride, changes, replay, board, metrics, log.With("stage", "watch"), len(o.nodePortCIDRs) > 0)
	co := coalesce.NewStage(coalesce.Config{MinSyncPeriod: o.MinSyncPeriod, SyncPeriod: o.SyncPeriod, Burst: 2},
		changes, replay, coalesceIO, board, metrics, log.With("stage", "coalesce"))
	ca := canary.NewStage(o.CanaryInterval, resync, log.With("stage", "canary"))

	var root *supervise.Supervisor
	var stagesHandler http.Handler
	if o.EnableDebugHandlers {
		stagesHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { supervise.Handler(root).ServeHTTP(w, r) })
	}
	he := health.New(health.Config{
		HealthzAddr: o.HealthzBindAddress, MetricsAddr: o.MetricsBindAddress, EnableDebug: o.EnableDebugHandlers,
		SyncPeriod: o.SyncPeriod, NodeName: o.HostnameOverride, Families: families, Configz: o, SideStages: runners.sideStages(),
	}, board, reg, metrics, checks, stagesHandler, log.With("stage", "health"))

	runners.watch, runners.coalesce, runners.canary, runners.health = ws.Run, co.Run, ca.Run, he.Run
	root = buildTree(runners, opts)
	log.Info("kpipe starting", "node", o.HostnameOverride, "families", fmt.Sprint(families), "mode", "iptables")
	if err := root.Run(ctx); err != nil {
		log.Error("kpipe stopping: a stage kept failing", "err", err)
		return err
	}
	log.Info("kpipe stopped; rules left in place")
	return nil
}

func lower(f bus.Family) string {
	if f == bus.IPv6 {
		return "ipv6"
	}
	return "ipv4"
}

func newClient(kubeconfig string) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %q: %w", kubeconfig, err)
	}
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	cfg.UserAgent = "kpipe"
	return kubernetes.NewForConfig(cfg)
}
