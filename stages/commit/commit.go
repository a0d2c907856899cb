// Package commit is the only writer of netfilter rules: it compares each of
// render's plans with what its Ledger says the kernel holds, writes what differs
// with iptables-restore, and reports each result to coalesce.
package commit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
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

// maxChainsPerRestore bounds how many chains one iptables-restore rewrites. With
// --noflush on iptables-nft the cost grows with the square of that count: a
// 10k-service full sync (20k chains) takes about 53 s as one restore and about 7 s
// in batches of 5000 (see BenchmarkRestore).
const maxChainsPerRestore = 4000

// chainsPerFreshStep is the step of a large write into a nat table that holds
// none of kpipe's (or kube-proxy's) chains, a node's first sync: nothing the
// kernel validates on each transaction is reachable yet, so smaller steps cost
// no walk, and they are faster with either writer and hold less memory
// (BenchmarkCommit full-into-empty at 10k, netlink: steps of 4000 5.5 s and
// 86 MiB held, 1000 3.4-4.0 s and 26-29 MiB, 500 3.1-3.5 s and 17-20 MiB;
// iptables-restore: 4000 20-25 s, 1000 9 s). Over reachable chains each
// transaction pays the kernel's walk of them (~250 ms at 10k), and the larger
// step is faster (a full write over itself: 5.1 s in steps of 4000, 8.2 s in
// steps of 1000).
const chainsPerFreshStep = 500

// apply brings the kernel to the plan. It writes the chains that differ from the
// ledger (every chain, for a full sync), and for a full or periodic sync checks
// the top-level and bucket chains and the jumps into them. Then it deletes the
// per-service chains the plan no longer has (for a full sync: every such chain
// in the kernel), best effort: a chain the kernel will not delete holds up
// nothing else (deleteUnwanted).
func (s *Stage) apply(ctx context.Context, plan *bus.Plan) error {
	full := s.writtenFull(plan)
	var w writes
	for _, tp := range plan.Tables {
		tw, err := s.changes(ctx, tp, full, plan.Refresh)
		if err != nil {
			return err
		}
		w.tables = append(w.tables, tw)
	}
	steps := w.steps(s.ledger)
	if full {
		s.ledger.reset()
		for _, tw := range w.tables {
			for _, c := range tw.same {
				s.ledger.confirm(op{table: tw.table, chain: c.Name, hash: c.Hash, rules: c.Rules})
				s.ledger.sawKernel(tw.table, c.Name, c.digest)
			}
		}
	}
	deferred := map[string][]string{} // deletions a step could not make, by table
	next, stop := s.prepareAhead(steps)
	defer stop()
	for i, step := range steps {
		err := s.restore(ctx, step, next())
		if err != nil && ctx.Err() == nil {
			err = s.restoreWithoutDeletes(ctx, step, err, deferred)
		}
		if err != nil {
			// Whatever failed, a jump someone deleted meanwhile comes back.
			s.ensureJumps(ctx)
			return fmt.Errorf("commit generation %d (restore %d): %w", plan.Generation, i+1, err)
		}
	}
	if full || plan.Refresh {
		if err := s.kernel.EnsureJumps(ctx, nf.Jumps(s.localnetFirewall)); err != nil {
			return err
		}
	}
	if full {
		if s.localnetFirewall {
			// Only now that the KUBE-FIREWALL rule guards 127.0.0.0/8 (CVE-2020-8558).
			if err := s.kernel.WriteSysctl("net/ipv4/conf/all/route_localnet", "1"); err != nil {
				s.log.Error("NodePorts on 127.0.0.1 will not work", "err", err)
			}
		}
	}
	s.deleteUnwanted(ctx, w, deferred, full, plan)
	if err := ctx.Err(); err != nil {
		// Killed while deleting: a full sync whose stale chains were not all
		// deleted is not done. It is neither answered as if it were (the
		// restarted commit is sent it again) nor taken for done by the ledger
		// (the next plan, whatever it asks, is written as a full sync).
		return err
	}
	if full {
		s.ledger.synced = true
	}
	s.written = w.rulesWritten()
	return nil
}

// restoreWithoutDeletes runs again, without its chain deletions, a step the
// kernel refused (with failed): a chain the plan dropped may still be in use
// (another agent's rule jumps to it), which must not hold up the rest. The
// deletions are added to deferred, for deleteUnwanted. failed is kept when
// the step had nothing to delete.
func (s *Stage) restoreWithoutDeletes(ctx context.Context, st step, failed error, deferred map[string][]string) error {
	rest, deletes := st.withoutDeletes()
	if deletes == nil {
		return failed
	}
	if len(rest.blocks) > 0 {
		if err := s.restore(ctx, rest, s.kernel.Prepare(rest.payload())); err != nil {
			return err
		}
	}
	for table, chains := range deletes {
		deferred[table] = append(deferred[table], chains...)
	}
	return nil
}

// ensureJumps puts back any missing jump, best effort, after a failed write.
func (s *Stage) ensureJumps(ctx context.Context) {
	if ctx.Err() != nil {
		return
	}
	if err := s.kernel.EnsureJumps(ctx, nf.Jumps(s.localnetFirewall)); err != nil {
		s.log.Warn("putting kpipe's missing jumps back after a failed write", "family", s.family, "err", err)
	}
}

// deleteUnwanted deletes, after everything else is written, the chains that
// go: those a step could not delete (deferred), a full sync's stale chains,
// and at a full or periodic sync the stuck ones the plan does not have. None
// of it fails the commit: a chain the kernel will not delete is emptied and
// left (deleteOrEmpty).
func (s *Stage) deleteUnwanted(ctx context.Context, w writes, deferred map[string][]string, full bool, plan *bus.Plan) {
	for _, tw := range w.tables {
		del := deferred[tw.table]
		switch {
		case full:
			s.ledger.keepStuck(tw.table, tw.stale)
			del = append(del, tw.stale...)
		case plan.Refresh:
			wanted := planned(*plan.Table(tw.table))
			for _, c := range s.ledger.stuckIn(tw.table) {
				if !wanted[c] {
					del = append(del, c)
				}
			}
		}
		sortForDelete(del)
		for len(del) > 0 && ctx.Err() == nil {
			n := min(len(del), maxChainsPerRestore)
			if err := s.deleteOrEmpty(ctx, tw.table, del[:n]); err != nil {
				s.log.Warn("deleting chains kpipe no longer wants; they stay in doubt", "family", s.family, "table", tw.table, "err", err)
				break
			}
			del = del[n:]
		}
	}
	s.metrics.UndeletableChains.WithLabelValues(s.family.String()).Set(float64(len(s.ledger.stuck)))
}

// deleteOrEmpty deletes chains (in delete order) in one transaction. When the
// kernel refuses, it tries each half in turn, down to the single chains it
// will not delete (another agent's rule still jumps to them, EBUSY): each is
// emptied, so that the chains it jumped to can go and nothing it sent to a gone
// service's endpoints stays, recorded as stuck and logged once. An error only
// when even emptying a chain fails: the kernel refuses everything.
func (s *Stage) deleteOrEmpty(ctx context.Context, table string, chains []string) error {
	del := step{blocks: []block{{table: table, delete: chains}}}
	err := s.restore(ctx, del, s.kernel.Prepare(del.payload()))
	if err == nil || ctx.Err() != nil {
		return nil
	}
	if len(chains) > 1 {
		half := len(chains) / 2
		if err := s.deleteOrEmpty(ctx, table, chains[:half]); err != nil {
			return err
		}
		return s.deleteOrEmpty(ctx, table, chains[half:])
	}
	chain := chains[0]
	if s.ledger.stuck[key(table, chain)] {
		return nil // emptied when it first would not go
	}
	empty := step{blocks: []block{{table: table, write: []bus.Chain{{Name: chain, Hash: hashOf("")}}}}}
	if emptyErr := s.restore(ctx, empty, s.kernel.Prepare(empty.payload())); emptyErr != nil {
		return fmt.Errorf("delete %s/%s: %v; empty it: %w", table, chain, err, emptyErr)
	}
	if s.ledger.stick(table, chain) {
		s.log.Warn("a chain kpipe no longer wants is still in use (another agent's rule jumps to it): emptied and left, tried again at each periodic sync",
			"family", s.family, "table", table, "chain", chain, "err", err)
	}
	return nil
}

// countFailure counts a failed commit as kube-proxy counts a failed restore; a
// partial one is also a partial restore failure (coalesce retries it in full).
func (s *Stage) countFailure(full bool) {
	family := s.family.String()
	s.metrics.RestoreFailures.WithLabelValues(family).Inc()
	if !full {
		s.metrics.PartialRestoreFailures.WithLabelValues(family).Inc()
	}
}

// changes works out what to write and delete in one table.
func (s *Stage) changes(ctx context.Context, tp bus.TablePayload, full, refresh bool) (tableWrites, error) {
	tw := tableWrites{table: tp.Table}
	if full {
		wanted := planned(tp)
		kernel, err := s.kernel.ChainNames(ctx, tp.Table)
		if err != nil {
			return tw, err
		}
		tw.write, tw.same = s.unchanged(ctx, tp.Table, tp.Chains, kernel)
		if tp.Table == nf.TableFilter {
			tw.kernelRules = s.kernelRules(ctx, tw.write)
		}
		tw.fresh = true
		for _, name := range kernel {
			kind := nf.KindOf(name)
			if kind.Disposable() && !wanted[name] {
				tw.stale = append(tw.stale, name)
			}
			if kind != nf.KindOther {
				tw.fresh = false
			}
		}
		return tw, nil
	}
	var unchecked []bus.Chain
	known := 0
	// A plan that has a chain it says it dropped is not taken at its word.
	dropped := make(map[string]bool, len(tp.Dropped))
	for _, name := range tp.Dropped {
		dropped[name] = true
	}
	trustDropped := true
	for _, c := range tp.Chains {
		differs, ok := s.ledger.differs(tp.Table, c)
		if ok {
			known++
		}
		if len(dropped) > 0 && dropped[c.Name] {
			trustDropped = false
		}
		if differs {
			tw.write = append(tw.write, c)
		} else if refresh && nf.KindOf(c.Name).Checked() {
			unchecked = append(unchecked, c)
		}
	}
	var ok bool
	if tw.delete, ok = s.ledger.droppedOnly(tp, known); !ok || !trustDropped {
		tw.delete = s.ledger.unwanted(tp.Table, planned(tp))
	}
	if len(unchecked) > 0 {
		drifted, err := s.drifted(ctx, tp.Table, unchecked)
		if err != nil {
			return tw, err
		}
		if len(drifted) > 0 {
			s.log.Info("repairing chains changed behind kpipe's back", "family", s.family, "table", tp.Table, "chains", len(drifted))
		}
		tw.write = mergeInOrder(tp.Chains, tw.write, drifted)
	}
	return tw, nil
}

// kernelRules reads, for a full sync, the rules the kernel holds in the filter
// chains about to be written whose rules the ledger does not know (a new
// process: a start, a reload, a takeover), so that the first pass keeps them
// as guards as it keeps the rules the ledger knows (see writes.steps). These
// are kpipe's (or kube-proxy's) own few top-level filter chains; nothing else
// is read. A chain that cannot be read is written without its old rules.
func (s *Stage) kernelRules(ctx context.Context, chains []bus.Chain) map[string]string {
	out := map[string]string{}
	for _, c := range chains {
		if _, known := s.ledger.oldRules(nf.TableFilter, c.Name); known {
			continue
		}
		rules, err := s.kernel.ListChain(ctx, nf.TableFilter, c.Name)
		if err != nil {
			if !errors.Is(err, nf.ErrNoChain) {
				s.log.Warn("reading a filter chain to keep its rules until nat has moved; writing it without them", "family", s.family, "chain", c.Name, "err", err)
			}
			continue
		}
		var b strings.Builder
		for _, r := range rules {
			b.WriteString(r + "\n")
		}
		out[c.Name] = b.String()
	}
	return out
}

// planned is the set of the table's chains in the plan.
func planned(tp bus.TablePayload) map[string]bool {
	wanted := make(map[string]bool, len(tp.Chains))
	for _, c := range tp.Chains {
		wanted[c.Name] = true
	}
	return wanted
}

// unchanged splits a full sync's chains into those to write and those the
// kernel already holds exactly as planned: their digests, read from the
// kernel, are the ones their rules give. So a restarted kpipe (or one taking
// over from kube-proxy) rewrites only what is not right, chain by chain. When
// the kernel cannot be read, everything is written.
func (s *Stage) unchanged(ctx context.Context, table string, chains []bus.Chain, kernel []string) (write []bus.Chain, same []sameChain) {
	if _, known := s.kernel.ExpectedDigest(ctx, table, ""); !known {
		return chains, nil // the legacy backend: nothing to compare with, so no read
	}
	have := make(map[string]bool, len(kernel))
	for _, name := range kernel {
		have[name] = true
	}
	var inKernel []int // the chains' indexes
	var names []string
	for i, c := range chains {
		if have[c.Name] {
			inKernel = append(inKernel, i)
			names = append(names, c.Name)
		}
	}
	if len(names) == 0 {
		return chains, nil
	}
	// The kernel is read on this goroutine (a test's network namespace is
	// this thread's) while other goroutines work out what it should hold.
	expected := s.expectedDigests(ctx, table, chains, inKernel)
	digests, err := s.digests(ctx, table, names)
	want := expected()
	if err != nil {
		s.log.Warn("reading the kernel's chains before a full sync; writing them all", "family", s.family, "table", table, "err", err)
		return chains, nil
	}
	for i, c := range chains {
		if got, ok := digests[c.Name]; ok && want[i].known && want[i].digest == got {
			same = append(same, sameChain{c, got})
			continue
		}
		write = append(write, c)
	}
	return write, same
}

type expectedDigest struct {
	digest uint64
	known  bool
}

// expectedDigests starts working out, on every core, the digest the chains at
// indexes todo should have in the kernel; wait returns them, by the chains'
// index. (Nothing here reads the kernel.)
func (s *Stage) expectedDigests(ctx context.Context, table string, chains []bus.Chain, todo []int) (wait func() []expectedDigest) {
	out := make([]expectedDigest, len(chains))
	workers := runtime.GOMAXPROCS(0)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for j := w; j < len(todo); j += workers {
				d, ok := s.kernel.ExpectedDigest(ctx, table, chains[todo[j]].Rules)
				out[todo[j]] = expectedDigest{d, ok}
			}
		})
	}
	return func() []expectedDigest { wg.Wait(); return out }
}

// mergeInOrder returns the chains of all that are in a or b, in all's order.
func mergeInOrder(all, a, b []bus.Chain) []bus.Chain {
	in := make(map[string]bool, len(a)+len(b))
	for _, c := range a {
		in[c.Name] = true
	}
	for _, c := range b {
		in[c.Name] = true
	}
	out := make([]bus.Chain, 0, len(in))
	for _, c := range all {
		if in[c.Name] {
			out = append(out, c)
		}
	}
	return out
}

// drifted returns the chains whose kernel listing is not what kpipe last read
// back after writing them: someone deleted, added or changed a rule by hand.
func (s *Stage) drifted(ctx context.Context, table string, chains []bus.Chain) ([]bus.Chain, error) {
	names := make([]string, len(chains))
	for i, c := range chains {
		names[i] = c.Name
	}
	kernel, err := s.digests(ctx, table, names)
	if err != nil {
		return nil, err
	}
	var out []bus.Chain
	for _, c := range chains {
		digest, ok := kernel[c.Name]
		if !ok || !s.ledger.matches(table, c.Name, digest) {
			out = append(out, c)
		}
	}
	return out, nil
}

// digests reads the kernel's digests of the chains of table named. A chain it
// could not read while another writer kept changing the ruleset (nf.ErrBusy)
// is left out, as one that differs: the caller writes it (or does not record
// it), which is all it costs; neither the commit fails nor is everything
// written.
func (s *Stage) digests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	d, err := s.kernel.Digests(ctx, table, names)
	if errors.Is(err, nf.ErrBusy) {
		s.log.Info("chains unread while another writer kept changing the ruleset; taken as changed", "family", s.family, "table", table, "err", err)
		return d, nil
	}
	return d, err
}

// learn records what the checked chains a step just wrote look like in the
// kernel, so that the next periodic sync can tell whether someone changed them
// since. Where the digest of a chain's rules is known without reading it
// (nf_tables), that is what is recorded: a change another agent makes at any
// time after the step is then seen. Else (legacy) the chains are read back
// right after their step, and a change made between the step and that read
// is taken for kpipe's. A failed read only costs a rewrite then.
func (s *Stage) learn(ctx context.Context, st step) {
	for _, b := range st.blocks {
		var read []string
		for _, c := range b.write {
			if !nf.KindOf(c.Name).Checked() {
				continue
			}
			if digest, known := s.kernel.ExpectedDigest(ctx, b.table, c.Rules); known {
				s.ledger.sawKernel(b.table, c.Name, digest)
			} else {
				read = append(read, c.Name)
			}
		}
		if len(read) == 0 {
			continue
		}
		kernel, err := s.digests(ctx, b.table, read)
		if err != nil {
			s.log.Warn("reading back written chains", "family", s.family, "table", b.table, "err", err)
			continue
		}
		for _, name := range read {
			if digest, ok := kernel[name]; ok {
				s.ledger.sawKernel(b.table, name, digest)
			}
		}
	}
}

// prepareAhead prepares the steps in order, one ahead of the writes, on
// another goroutine: a step's payload and its translation are CPU work that
// overlaps the kernel's taking the step before. next returns the next step's
// write; stop ends the preparing early. A single step is prepared by next.
// The hand-off is unbuffered: a prepared step is tens of MB at 10k services
// (its netlink messages are four times its text), and a buffer would hold a
// third one while the next is prepared.
func (s *Stage) prepareAhead(steps []step) (next func() func(context.Context) error, stop func()) {
	if len(steps) <= 1 { // next is called at most once
		return func() func(context.Context) error { return s.kernel.Prepare(steps[0].payload()) }, func() {}
	}
	ready := make(chan func(context.Context) error)
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for _, st := range steps {
			select {
			case ready <- s.kernel.Prepare(st.payload()):
			case <-quit:
				return
			}
		}
	})
	return func() func(context.Context) error { return <-ready }, func() { close(quit); wg.Wait() }
}

// restore runs one step with its prepared write. The ledger holds its chains
// in doubt until the kernel confirms the write: a commit killed half-way
// leaves them to be rewritten.
func (s *Stage) restore(ctx context.Context, st step, write func(context.Context) error) error {
	for _, op := range st.ops() {
		s.ledger.doubt(op)
	}
	if err := write(ctx); err != nil {
		return err
	}
	for _, op := range st.ops() {
		s.ledger.confirm(op)
	}
	s.learn(ctx, st)
	return nil
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
		r.LastSync, r.Generation = now, plan.Generation
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

// rulesWritten counts the rules each table's write carried, for
// kubeproxy_sync_proxy_rules_iptables_last.
func (w writes) rulesWritten() map[string]int {
	n := make(map[string]int, len(w.tables))
	for _, tw := range w.tables {
		n[tw.table] = 0
		for _, c := range tw.write {
			n[tw.table] += ruleCount(c.Rules)
		}
	}
	return n
}

// ruleCount counts the "-A CHAIN ..." lines of a chain's rules.
func ruleCount(rules string) int {
	n := 0
	for line := range strings.Lines(rules) {
		if strings.HasPrefix(line, "-A ") {
			n++
		}
	}
	return n
}
