// Package canary notices when something else flushed kpipe's tables: it keeps a
// KUBE-PROXY-CANARY chain holding one rule in mangle, nat and filter, and asks for a
// full resync when a chain or its rule disappears (iptables -X or -F).
package canary

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

var tables = []string{nf.TableMangle, nf.TableNAT, nf.TableFilter}

// maxFailures is how many checks of a family in a row may fail (iptables did not
// answer) before the stage fails, so that the supervisor backs off and restarts it.
const maxFailures = 3

// Canaries is what the stage needs from netfilter (nf.Tool).
type Canaries interface {
	EnsureCanaries(ctx context.Context, tables []string) error
	// CanaryAlive is false, with no error, only when the chain or its rule is gone.
	CanaryAlive(ctx context.Context, table string) (bool, error)
}

// Params wire the canary stage.
type Params struct {
	Interval time.Duration
	// Resync holds the full-resync flag of each family the stage watches.
	Resync map[bus.Family]*bus.ResyncFlag
	// Tools check each family's canaries; nil: iptables (nf.Tool).
	Tools map[bus.Family]Canaries
	Env   bus.Env
}

// Stage watches the canary chains of every family.
type Stage struct {
	interval time.Duration
	resync   map[bus.Family]*bus.ResyncFlag
	log      *slog.Logger
	tools    map[bus.Family]Canaries
	failures map[bus.Family]int // checks failed in a row
}

// NewStage makes the canary stage.
func NewStage(p Params) *Stage {
	tools := p.Tools
	if tools == nil {
		tools = map[bus.Family]Canaries{}
		for f := range p.Resync {
			tools[f] = nf.Tool{Family: f}
		}
	}
	return &Stage{interval: p.Interval, resync: p.Resync, log: p.Env.Log, tools: tools, failures: map[bus.Family]int{}}
}

// Run checks the canaries every interval until ctx ends.
func (s *Stage) Run(ctx context.Context) error {
	clear(s.failures) // a restart starts the count again
	for f, tool := range s.tools {
		if err := tool.EnsureCanaries(ctx, tables); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("put the %v canaries in place: %w", f, err)
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
		for f, tool := range s.tools {
			if err := s.check(ctx, f, tool); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
		}
	}
}

// check asks for a full resync of family f when a canary is gone, and puts the
// canaries back. An iptables error is not a flush (a resync would rewrite every
// rule for nothing): it is logged and counted, and only after maxFailures in a
// row does check fail.
func (s *Stage) check(ctx context.Context, f bus.Family, tool Canaries) error {
	for _, t := range tables {
		alive, err := tool.CanaryAlive(ctx, t)
		if err != nil {
			s.failures[f]++
			if s.failures[f] >= maxFailures {
				return fmt.Errorf("check the %v canary in %s (%d failures in a row): %w", f, t, s.failures[f], err)
			}
			s.log.Warn("cannot check the canary; trying again at the next tick", "family", f, "table", t,
				"failures_in_a_row", s.failures[f], "err", err)
			return nil
		}
		if alive {
			continue
		}
		s.log.Warn("canary gone: the tables were flushed; resyncing", "family", f, "table", t)
		s.resync[f].Raise() // first: a failure to put the canary back must not lose it
		if err := tool.EnsureCanaries(ctx, tables); err != nil {
			return fmt.Errorf("put the %v canaries back: %w", f, err)
		}
		break
	}
	s.failures[f] = 0
	return nil
}
