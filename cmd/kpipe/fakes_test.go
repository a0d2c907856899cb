package main

import (
	"context"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/canary"
	"github.com/kpipe/kpipe/stages/commit"
	"github.com/kpipe/kpipe/stages/conntrack"
)

// fakeDeps are deps for one IPv4 kernel (a fake, usually) with canaries nobody
// flushes, no conntrack flows and a registry of their own.
func fakeDeps(client kubernetes.Interface, kernel commit.Kernel, log *slog.Logger) deps {
	d := deps{kernels: map[bus.Family]commit.Kernel{bus.IPv4: kernel},
		canaries:  map[bus.Family]canary.Canaries{bus.IPv4: liveCanaries{}},
		conntrack: func() (conntrack.Clearer, error) { return noConntrack{}, nil },
		host:      hostFacts{noRandomFully: map[bus.Family]bool{}},
		log:       log, registry: prometheus.NewRegistry()}
	d.metrics = metrics.New(d.registry)
	d.connect(client)
	return d
}

// liveCanaries are canaries nobody ever flushes.
type liveCanaries struct{}

func (liveCanaries) EnsureCanaries(context.Context, []string) error    { return nil }
func (liveCanaries) CanaryAlive(context.Context, string) (bool, error) { return true, nil }

// noConntrack has no flows to clear.
type noConntrack struct{}

func (noConntrack) ClearStaleUDP(nf.StaleUDP) (int, error) { return 0, nil }
func (noConntrack) Close() error                           { return nil }
