package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/canary"
	"github.com/kpipe/kpipe/stages/commit"
	"github.com/kpipe/kpipe/stages/conntrack"
)

// serve connects to the apiserver and the host (realDeps), builds the stages
// under their supervisor tree (buildTree) and runs them until ctx ends. When the
// config file changes into a valid configuration, it stops the tree and builds
// a new one with the new settings (runUntilReload). Stopping leaves every rule in
// place: a restarted kpipe, or the next tree, takes them over.
func serve(ctx context.Context, o *Options) error {
	log, install := processLogger(o)
	install()
	if err := serveLogged(ctx, o, log); err != nil {
		// Once logging is set up, the error kpipe stops on is a log line in
		// the chosen format, as kube-proxy's (cli.Run logs it through klog).
		log.Error("kpipe stopped", "err", err)
		return loggedError{err}
	}
	return nil
}

// loggedError is an error serve has logged: main does not print it again.
type loggedError struct{ error }

func (e loggedError) Unwrap() error { return e.error }

// serveLogged is serve with its logger made.
func serveLogged(ctx context.Context, o *Options, log *slog.Logger) error {
	o.logLenientDecode(log)
	if o.Cleanup {
		return cleanup(ctx, log)
	}
	if o.InitOnly {
		removeNFTablesMode(ctx, log)
		if err := initNode(o, realNodeHost, log); err != nil {
			return err
		}
		log.Info("node set up (--init-only); exiting")
		return nil
	}
	d, err := realDeps(o, log)
	if err != nil {
		return err
	}
	d.afterSync = removeNFTablesMode
	o.logIgnored(log)
	return runReloading(ctx, o, d, watchConfigFile(ctx, o.ConfigFile, log), reconfigure)
}

// reconfigure is d for a reloaded configuration o (see deps.reconfigured).
// Its logging becomes the process's only once it is taken.
func reconfigure(o *Options, d deps) (deps, error) {
	log, install := processLogger(o)
	d, err := d.reconfigured(o, realNodeHost, log)
	if err == nil {
		install()
	}
	return d, err
}

// realDeps are the real dependencies: the apiserver client, iptables and
// conntrack netlink for each family the host has, the host's facts, and the
// metrics (registerMetrics).
func realDeps(o *Options, log *slog.Logger) (deps, error) {
	d := deps{kernels: map[bus.Family]commit.Kernel{}, canaries: map[bus.Family]canary.Canaries{},
		conntrack: func() (conntrack.Clearer, error) { return nf.DialConntrack() }}
	writer, err := o.writer()
	if err != nil {
		return deps{}, err
	}
	families := hostFamilies(log)
	for _, f := range families {
		d.kernels[f], d.canaries[f] = nf.Tool{Family: f, Writer: writer}, nf.Tool{Family: f}
	}
	d.registry, d.metrics = registerMetrics(o, families, log)
	return d.reconfigured(o, realNodeHost, log)
}

// registerMetrics makes the registry of kpipe's metrics and records in
// component-base's global one (served beside it: metrics.Served) what kube-proxy
// records there at start: the feature gates and the build. The Go and process
// collectors are component-base's: kpipe's registry has none.
func registerMetrics(o *Options, families []bus.Family, log *slog.Logger) (*prometheus.Registry, *metrics.Metrics) {
	o.gate.AddMetrics()
	metrics.SetKubernetesBuildInfo(buildLabels())
	reg := prometheus.NewRegistry()
	registerFamilies(reg, families)
	reg.MustRegister(buildInfoMetric())
	m := metrics.New(reg)
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "kpipe_netlink_writer_fallbacks_total",
		Help: "Rule writes the netlink writer encoded but the kernel refused, which iptables-restore then made (or was refused too).",
	}, func() float64 { return float64(nf.NetlinkFallbacks.Load()) }))
	reg.MustRegister(metrics.NFAcct{Reader: nf.NFAcct{}, InvalidDropped: nf.NFAcctInvalidDropped, LocalhostNodePorts: nf.NFAcctLocalhostNodePorts, Log: log})
	return reg, m
}

// reconfigured are d for the options o: a new apiserver client and event
// recorder (the client connection may have changed), the node set up on h and
// the host's facts read again; the kernels, the conntrack connection and the
// metrics stay. The client comes first, as in kube-proxy: options it fails on
// change nothing on the node (a reload rejected for it leaves the running
// configuration whole).
func (d deps) reconfigured(o *Options, h nodeHost, log *slog.Logger) (deps, error) {
	client, err := newClient(o)
	if err != nil {
		return deps{}, err
	}
	d.setupFailures = setUpNode(o, h, log)
	d.log = log
	d.connect(client)
	// After node set-up: the host's facts include the conntrack sysctls.
	d.host = prepareHost(log)
	return d, nil
}

// newClient connects as kube-proxy does: the kubeconfig (or in-cluster settings),
// --master over its server, and the client connection's rate and content type.
func newClient(o *Options) (kubernetes.Interface, error) {
	cfg, err := clientConfig(o)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

func clientConfig(o *Options) (*rest.Config, error) {
	cfg, err := restConfig(o.Kubeconfig, o.Master)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %q: %w", o.Kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = o.KubeAPIQPS, o.KubeAPIBurst
	cfg.ContentType = o.KubeAPIContentType
	cfg.AcceptContentTypes = o.KubeAPIContentType
	if o.KubeAPIContentType != "application/json" {
		cfg.AcceptContentTypes += ",application/json"
	}
	cfg.UserAgent = "kpipe"
	return cfg, nil
}

func restConfig(kubeconfig, master string) (*rest.Config, error) {
	if kubeconfig == "" && master == "" {
		return rest.InClusterConfig()
	}
	return clientcmd.BuildConfigFromFlags(master, kubeconfig)
}
