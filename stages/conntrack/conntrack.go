// Package conntrack clears UDP conntrack flows that still point where the rules no
// longer send traffic, once a commit has changed a UDP service. (TCP needs no help:
// a connection to a removed endpoint fails and the client reconnects.)
package conntrack

import (
	"context"
	"log/slog"
	"net/netip"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// clearer is what the stage needs from netfilter (nf.Conntrack).
type clearer interface {
	ClearStaleUDP(nf.StaleUDP) (int, error)
	Close() error
}

// Stage clears stale UDP flows of one family.
type Stage struct {
	family  bus.Family
	in      *bus.Mailbox[bus.StaleFlows]
	metrics *bus.Metrics
	log     *slog.Logger
	dial    func() (clearer, error)
}

// NewStage makes the conntrack stage of family.
func NewStage(family bus.Family, in *bus.Mailbox[bus.StaleFlows], metrics *bus.Metrics, log *slog.Logger) *Stage {
	dial := func() (clearer, error) { return nf.DialConntrack() }
	return &Stage{family: family, in: in, metrics: metrics, log: log, dial: dial}
}

// Run clears flows after each commit that changed UDP front-ends, until ctx ends.
func (s *Stage) Run(ctx context.Context) error {
	ct, err := s.dial()
	if err != nil {
		return err
	}
	defer ct.Close()
	for {
		flows, err := s.in.Take(ctx)
		if err != nil {
			return nil
		}
		start := time.Now()
		local, err := localSet()
		if err != nil {
			s.in.Requeue(flows) // keep the work for the restarted stage, as older than anything put since
			return err
		}
		n, err := ct.ClearStaleUDP(nf.StaleUDP{Family: s.family, Now: flows.Now, Gone: flows.Gone,
			IsLocal: func(a netip.Addr) bool { return local[a] }})
		if err != nil {
			s.in.Requeue(flows)
			return err
		}
		s.metrics.ConntrackDuration.Observe(time.Since(start).Seconds())
		s.metrics.ConntrackDeleted.Add(float64(n))
		if n > 0 {
			s.log.Info("cleared stale UDP flows", "family", s.family, "deleted", n)
		}
	}
}

func localSet() (map[netip.Addr]bool, error) {
	addrs, err := nf.LocalAddrs()
	if err != nil {
		return nil, err
	}
	set := make(map[netip.Addr]bool, len(addrs))
	for _, a := range addrs {
		set[a] = true
	}
	return set, nil
}
