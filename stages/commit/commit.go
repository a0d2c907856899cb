// Package commit is the only writer of netfilter rules: it compares each of
// render's plans with what its Ledger says the kernel holds, writes what differs
// with iptables-restore, and reports each result to coalesce.
package commit

import (
	"context"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Kernel is what commit needs from netfilter; netfilter.Tool provides it, and a
// test fake can fail or stall on demand.
type Kernel interface {
	// Prepare readies an iptables-restore --noflush payload without touching
	// the kernel; write applies it. Commit prepares the next step of a large
	// write while the kernel takes the one before.
	Prepare(payload []byte) (write func(ctx context.Context) error)
	// Digests returns a digest of the rules of each chain of table (every chain
	// when names is nil; of names, those that exist): equal digests, same rules.
	// nf.ErrBusy comes with the digests of the chains it could read.
	Digests(ctx context.Context, table string, names []string) (map[string]uint64, error)
	// ExpectedDigest is the digest Digests gives a chain holding rules (ok:
	// known without writing them; for no rules, whether it ever is).
	ExpectedDigest(ctx context.Context, table, rules string) (digest uint64, ok bool)
	// ChainNames lists the chains of table.
	ChainNames(ctx context.Context, table string) ([]string, error)
	// ListChain returns the rules of one chain ("-A ..." lines; nf.ErrNoChain
	// when it does not exist).
	ListChain(ctx context.Context, table, chain string) ([]string, error)
	// EnsureJumps puts back any missing jump from a built-in chain; a jump that
	// is there stays where it is, whatever another agent put in front of it.
	EnsureJumps(ctx context.Context, js []nf.Jump) error
	// WriteSysctl sets a sysctl such as "net/ipv4/conf/all/route_localnet".
	WriteSysctl(name, value string) error
}

// Params wire the commit stage of one family.
type Params struct {
	Family bus.Family
	// LocalhostNodePorts: NodePorts answer on 127.0.0.1, which needs
	// route_localnet and the KUBE-FIREWALL rule that guards it. The caller
	// decides it for Family (cmd/kpipe: IPv4 only), as it does render's.
	LocalhostNodePorts bool
	In                 *bus.Mailbox[*bus.Plan]
	// Results carry each commit's outcome to coalesce; Resend is raised on every
	// start (the plan in flight may be lost).
	Results *bus.Mailbox[bus.Result]
	Resend  *bus.ResendFlag
	// Flows (to conntrack) and HealthChecks (to health) follow a successful
	// commit; either may be nil.
	Flows        *bus.Mailbox[bus.StaleFlows]
	HealthChecks *bus.Mailbox[bus.HealthCheckUpdates]
	// Repairs (from canary; may be nil) name kpipe's chains that changed,
	// kpipe's own writes among them: commit rewrites at once, from the last
	// plan it applied, those the kernel does not hold as it wrote them.
	Repairs *bus.Mailbox[bus.Repair]
	// Ledger outlives the stage: a restarted stage gets the same one.
	Ledger *Ledger
	Kernel Kernel
	Env    bus.Env
}

// Stage applies plans of one family.
type Stage struct {
	p      Params
	family bus.Family
	// localnetFirewall: NodePorts answer on 127.0.0.1, which needs route_localnet
	// and the KUBE-FIREWALL rule that guards it.
	localnetFirewall bool
	ledger           *Ledger
	kernel           Kernel
	metrics          *metrics.Metrics
	written          map[string]int // rules the last apply wrote, by table
	log              *slog.Logger
	// last is the last plan applied (nil after a failure: coalesce then sends a
	// full sync); repair asks for it to be applied again, and for kpipe's
	// missing jumps to be put back in the tables it names.
	last   *bus.Plan
	repair *bus.Repair
	// early is the kernel as Run read it at start, for the first full sync.
	early *earlyRead
	// afterEarlyRead, when set, runs once Run has read the kernel at start;
	// tests change the kernel there.
	afterEarlyRead func()
}

// NewStage makes the commit stage of one family.
func NewStage(p Params) *Stage {
	return &Stage{p: p, family: p.Family, localnetFirewall: p.LocalhostNodePorts, ledger: p.Ledger,
		kernel: p.Kernel, metrics: p.Env.Metrics, log: p.Env.Log}
}

// Run applies plans until ctx ends. It never flushes anything at start: the rules
// a previous kpipe left keep working until a full sync replaces them.
func (s *Stage) Run(ctx context.Context) error {
	// A plan a previous run was applying is lost: ask for the state again. The
	// ledger knows which chains that run may have left half-way.
	if s.p.Resend != nil {
		s.p.Resend.Raise()
	}
	s.early = nil
	if !s.ledger.synced {
		s.early = s.readEarly(ctx)
	}
	if s.afterEarlyRead != nil {
		s.afterEarlyRead()
	}
	for {
		plan, again, err := s.next(ctx)
		if err != nil {
			return nil
		}
		if again {
			s.applyAgain(ctx, plan)
			continue
		}
		start := time.Now()
		full := s.writtenFull(plan)
		if err := s.apply(ctx, plan); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			s.last = nil
			// Not logged here: coalesce logs the failure with the backoff it retries after.
			s.countFailure(full)
			s.p.Env.Status.Failed(err, time.Now())
			// The failed result makes coalesce retry with a full sync, after a backoff.
			s.p.Results.Put(bus.Result{Family: s.family, Generation: plan.Generation, Err: err, Full: full, At: time.Now()})
			continue
		}
		last := *plan // applied again, it is neither a full nor a periodic sync, nor timed from render
		last.Full, last.Refresh, last.Started = false, false, time.Time{}
		s.last = &last
		now := time.Now()
		s.repaired(ctx)
		s.record(plan, full, start, now)
		flows, udpChanged := staleFlows(s.family, s.ledger.udp, s.ledger.haveUDP, plan.UDP)
		s.ledger.udp, s.ledger.haveUDP = plan.UDP, true
		if s.p.HealthChecks != nil {
			s.p.HealthChecks.Put(bus.HealthCheckUpdates{s.family: plan.HealthChecks})
		}
		if udpChanged && s.p.Flows != nil {
			s.p.Flows.Put(flows)
		}
		// The result goes last: whoever sees it sees everything this commit sent.
		s.p.Results.Put(bus.Result{Family: s.family, Generation: plan.Generation, OK: true, Full: full, Refresh: plan.Refresh, At: now})
	}
}

// next waits for a plan to apply: a new one from render, or (again) the last one
// when a repair is wanted and no new plan waits (a new one rewrites the chains in
// doubt too). Before any plan succeeded, a repair waits for the next plan.
func (s *Stage) next(ctx context.Context) (plan *bus.Plan, again bool, err error) {
	var repairs <-chan struct{}
	if s.p.Repairs != nil {
		repairs = s.p.Repairs.Ready()
	}
	for {
		if err := ctx.Err(); err != nil {
			// Checked first: a repair left pending by a cancelled apply must not
			// be applied again and again by a stage told to stop.
			return nil, false, err
		}
		if s.p.Repairs != nil {
			if r, ok := s.p.Repairs.TryTake(); ok {
				s.takeRepair(ctx, r)
			}
		}
		if plan, ok := s.p.In.TryTake(); ok {
			return plan, false, nil
		}
		if s.repair != nil && s.last != nil {
			return s.last, true, nil
		}
		select {
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-s.p.In.Ready():
		case <-repairs:
		}
	}
}

// takeRepair records a repair request: its chains that the kernel does not hold
// as kpipe wrote them (unlikeWritten: kpipe's own writes are named too) are in
// doubt from now on, so the next apply rewrites them; a lost table makes the
// next apply a full sync.
func (s *Stage) takeRepair(ctx context.Context, r bus.Repair) {
	if !r.Lost {
		r.Chains = s.unlikeWritten(ctx, r.Chains)
	}
	if r.Empty() {
		return
	}
	if s.repair != nil {
		r = bus.MergeRepairs(*s.repair, r)
	}
	for table, chains := range r.Chains {
		for chain := range chains {
			s.ledger.suspect(table, chain)
		}
	}
	if r.Lost {
		s.ledger.synced = false
	}
	s.repair = &r
}

// applyAgain applies the last plan again, for a repair. A failure is logged and
// the repair dropped (no retry in a loop): its chains stay in doubt (a lost table:
// the ledger unsynced), so the next plan, at the latest the periodic sync's,
// rewrites them.
func (s *Stage) applyAgain(ctx context.Context, plan *bus.Plan) {
	start := time.Now()
	full := s.writtenFull(plan)
	if err := s.apply(ctx, plan); err != nil {
		if ctx.Err() == nil {
			s.repair = nil
			s.log.Warn("repairing rules another writer changed", "family", s.family, "err", err)
			s.p.Env.Status.Failed(err, time.Now())
		}
		return
	}
	if full { // a full sync like any other, for the metrics and /sync
		s.record(plan, full, start, time.Now())
	}
	s.repaired(ctx)
}

// repaired finishes the repair an apply just carried: kpipe's jumps that are
// missing go back where another writer changed a built-in chain.
func (s *Stage) repaired(ctx context.Context) {
	r := s.repair
	if r == nil {
		return
	}
	s.repair = nil
	var js []nf.Jump
	for _, j := range nf.Jumps(s.localnetFirewall) {
		if r.Jumps[j.Table] {
			js = append(js, j)
		}
	}
	if len(js) > 0 {
		if err := s.kernel.EnsureJumps(ctx, js); err != nil {
			s.log.Warn("putting kpipe's missing jumps back", "family", s.family, "err", err)
			return
		}
	}
	chains := 0
	for _, cs := range r.Chains {
		chains += len(cs)
	}
	s.log.Info("repaired what another writer changed", "family", s.family, "chains", chains, "jump_tables", len(js), "lost", r.Lost,
		"took", time.Since(r.Since).Round(time.Millisecond))
}

// writtenFull says whether plan is written as a full sync: asked for, or without
// a ledger that matches the kernel (a new process, a failed full sync).
func (s *Stage) writtenFull(plan *bus.Plan) bool { return plan.Full || !s.ledger.synced }

// countFailure counts a failed commit as kube-proxy counts a failed restore; a
// partial one is also a partial restore failure (coalesce retries it in full).
func (s *Stage) countFailure(full bool) {
	family := s.family.String()
	s.metrics.RestoreFailures.WithLabelValues(family).Inc()
	if !full {
		s.metrics.PartialRestoreFailures.WithLabelValues(family).Inc()
	}
}

func (s *Stage) record(plan *bus.Plan, full bool, start, now time.Time) {
	began := plan.Started
	if began.IsZero() {
		began = start
	}
	took := now.Sub(began).Seconds()
	family := s.family.String()
	s.metrics.SyncDuration.WithLabelValues(family).Observe(took)
	if full {
		s.metrics.SyncFullDuration.WithLabelValues(family).Observe(took)
	} else {
		s.metrics.SyncPartialDuration.WithLabelValues(family).Observe(took)
	}
	s.metrics.LastSync.WithLabelValues(family).SetToCurrentTime()
	for _, tp := range plan.Tables {
		s.metrics.RulesTotal.WithLabelValues(tp.Table, family).Set(float64(tp.RuleCount))
		s.metrics.RulesLast.WithLabelValues(tp.Table, family).Set(float64(s.written[tp.Table]))
	}
	s.metrics.NoLocalEndpoints.WithLabelValues("internal", family).Set(float64(plan.NoLocalEndpoints.Internal))
	s.metrics.NoLocalEndpoints.WithLabelValues("external", family).Set(float64(plan.NoLocalEndpoints.External))
	s.p.Env.Status.Update(func(r *bus.Report) {
		r.LastSync, r.Generation, r.LastSyncDuration, r.Unserved = now, plan.Generation, now.Sub(began), plan.Unserved
		if full {
			r.LastFullSync = now
		}
	})
	s.log.Debug("committed", "family", s.family, "generation", plan.Generation, "full", full, "took", now.Sub(began))
}

// staleFlows says which UDP front-ends changed since the last commit, if any did.
// The first commit of a process always reports: flows from before it may be stale.
func staleFlows(family bus.Family, before map[netip.AddrPort][]netip.AddrPort, haveBefore bool, now map[netip.AddrPort][]netip.AddrPort) (bus.StaleFlows, bool) {
	if haveBefore && maps.EqualFunc(before, now, slices.Equal) {
		return bus.StaleFlows{}, false
	}
	gone := map[netip.AddrPort]bool{}
	for k := range before {
		if _, ok := now[k]; !ok {
			gone[k] = true
		}
	}
	return bus.StaleFlows{Family: family, Now: now, Gone: gone}, true
}
