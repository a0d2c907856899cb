package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/canary"
	"github.com/kpipe/kpipe/stages/commit"
	"github.com/kpipe/kpipe/stages/conntrack"
)

// serve connects to the apiserver and the host (realDeps), builds the stages
// under their supervisor tree (buildTree) and runs them until ctx ends. Stopping
// leaves every rule in place: a restarted kpipe takes them over.
func serve(ctx context.Context, o *Options) error {
	log := newLogger(os.Stderr, o.LogFormat, o.LogLevel)
	if o.Cleanup {
		return cleanup(ctx, log)
	}
	// Node set-up comes before realDeps, which reads the conntrack sysctls.
	setupFailures := setUpNode(o, realNodeHost, log)
	removeNFTablesMode(ctx, log)
	if o.InitOnly {
		log.Info("node set up (--init-only); exiting")
		return nil
	}
	d, err := realDeps(o, log)
	if err != nil {
		return err
	}
	d.setupFailures = setupFailures
	root := buildTree(o, d)
	log.Info("kpipe starting", "node", o.HostnameOverride, "families", fmt.Sprint(d.families()), "mode", "iptables")
	o.logIgnored(log)
	if err := root.Run(ctx); err != nil {
		log.Error("kpipe stopping: a stage kept failing", "err", err)
		return err
	}
	log.Info("kpipe stopped; rules left in place")
	return nil
}

// realDeps are the real dependencies: the apiserver client, iptables and
// conntrack netlink for each family the host has, the host's facts, and a
// registry with the Go and process collectors.
func realDeps(o *Options, log *slog.Logger) (deps, error) {
	client, err := newClient(o)
	if err != nil {
		return deps{}, err
	}
	d := deps{client: client, kernels: map[bus.Family]commit.Kernel{}, canaries: map[bus.Family]canary.Canaries{},
		conntrack: func() (conntrack.Clearer, error) { return nf.DialConntrack() }, log: log, registry: prometheus.NewRegistry()}
	for _, f := range hostFamilies(log) {
		d.kernels[f], d.canaries[f] = nf.Tool{Family: f}, nf.Tool{Family: f}
	}
	d.host = prepareHost(o, log)
	d.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
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
