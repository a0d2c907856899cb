package commit

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// The removal fast path: an endpoint that went away, or a Service deleted,
// leaves the kernel's rules in a delete-only nf_tables transaction, which the
// kernel does not validate (~10 ms, where a write walks every reachable chain:
// ~250 ms at 10k services), written before the walked write of the rest of the
// plan (the rebalanced probabilities, new endpoints and services). Only rules
// whose going is safe on their own go this way (fastCuts); everything else,
// and the rules left behind, waits for the walked write, after which the kernel
// holds the plan as always.

// RuleDeleter is a Kernel that lists a chain's rules by handle and deletes
// rules by handle (netfilter.Tool: on nf_tables with the netlink writer; else
// both say nf.ErrNoRuleHandles).
type RuleDeleter interface {
	// RuleHandles lists the rules of the chains named (those there, each of
	// one state of it): their handles in order and the chain's digest as
	// Digests gives it.
	RuleHandles(ctx context.Context, table string, chains []string) (map[string]nf.ChainRules, error)
	// DeleteRules deletes the rules named in one transaction, all or none.
	DeleteRules(ctx context.Context, table string, rules []nf.RuleRef) error
}

// cut is the rules of one chain that may leave the kernel ahead of the walked
// write.
type cut struct {
	chain bus.Chain // as the last plan wrote it
	rules []int     // indexes of its rules to delete
	count int       // its rules
}

// deleteGoneFirst takes out of the kernel, in one delete-only transaction,
// the rules of the nat chains that only lose rules safely (fastCuts), before
// apply's walked write. It acts only on the kernel's current rules: a chain
// is cut only when the ledger holds it as the last plan wrote it and the
// kernel's listing, read just before, has that digest; its rules are then
// named by their handles in that listing. The chains cut are in doubt from
// then on, so the walked write rewrites them, and a failure or a kill
// before it is repaired as any write cut short. A failure here is no failure
// of the plan: the walked write does it all, as without the fast path.
func (s *Stage) deleteGoneFirst(ctx context.Context, plan *bus.Plan) {
	d, ok := s.kernel.(RuleDeleter)
	if !ok || s.last == nil || !s.ledger.synced {
		return
	}
	old, now := s.last.Table(nf.TableNAT), plan.Table(nf.TableNAT)
	if old == nil || now == nil {
		return
	}
	cuts := s.asWritten(fastCuts(*old, *now, sameTable(s.last.Table(nf.TableFilter), plan.Table(nf.TableFilter))))
	if len(cuts) == 0 {
		return
	}
	listed, err := d.RuleHandles(ctx, nf.TableNAT, chainNames(cuts))
	if err != nil {
		return
	}
	var refs []nf.RuleRef
	var touched []string
	for _, c := range cuts {
		handles, ok := s.kernelHolds(ctx, listed, c)
		if !ok {
			continue
		}
		for _, i := range c.rules {
			refs = append(refs, nf.RuleRef{Chain: c.chain.Name, Handle: handles[i]})
		}
		touched = append(touched, c.chain.Name)
	}
	if len(refs) == 0 {
		return
	}
	for _, chain := range touched {
		s.ledger.doubt(op{table: nf.TableNAT, chain: chain})
	}
	start := time.Now()
	if err := d.DeleteRules(ctx, nf.TableNAT, refs); err != nil {
		s.log.Info("deleting gone endpoints' rules ahead of the write; the write does it", "family", s.family, "rules", len(refs), "err", err)
		return
	}
	s.metrics.FastDeletedRules.WithLabelValues(s.family.String()).Add(float64(len(refs)))
	s.log.Debug("deleted gone endpoints' rules ahead of the write", "family", s.family, "chains", len(touched), "rules", len(refs), "took", time.Since(start))
}

// asWritten keeps the cuts of chains the ledger holds as the last plan
// wrote them (not in doubt).
func (s *Stage) asWritten(cuts []cut) []cut {
	return slices.DeleteFunc(cuts, func(c cut) bool {
		differs, known := s.ledger.differs(nf.TableNAT, c.chain)
		return differs || !known
	})
}

func chainNames(cuts []cut) []string {
	names := make([]string, len(cuts))
	for i, c := range cuts {
		names[i] = c.chain.Name
	}
	return names
}

// kernelHolds returns the handles of c's rules in the kernel's listing when
// the kernel holds c as the last plan wrote it: the digest its rules give
// (ok false otherwise: the chain is not cut).
func (s *Stage) kernelHolds(ctx context.Context, listed map[string]nf.ChainRules, c cut) (handles []uint64, ok bool) {
	l, there := listed[c.chain.Name]
	if !there || len(l.Handles) != c.count {
		return nil, false
	}
	want, known := s.kernel.ExpectedDigest(ctx, nf.TableNAT, c.chain.Rules)
	return l.Handles, known && l.Digest == want
}

// sameTable says whether two plans hold the same chains in a table.
func sameTable(a, b *bus.TablePayload) bool {
	if a == nil || b == nil {
		return a == b
	}
	if len(a.Chains) != len(b.Chains) {
		return false
	}
	for i := range a.Chains {
		if a.Chains[i].Name != b.Chains[i].Name || a.Chains[i].Hash != b.Chains[i].Hash {
			return false
		}
	}
	return true
}

// fastCuts lists the nat chains of both plans whose going rules may leave the
// kernel on their own, so that no packet meets a state that neither the old
// nor the new rules would give it:
//
//   - a service chain (KUBE-SVC-, KUBE-SVL-) loses the rules that send to an
//     endpoint the new chain no longer has (statistic and affinity rules
//     alike), when its last rule stays: that unconditional rule to a live
//     endpoint keeps taking whatever the rules before it leave, so every new
//     connection is still sent to a live endpoint (some unevenly until the
//     walked write rebalances). A chain whose last rule would go (its last
//     endpoint, or all of them) is left to the walked write.
//   - when the filter table does not change (no REJECT or DROP guard comes
//     for a service that lost its endpoints), a dispatch or top-level chain
//     loses the rules that jump to chains the new plan no longer has (a
//     Service deleted) when its new rules are exactly its old ones without
//     them: it then holds its new rules, and those packets meet what the new
//     rules give them.
//
// Anything not parsed, or of another shape, is left to the walked write.
func fastCuts(old, now bus.TablePayload, servicesMayGo bool) []cut {
	was := make(map[string]bus.Chain, len(old.Chains))
	for _, c := range old.Chains {
		was[c.Name] = c
	}
	var gone map[string]bool // chains the new plan no longer has
	if servicesMayGo {
		gone = make(map[string]bool, len(old.Chains))
		for _, c := range old.Chains {
			gone[c.Name] = true
		}
		for _, c := range now.Chains {
			delete(gone, c.Name)
		}
	}
	var out []cut
	for _, c := range now.Chains {
		before, ok := was[c.Name]
		if !ok || before.Hash == c.Hash {
			continue
		}
		var rules []int
		var count int
		switch nf.KindOf(c.Name) {
		case nf.KindService:
			rules, count = endpointsGone(before.Rules, c.Rules)
		case nf.KindDispatch, nf.KindTop:
			if servicesMayGo {
				rules, count = jumpsToGone(before.Rules, c.Rules, gone)
			}
		}
		if len(rules) > 0 {
			out = append(out, cut{chain: before, rules: rules, count: count})
		}
	}
	return out
}

// endpointsGone lists the rules of a service chain's old rules that send to
// an endpoint its new rules do not have, when its last rule stays: an
// unconditional rule to a live endpoint. count is the old rules' count.
func endpointsGone(old, now string) (cut []int, count int) {
	before, ok := parseRules(ruleLines(old))
	after, ok2 := parseRules(ruleLines(now))
	if !ok || !ok2 || len(before) == 0 {
		return nil, 0
	}
	live := map[string]bool{}
	for _, r := range after {
		if e := endpointOf(r); e != "" {
			live[e] = true
		}
	}
	for i, r := range before {
		if e := endpointOf(r); e != "" && !live[e] {
			cut = append(cut, i)
		}
	}
	tail := before[len(before)-1]
	if len(cut) == 0 || cut[len(cut)-1] == len(before)-1 || !live[endpointOf(tail)] || !unconditional(tail) {
		return nil, 0
	}
	return cut, len(before)
}

// jumpsToGone lists the old rules that jump to a chain that is gone, when the
// new rules are exactly the old ones without them.
func jumpsToGone(old, now string, gone map[string]bool) (cut []int, count int) {
	lines := ruleLines(old)
	before, ok := parseRules(lines)
	if !ok {
		return nil, 0
	}
	var kept []string
	for i, r := range before {
		if gone[r.Target.JumpsTo()] {
			cut = append(cut, i)
			continue
		}
		kept = append(kept, lines[i])
	}
	if len(cut) == 0 || !slices.Equal(kept, ruleLines(now)) {
		return nil, 0
	}
	return cut, len(before)
}

// endpointOf names the endpoint a service chain's rule sends to: its
// KUBE-SEP- chain, or the address of an inline DNAT; "" for any other rule.
func endpointOf(r nf.Rule) string {
	switch {
	case nf.KindOf(r.Target.JumpsTo()) == nf.KindEndpoint:
		return r.Target.Chain
	case r.Target.Kind == nf.TargetDNAT:
		return "DNAT " + r.Target.To.String()
	}
	return ""
}

// unconditional says whether a service chain's rule takes every packet that
// reaches it: no address, interface or mark to match, no statistic, no
// recent check (a --set always matches); its protocol is the chain's.
func unconditional(r nf.Rule) bool {
	if r.Src.Prefix.IsValid() || r.Dst.Prefix.IsValid() || r.In.Name != "" || r.Out.Name != "" || r.Proto.Not {
		return false
	}
	for _, m := range r.Matches {
		switch {
		case m.Kind == nf.MatchComment:
		case m.Kind == nf.MatchPort && m.DPort == 0:
		case m.Kind == nf.MatchRecent && m.Recent == nf.RecentSet:
		default:
			return false
		}
	}
	return true
}

// parseRules parses a chain's "-A" lines (ok false when one does not parse).
func parseRules(lines []string) ([]nf.Rule, bool) {
	out := make([]nf.Rule, 0, len(lines))
	for _, line := range lines {
		r, err := nf.ParseRule(line)
		if err != nil {
			return nil, false
		}
		out = append(out, r)
	}
	return out, true
}

// ruleLines are a chain's "-A" lines, trimmed.
func ruleLines(rules string) []string {
	var out []string
	for line := range strings.Lines(rules) {
		if line = strings.TrimSpace(line); strings.HasPrefix(line, "-A ") {
			out = append(out, line)
		}
	}
	return out
}
