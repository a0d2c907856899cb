package main

import (
	"context"
	"log/slog"
	"net/netip"
	"sync"

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
		log:       log, registry: prometheus.NewRegistry(), board: bus.NewBoard()}
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

// recordingConntrack records the front-ends each clear was asked to delete
// flows of (StaleUDP.Gone), as a conntrack table holding flows to all of them.
type recordingConntrack struct {
	mu     sync.Mutex
	clears int
	gone   map[netip.AddrPort]bool
}

func (r *recordingConntrack) dial() (conntrack.Clearer, error) { return r, nil }

func (r *recordingConntrack) ClearStaleUDP(s nf.StaleUDP) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clears++
	if r.gone == nil {
		r.gone = map[netip.AddrPort]bool{}
	}
	for g := range s.Gone {
		r.gone[g] = true
	}
	return len(s.Gone), nil
}

func (r *recordingConntrack) Close() error { return nil }

// cleared says whether a clear was asked to delete the flows to front-end a,
// and how many clears were made.
func (r *recordingConntrack) cleared(a netip.AddrPort) (bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gone[a], r.clears
}
