// Package commit is the only writer of netfilter rules: it applies render's plans
// with iptables-restore and reports each result to coalesce.
package commit

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Outputs are where commit sends what follows a successful commit.
type Outputs struct {
	Results      *bus.Mailbox[bus.Result]
	Resend       *bus.Flag
	Flows        *bus.Mailbox[bus.StaleFlows]
	HealthChecks *bus.Mailbox[bus.HealthCheckUpdates]
}

// Stage applies plans of one family.
type Stage struct {
	family           bus.Family
	localnetFirewall bool
	in               *bus.Mailbox[*bus.Plan]
	out              Outputs
	board            *bus.Board
	metrics          *bus.Metrics
	log              *slog.Logger
	tool             nf.Tool
	name             string
}

// NewStage makes the commit stage of family. localnetFirewall says whether the
// KUBE-FIREWALL jumps (localhost NodePorts) are wanted.
func NewStage(family bus.Family, localnetFirewall bool, in *bus.Mailbox[*bus.Plan], out Outputs, board *bus.Board, metrics *bus.Metrics, log *slog.Logger) *Stage {
	return &Stage{family: family, localnetFirewall: localnetFirewall, in: in, out: out, board: board, metrics: metrics, log: log,
		tool: nf.Tool{Family: family}, name: "commit-" + lower(family)}
}

func lower(f bus.Family) string {
	if f == bus.IPv6 {
		return "ipv6"
	}
	return "ipv4"
}

// Run applies plans until ctx ends. It never flushes anything at start: the rules
// a previous kpipe left keep working until a full sync replaces them.
func (s *Stage) Run(ctx context.Context) error {
	rules := s.tool
	// A plan a previous run was applying is lost: ask for it again. (At start-up
	// coalesce's first snapshot is a full sync anyway.)
	if s.out.Resend != nil {
		s.out.Resend.Raise()
	}
	var last *bus.Programmed
	for {
		plan, err := s.in.Take(ctx)
		if err != nil {
			return nil
		}
		start := time.Now()
		if err := s.apply(ctx, rules, plan); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			s.metrics.RestoreFailures.Inc()
			s.log.Error("commit failed; a full resync follows", "family", s.family, "generation", plan.Generation, "err", err)
			s.board.Update(s.name, func(r *bus.Report) { r.Errors++; r.LastError = err.Error() })
			// The failed result makes coalesce retry with a full sync, after a backoff.
			s.out.Results.Put(bus.Result{Family: s.family, Generation: plan.Generation, Err: err, Full: plan.Full, At: time.Now()})
			continue
		}
		now := time.Now()
		s.record(plan, start, now)
		s.out.Results.Put(bus.Result{Family: s.family, Generation: plan.Generation, OK: true, Full: plan.Full, At: now,
			Programmed: plan.Programmed})
		s.out.HealthChecks.Put(bus.HealthCheckUpdates{s.family: plan.HealthChecks})
		if flows, changed := staleFlows(s.family, last, plan.Programmed); changed {
			s.out.Flows.Put(flows)
		}
		last = plan.Programmed
	}
}

// maxChainsPerRestore bounds how many chains one iptables-restore rewrites. With
// --noflush on iptables-nft the cost grows with the square of that count: a
// 10k-service full sync (20k chains) takes about 53 s as one restore and about 7 s
// in batches of 5000 (see BenchmarkRestore).
const maxChainsPerRestore = 4000

// apply writes the plan. A full plan also deletes per-service chains that exist in
// the kernel but not in the plan; a full or periodic one re-ensures the jumps from
// the built-in chains.
// A large plan is written in batches: per-service chains first, in an order where a
// chain only jumps to chains already written, and the top-level chains, which make
// the new chains reachable, last. Each batch replaces whole chains atomically.
func (s *Stage) apply(ctx context.Context, rules nf.Tool, plan *bus.Plan) error {
	var batches [][]byte
	var last bytes.Buffer
	for _, tp := range plan.Tables {
		var stale []string
		if plan.Full {
			existing, err := s.tool.Chains(ctx, tp.Table)
			if err != nil {
				return err
			}
			stale = staleChains(existing, tp, plan.Programmed)
		}
		chains := tp.Chains
		if plan.Refresh && !plan.Full {
			chains = s.drifted(ctx, tp.Table, chains)
		}
		services, top := splitChains(chains)
		if len(chains) <= maxChainsPerRestore {
			services, top = nil, chains
		}
		for len(services) > 0 {
			n := min(len(services), maxChainsPerRestore)
			batches = append(batches, nf.Assemble(tp.Table, services[:n], nil))
			services = services[n:]
		}
		if len(top) > 0 || len(tp.Delete) > 0 || len(stale) > 0 {
			last.Write(nf.Assemble(tp.Table, top, append(append([]string{}, tp.Delete...), stale...)))
		}
	}
	if last.Len() > 0 {
		batches = append(batches, last.Bytes())
	}
	for i, b := range batches {
		if err := s.tool.Restore(ctx, b); err != nil {
			return fmt.Errorf("commit generation %d (restore %d of %d): %w", plan.Generation, i+1, len(batches), err)
		}
	}
	if plan.Full || plan.Refresh {
		if err := rules.EnsureJumps(ctx, nf.Jumps(s.localnetFirewall && s.family == bus.IPv4)); err != nil {
			return err
		}
	}
	return nil
}

// drifted keeps, of a periodic plan's chains, the per-service chains (they changed)
// and the top-level chains whose rule count in the kernel is not what kpipe wrote:
// someone deleted or added a rule by hand. Reading a chain is cheap where
// rewriting KUBE-SERVICES is not (4 s at 10k services: every rule's jump target
// is looked up among all chains).
func (s *Stage) drifted(ctx context.Context, table string, chains []bus.Chain) []bus.Chain {
	var out []bus.Chain
	for _, c := range chains {
		if nf.IsOwned(c.Name) || s.tool.RuleCount(ctx, table, c.Name) != bytes.Count(c.Rules, []byte("\n")) {
			out = append(out, c)
		}
	}
	return out
}

// splitChains separates per-service chains, ordered so that each only jumps to
// chains before it (KUBE-MARK-MASQ, which they jump to and which a fresh node does
// not have yet, then endpoint chains, then service and local-policy chains, then
// external, then firewall, then the KUBE-SERVICES buckets), from the top-level
// chains.
func splitChains(chains []bus.Chain) (services, top []bus.Chain) {
	rank := nf.WriteRank
	for _, c := range chains {
		if rank(c.Name) < 0 {
			top = append(top, c)
		} else {
			services = append(services, c)
		}
	}
	slices.SortStableFunc(services, func(a, b bus.Chain) int { return rank(a.Name) - rank(b.Name) })
	return services, top
}

// staleChains lists per-service chains in the kernel that the plan neither writes
// nor deletes already.
func staleChains(existing []string, tp bus.TablePayload, programmed *bus.Programmed) []string {
	var stale []string
	for _, c := range existing {
		if !nf.IsOwned(c) || slices.Contains(tp.Delete, c) {
			continue
		}
		if _, ok := programmed.Chains[tp.Table+"/"+c]; !ok {
			stale = append(stale, c)
		}
	}
	return stale
}

func (s *Stage) record(plan *bus.Plan, start, now time.Time) {
	began := plan.Started
	if began.IsZero() {
		began = start
	}
	took := now.Sub(began).Seconds()
	s.metrics.SyncDuration.Observe(took)
	if plan.Full {
		s.metrics.SyncFullDuration.Observe(took)
	} else {
		s.metrics.SyncPartialDuration.Observe(took)
	}
	s.metrics.LastSync.SetToCurrentTime()
	for _, tp := range plan.Tables {
		s.metrics.RulesTotal.WithLabelValues(tp.Table).Set(float64(tp.RuleCount))
	}
	for policy, n := range plan.NoLocalEndpoints {
		s.metrics.NoLocalEndpoints.WithLabelValues(policy).Set(float64(n))
	}
	s.board.Update(s.name, func(r *bus.Report) { r.LastSync = now; r.Detail = fmt.Sprintf("generation %d", plan.Generation) })
	s.log.Debug("committed", "family", s.family, "generation", plan.Generation, "full", plan.Full, "took", now.Sub(began))
}

// staleFlows says which UDP front-ends changed since the last commit, if any did.
func staleFlows(family bus.Family, last, now *bus.Programmed) (bus.StaleFlows, bool) {
	var before map[netip.AddrPort][]netip.AddrPort
	if last != nil {
		before = last.UDP
	}
	if last != nil && maps.EqualFunc(before, now.UDP, slices.Equal) {
		return bus.StaleFlows{}, false
	}
	gone := map[netip.AddrPort]bool{}
	for k := range before {
		if _, ok := now.UDP[k]; !ok {
			gone[k] = true
		}
	}
	return bus.StaleFlows{Family: family, Now: now.UDP, Gone: gone}, true
}
