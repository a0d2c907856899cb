package commit

import (
	"context"

	"github.com/kpipe/kpipe/bus"
)

// unlikeWritten narrows the chains a repair names to those the kernel does not
// hold as kpipe wrote them. The notifications a repair comes from cannot tell
// kpipe's own writes from another writer's (pids and netlink port ids are
// reused by other containers in the host network namespace), so each chain is
// checked instead: its digest in the kernel (one small read by name) against
// the digest it should have, worked out from the rules of the last plan that
// wrote it (ExpectedDigest), or else the one read back after kpipe wrote it.
// A chain kpipe's own write left as written costs that read and nothing more.
// Chains the ledger does not know are not kpipe's to repair and are left out;
// chains in doubt, or that cannot be checked, are kept (rewritten).
func (s *Stage) unlikeWritten(ctx context.Context, named map[string]map[string]bool) map[string]map[string]bool {
	out := map[string]map[string]bool{}
	keep := func(table, chain string) {
		if out[table] == nil {
			out[table] = map[string]bool{}
		}
		out[table][chain] = true
	}
	for table, chains := range named {
		var check []string
		for chain := range chains {
			if _, kpipes := s.ledger.chains[table][chain]; !kpipes {
				continue
			}
			if s.ledger.unsure[key(table, chain)] {
				keep(table, chain)
				continue
			}
			check = append(check, chain)
		}
		if len(check) == 0 {
			continue
		}
		// The kernel is read on this goroutine (a test's network namespace is
		// this thread's) while other goroutines work out what it should hold.
		want := s.plannedDigests(ctx, table, check)
		kernel, err := s.digests(ctx, table, check) // a chain unread is kept
		expected := want()
		if err != nil {
			s.log.Warn("reading the chains a repair names; rewriting them", "family", s.family, "table", table, "chains", len(check), "err", err)
		}
		for _, chain := range check {
			got, there := kernel[chain]
			d, known := expected[chain]
			asWritten := there && (known && got == d || !known && s.ledger.matches(table, chain, got))
			if err != nil || !asWritten {
				keep(table, chain)
			}
		}
	}
	return out
}

// plannedDigests starts working out the digest each of chains of table should
// have as the last plan wrote it (a chain the ledger holds other rules for is
// left out); wait returns those known, by chain.
func (s *Stage) plannedDigests(ctx context.Context, table string, chains []string) (wait func() map[string]uint64) {
	var written []bus.Chain
	if s.last != nil {
		named := make(map[string]bool, len(chains))
		for _, name := range chains {
			named[name] = true
		}
		for _, tp := range s.last.Tables {
			if tp.Table != table {
				continue
			}
			for _, c := range tp.Chains {
				if !named[c.Name] {
					continue
				}
				if differs, _ := s.ledger.differs(table, c); !differs {
					written = append(written, c)
				}
			}
		}
	}
	todo := make([]int, len(written))
	for i := range todo {
		todo[i] = i
	}
	expected := s.expectedDigests(ctx, table, written, todo)
	return func() map[string]uint64 {
		out := make(map[string]uint64, len(written))
		for i, e := range expected() {
			if e.known {
				out[written[i].Name] = e.digest
			}
		}
		return out
	}
}
