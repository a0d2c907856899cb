package commit

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Planning: what a plan changes in each table, from the ledger or, for a full
// sync, from the kernel's digests.

// changes works out what to write and delete in one table.
func (s *Stage) changes(ctx context.Context, tp bus.TablePayload, full, refresh bool, read *earlyRead) (tableWrites, error) {
	tw := tableWrites{table: tp.Table}
	if full {
		wanted := planned(tp)
		kernel, err := read.chainNames(ctx, s.kernel, tp.Table)
		if err != nil {
			return tw, err
		}
		tw.write, tw.same = s.unchanged(ctx, tp.Table, tp.Chains, kernel, read)
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
// the kernel cannot be read, everything is written. The digests are read now,
// unless read early (see earlyRead).
func (s *Stage) unchanged(ctx context.Context, table string, chains []bus.Chain, kernel []string, read *earlyRead) (write []bus.Chain, same []sameChain) {
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
	var digests map[string]uint64
	var err error
	if t, ok := read.table(table); ok {
		digests, err = s.digestsOf(ctx, t, table, names)
	} else {
		digests, err = s.digests(ctx, table, names)
	}
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
