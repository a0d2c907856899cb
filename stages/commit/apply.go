package commit

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Writing: apply brings the kernel to a plan in steps (their order: writes.go),
// then deletes the chains that go.

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
	var read *earlyRead // what the kernel held, read before this plan came
	if full {
		read = s.takeEarly(ctx)
	} else {
		s.deleteGoneFirst(ctx, plan)
	}
	var w writes
	for _, tp := range plan.Tables {
		tw, err := s.changes(ctx, tp, full, plan.Refresh, read)
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
