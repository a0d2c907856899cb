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
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Clearer is what the stage needs from netfilter (nf.Conntrack).
type Clearer interface {
	ClearStaleUDP(nf.StaleUDP) (int, error)
	Close() error
}

// Params wire the conntrack stage of one family.
type Params struct {
	Family bus.Family
	In     *bus.Mailbox[bus.StaleFlows]
	// Dial opens the conntrack connection on every start; nil: netlink (nf.DialConntrack).
	Dial func() (Clearer, error)
	Env  bus.Env
}

// Stage clears stale UDP flows of one family.
type Stage struct {
	family  bus.Family
	in      *bus.Mailbox[bus.StaleFlows]
	metrics *metrics.Metrics
	log     *slog.Logger
	dial    func() (Clearer, error)
}

// NewStage makes the conntrack stage of one family.
func NewStage(p Params) *Stage {
	dial := p.Dial
	if dial == nil {
		dial = func() (Clearer, error) { return nf.DialConntrack() }
	}
	return &Stage{family: p.Family, in: p.In, metrics: p.Env.Metrics, log: p.Env.Log, dial: dial}
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
		s.metrics.ConntrackDuration.WithLabelValues(s.family.String()).Observe(time.Since(start).Seconds())
		s.metrics.ConntrackDeleted.WithLabelValues(s.family.String()).Add(float64(n))
		if n > 0 {
			s.log.Info("cleared stale UDP flows", "family", s.family, "deleted", n)
		}
		if flows.Forgotten > 0 {
			s.log.Warn("UDP front-ends that went away while conntrack was behind were forgotten; their flows expire on the kernel's timeouts",
				"family", s.family, "forgotten", flows.Forgotten, "kept", bus.MaxGone)
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
