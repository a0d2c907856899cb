package commit

import (
	"bytes"
	"hash/fnv"
	"slices"
	"strings"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// tableWrites is what one plan changes in one table.
type tableWrites struct {
	table  string
	write  []bus.Chain // in write order
	delete []string    // per-service chains kpipe wrote and the plan dropped
	stale  []string    // per-service chains in the kernel that a full plan does not have
	same   []sameChain // a full plan's chains the kernel already holds as planned
	fresh  bool        // a full sync found none of kpipe's kinds of chain in the table
	// kernelRules are the rules the kernel held, before a full sync, in the
	// filter chains it writes that the ledger does not know: old rules to guard.
	kernelRules map[string]string
}

// sameChain is a chain found in the kernel as planned, with its digest there.
type sameChain struct {
	bus.Chain
	digest uint64
}

// writes is what one plan changes, per table.
type writes struct{ tables []tableWrites }

func (w writes) of(table string) tableWrites {
	for _, tw := range w.tables {
		if tw.table == table {
			return tw
		}
	}
	return tableWrites{table: table}
}

// block is one "*table ... COMMIT" section: one nf_tables transaction.
type block struct {
	table  string
	write  []bus.Chain
	delete []string
}

// step is one iptables-restore run.
type step struct{ blocks []block }

// op is one chain written or deleted, as the ledger records it.
type op struct {
	table, chain string
	deleted      bool
	hash         uint64
	rules        string
}

func (s step) payload() []byte {
	if len(s.blocks) == 1 { // a large write's steps: not copied again
		return nf.Assemble(s.blocks[0].table, s.blocks[0].write, s.blocks[0].delete)
	}
	var b bytes.Buffer
	for _, bl := range s.blocks {
		b.Write(nf.Assemble(bl.table, bl.write, bl.delete))
	}
	return b.Bytes()
}

func (s step) ops() []op {
	var out []op
	for _, bl := range s.blocks {
		for _, c := range bl.write {
			out = append(out, op{table: bl.table, chain: c.Name, hash: c.Hash, rules: c.Rules})
		}
		for _, c := range bl.delete {
			out = append(out, op{table: bl.table, chain: c, deleted: true})
		}
	}
	return out
}

func (b block) size() int { return len(b.write) + len(b.delete) }

// steps orders a plan's writes into iptables-restore runs so that no packet meets
// a state that neither the old nor the new rules would give it:
//
//  1. The filter chains first get the new REJECT and DROP rules while keeping the
//     old ones ("guards"): a service that lost its endpoints is rejected before
//     its DNAT goes, and a new load balancer's source-range DROP is in place
//     before the KUBE-FW- chain that relies on it. An old guard is harmless while
//     it stays: traffic the nat table DNATs no longer matches it.
//  2. nat: per-service chains in dependency order (each after the chains it
//     jumps to), then the top-level chains that make them reachable, then the
//     chains the plan dropped.
//  3. filter: the final rules, dropping the old guards.
//
// A full sync's stale chains are not among these steps: they are deleted after
// them, best effort (Stage.deleteUnwanted).
//
// A small plan is one run (each table section is its own transaction); a large
// one is split into runs of at most maxChainsPerRestore chains, or
// chainsPerFreshStep into a nat table that has none of kpipe's chains yet.
func (w writes) steps(l *Ledger) []step {
	nat, filter := w.of(nf.TableNAT), w.of(nf.TableFilter)
	size := maxChainsPerRestore
	if nat.fresh {
		size = chainsPerFreshStep
	}
	var guards []bus.Chain
	filterLast := filter.write
	if len(nat.write)+len(nat.delete) > 0 {
		guards, filterLast = guardChains(l, filter)
	}
	services, top := splitChains(nat.write)
	first := block{table: nf.TableFilter, write: guards}
	last := []block{
		{table: nf.TableNAT, write: top, delete: nat.delete},
		{table: nf.TableFilter, write: filterLast, delete: filter.delete},
	}
	var out []step
	if len(guards)+len(nat.write)+len(nat.delete)+len(filter.write)+len(filter.delete) <= size {
		// One run: each table section is still its own transaction, in this order.
		out = append(out, step{blocks: []block{first, {table: nf.TableNAT, write: append(services, top...), delete: nat.delete}, last[1]}})
	} else {
		out = append(out, step{blocks: []block{first}})
		for len(services) > 0 {
			n := min(len(services), size)
			out = append(out, step{blocks: []block{{table: nf.TableNAT, write: services[:n]}}})
			services = services[n:]
		}
		out = append(out, step{blocks: last})
	}
	for i := range out {
		out[i] = out[i].nonEmpty()
	}
	return slices.DeleteFunc(out, func(s step) bool { return len(s.blocks) == 0 })
}

// withoutDeletes is s without its chain deletions, and those deletions by
// table (nil when it has none).
func (s step) withoutDeletes() (step, map[string][]string) {
	var deletes map[string][]string
	out := step{blocks: make([]block, 0, len(s.blocks))}
	for _, b := range s.blocks {
		if len(b.delete) > 0 {
			if deletes == nil {
				deletes = map[string][]string{}
			}
			deletes[b.table] = append(deletes[b.table], b.delete...)
			b.delete = nil
		}
		out.blocks = append(out.blocks, b)
	}
	return out.nonEmpty(), deletes
}

func (s step) nonEmpty() step {
	s.blocks = slices.DeleteFunc(s.blocks, func(b block) bool { return b.size() == 0 })
	return s
}

// guardChains splits the filter chains about to change into what the first pass
// writes (new rules followed by the old ones they drop, or just the new rules
// when none are dropped) and what the last pass still has to write (the chains
// whose first-pass version kept old rules). The old rules are the ledger's, or
// for a chain it does not know, those a full sync found in the kernel.
func guardChains(l *Ledger, filter tableWrites) (first, last []bus.Chain) {
	for _, c := range filter.write {
		old, ok := l.oldRules(nf.TableFilter, c.Name)
		if !ok {
			old, ok = filter.kernelRules[c.Name]
		}
		if !ok {
			last = append(last, c)
			continue
		}
		guarded := withLines(c.Rules, old)
		if len(guarded) == len(c.Rules) {
			first = append(first, c) // nothing old to keep: the final version goes first
			continue
		}
		first = append(first, bus.Chain{Name: c.Name, Rules: guarded, Hash: hashOf(guarded)})
		last = append(last, c)
	}
	return first, last
}

// withLines is rules followed by the lines of more it lacks, each once.
func withLines(rules, more string) string {
	have := map[string]bool{}
	for _, line := range strings.SplitAfter(rules, "\n") {
		have[line] = true
	}
	var b strings.Builder
	b.WriteString(rules)
	for _, line := range strings.SplitAfter(more, "\n") {
		if line != "" && !have[line] {
			have[line] = true
			b.WriteString(line)
		}
	}
	return b.String()
}

func hashOf(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return h.Sum64()
}

// splitChains separates, keeping render's order (each chain after the chains it
// jumps to: see nf.Rank), the chains below the top level from the top-level ones.
func splitChains(chains []bus.Chain) (services, top []bus.Chain) {
	for _, c := range chains {
		if nf.KindOf(c.Name) == nf.KindTop {
			top = append(top, c)
		} else {
			services = append(services, c)
		}
	}
	return services, top
}

// sortForDelete orders chains so that a chain is deleted before (or with) the
// chains it jumps to.
func sortForDelete(chains []string) {
	slices.SortFunc(chains, func(a, b string) int {
		if d := nf.Rank(b) - nf.Rank(a); d != 0 {
			return d
		}
		return strings.Compare(a, b)
	})
}
