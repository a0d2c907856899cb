package tracer

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// maxDepth bounds nested jumps: kpipe's deepest path (KUBE-SERVICES, three
// dispatch levels, a service's chains) is far shorter, so more is a loop.
const maxDepth = 16

// flow is the traced packet on one path, with what the rules did to it so far.
// Paths fork at statistic matches; a flow is copied (with) before it changes.
type flow struct {
	src, dst netip.Addr
	proto    string
	dport    int
	in       string
	mark     uint32
	dnat     netip.AddrPort
	masq     bool
	recent   []string
	trace    []string
	verdict  string // "" while the packet goes on
}

// with returns a copy of f with line added to its trace.
func (f *flow) with(line string) *flow {
	c := *f
	c.trace = append(slices.Clip(f.trace), line)
	c.recent = slices.Clip(f.recent)
	return &c
}

func (f *flow) path() Path {
	return Path{Endpoint: f.dnat, Masqueraded: f.masq, Verdict: f.verdict, Affinity: f.recent, Trace: f.trace}
}

// ctStates are the conntrack states of the traced packet: the first of its
// connection, DNATed when nat translated it.
func (f *flow) ctStates() []string {
	if f.dnat.IsValid() {
		return []string{"NEW", "DNAT"}
	}
	return []string{"NEW"}
}

// fail records the first error of the trace; the walk stops going deeper.
func (t *tracer) fail(format string, args ...any) {
	if t.err == nil {
		t.err = fmt.Errorf(format, args...)
	}
}

// runChain runs f through chain: it returns the paths that ended with a verdict
// and the ones that come back (verdict "") to the caller, at the chain's end or
// by RETURN.
func (t *tracer) runChain(table, chain string, f *flow, depth int) []*flow {
	rules, ok := t.chains[table][chain]
	if !ok {
		t.fail("%s: jump to chain %s, which the plan does not hold", table, chain)
		return nil
	}
	if depth > maxDepth {
		t.fail("%s: jumps nested deeper than %d at %s: a loop?", table, maxDepth, chain)
		return nil
	}
	out := t.runFrom(table, rules, 0, f, depth)
	for _, h := range out {
		if h.verdict == returned {
			h.verdict = "" // back to the caller
		}
	}
	return out
}

// runFrom runs f through rules[i:].
func (t *tracer) runFrom(table string, rules []*rule, i int, f *flow, depth int) []*flow {
	if t.err != nil {
		return nil
	}
	if i == len(rules) {
		return []*flow{f}
	}
	r := rules[i]
	var out []*flow
	taken, notTaken := t.evaluate(r, f)
	if notTaken {
		out = append(out, t.runFrom(table, rules, i+1, f, depth)...)
	}
	if taken {
		g := f.with(table + "/" + r.chain + ": " + r.line)
		for _, m := range r.matches {
			if m.kind == matchRecentSet {
				g.recent = append(g.recent, m.recent)
			}
		}
		for _, h := range t.apply(table, r, g, depth) {
			if h.verdict != "" || r.goTo {
				out = append(out, h) // a verdict, or a goto's RETURN to our caller
			} else {
				out = append(out, t.runFrom(table, rules, i+1, h, depth)...)
			}
		}
	}
	return out
}

// returned marks a flow that hit RETURN: it goes back to the caller, not on.
const returned = "RETURN"

// apply runs r's target on a flow that matched r. It returns the flows that go
// on after r (verdict "": a jump came back), that ended, or that hit RETURN
// (verdict "RETURN", which runChain turns back into "" for its caller).
func (t *tracer) apply(table string, r *rule, f *flow, depth int) []*flow {
	switch r.target {
	case "":
		return []*flow{f}
	case "ACCEPT", "DROP", "REJECT":
		if table == "nat" {
			t.fail("nat/%s: %s in the nat table: %q", r.chain, r.target, r.line)
			return nil
		}
		f.verdict = r.target
		return []*flow{f}
	case "RETURN":
		f.verdict = returned
		return []*flow{f}
	case "DNAT":
		if !t.natHook(table, r) {
			return nil
		}
		f.dst, f.dport, f.dnat = r.dnat.Addr(), int(r.dnat.Port()), r.dnat
		f.verdict = Accept
		return []*flow{f}
	case "MASQUERADE":
		if !t.natHook(table, r) {
			return nil
		}
		f.masq, f.verdict = true, Accept
		return []*flow{f}
	case "MARK":
		if r.markOp == "or" {
			f.mark |= r.markVal
		} else {
			f.mark ^= r.markVal
		}
		return []*flow{f}
	}
	return t.runChain(table, r.target, f, depth+1)
}

func (t *tracer) natHook(table string, r *rule) bool {
	if table != "nat" {
		t.fail("%s/%s: %s outside the nat table: %q", table, r.chain, r.target, r.line)
		return false
	}
	return true
}

// evaluate says whether r may match f (taken) and whether it may not
// (notTaken); both only for a statistic match with a probability strictly
// between 0 and 1.
func (t *tracer) evaluate(r *rule, f *flow) (taken, notTaken bool) {
	taken, notTaken = true, false
	for _, m := range r.matches {
		if m.kind == matchStatistic {
			switch {
			case m.prob <= 0:
				return false, true
			case m.prob < 1:
				notTaken = true
			}
			continue
		}
		if t.test(m, f) == m.neg {
			return false, true
		}
	}
	return taken, notTaken
}

// test says whether m (without its "!") holds for f.
func (t *tracer) test(m match, f *flow) bool {
	switch m.kind {
	case matchSource:
		return m.prefix.Contains(f.src)
	case matchDest:
		return m.prefix.Contains(f.dst)
	case matchInInterface:
		if base, wild := strings.CutSuffix(m.iface, "+"); wild {
			return f.in != "" && strings.HasPrefix(f.in, base)
		}
		return f.in != "" && f.in == m.iface
	case matchProto:
		return f.proto == m.proto
	case matchDPort:
		return f.dport == m.port
	case matchDstLocal:
		return t.isLocal(f.dst)
	case matchSrcLocal:
		return t.isLocal(f.src)
	case matchRecentCheck:
		return false
	case matchRecentSet:
		return true
	case matchMark:
		return f.mark&m.mask == m.mark
	case matchCtState:
		return slices.ContainsFunc(m.states, func(s string) bool { return slices.Contains(f.ctStates(), s) })
	}
	t.fail("internal: match kind %d", m.kind)
	return false
}
