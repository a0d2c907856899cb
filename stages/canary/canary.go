// Package canary notices when something else flushed kpipe's tables: it keeps a
// KUBE-PROXY-CANARY chain holding one rule in mangle, nat and filter, and asks for a
// full resync when a chain or its rule disappears (iptables -X or -F).
package canary

import (
	"context"
	"log/slog"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

var tables = []string{nf.TableMangle, nf.TableNAT, nf.TableFilter}

// Stage watches the canary chains of every family.
type Stage struct {
	interval time.Duration
	resync   map[bus.Family]*bus.Flag
	log      *slog.Logger
}

// NewStage makes the canary stage; resync holds the full-resync flag of each family.
func NewStage(interval time.Duration, resync map[bus.Family]*bus.Flag, log *slog.Logger) *Stage {
	return &Stage{interval: interval, resync: resync, log: log}
}

// Run checks the canaries every interval until ctx ends.
func (s *Stage) Run(ctx context.Context) error {
	handles := map[bus.Family]*nf.Rules{}
	for f := range s.resync {
		r, err := nf.NewRules(f)
		if err != nil {
			return err
		}
		handles[f] = r
		if err := r.EnsureCanaries(tables); err != nil {
			return err
		}
	}
	tick := time.NewTicker(s.interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		for f, r := range handles {
			if err := s.check(f, r); err != nil {
				return err
			}
		}
	}
}

func (s *Stage) check(f bus.Family, r *nf.Rules) error {
	for _, t := range tables {
		if r.CanaryAlive(t) {
			continue
		}
		s.log.Warn("canary gone: the tables were flushed; resyncing", "family", f, "table", t)
		if err := r.EnsureCanaries(tables); err != nil {
			return err
		}
		s.resync[f].Raise()
		return nil
	}
	return nil
}
