package tracer

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	nf "github.com/kpipe/kpipe/netfilter"
)

// maxDepth bounds nested jumps: kpipe's deepest path (KUBE-SERVICES, three
// dispatch levels, a service's chains) is far shorter, so more is a loop.
const maxDepth = 16

// flow is the traced packet on one path, with what the rules did to it so far.
// Paths fork at statistic matches; a flow is copied (with) before it changes.
type flow struct {
	src, dst netip.Addr
	proto    uint8
	dport    int
	in       string
	mark     uint32
	dnat     netip.AddrPort
	masq     bool
	recent   []string
	steps    []Step
	skipped  []string // the opaque rules passed, as "table/CHAIN: line (why)"
	prob     float64  // of this path, over the statistic matches taken or not
	verdict  string   // "" while the packet goes on
}

// clone returns a copy of f that can change apart from it.
func (f *flow) clone() *flow {
	c := *f
	c.steps = slices.Clip(f.steps)
	c.recent = slices.Clip(f.recent)
	c.skipped = slices.Clip(f.skipped)
	return &c
}

// with returns a copy of f with step added to its trace.
func (f *flow) with(step Step) *flow {
	c := f.clone()
	c.steps = append(c.steps, step)
	return c
}

func (f *flow) path() Path {
	return Path{Endpoint: f.dnat, Masqueraded: f.masq, Verdict: f.verdict, Affinity: f.recent,
		Steps: f.steps, Probability: f.prob, Unevaluated: f.skipped}
}

// ctStates are the conntrack states of the traced packet (netfilter.Ct*
// bits): the first of its connection, DNATed when nat translated it.
func (f *flow) ctStates() uint16 {
	if f.dnat.IsValid() {
		return nf.CtNew | nf.CtDNAT
	}
	return nf.CtNew
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
	if r.opaque != "" { // taken as not matching, and said so
		g := f.clone()
		g.skipped = append(g.skipped, fmt.Sprintf("%s/%s: %s (%s)", table, r.Chain, r.line, r.opaque))
		return t.runFrom(table, rules, i+1, g, depth)
	}
	var out []*flow // the path that takes r first: endpoints in the chain's order
	pTaken := t.evaluate(r, f)
	if pTaken > 0 {
		g := f.with(Step{Table: table, Chain: r.Chain, Rule: r.line, Comment: r.comment()})
		g.prob = f.prob * pTaken
		for _, m := range r.Matches {
			if m.Kind == nf.MatchRecent && m.Recent == nf.RecentSet {
				g.recent = append(g.recent, m.Text)
			}
		}
		for _, h := range t.apply(table, r, g, depth) {
			if h.verdict != "" || r.Target.Kind == nf.TargetGoto {
				out = append(out, h) // a verdict, or a goto's RETURN to our caller
			} else {
				out = append(out, t.runFrom(table, rules, i+1, h, depth)...)
			}
		}
	}
	if pTaken < 1 {
		g := f
		if pTaken > 0 {
			g = f.clone()
			g.prob = f.prob * (1 - pTaken)
		}
		out = append(out, t.runFrom(table, rules, i+1, g, depth)...)
	}
	return out
}

// returned marks a flow that hit RETURN: it goes back to the caller, not on.
const returned = "RETURN"

// apply runs r's target on a flow that matched r. It returns the flows that go
// on after r (verdict "": a jump came back), that ended, or that hit RETURN
// (verdict "RETURN", which runChain turns back into "" for its caller).
func (t *tracer) apply(table string, r *rule, f *flow, depth int) []*flow {
	switch r.Target.Kind {
	case nf.TargetNone:
		return []*flow{f}
	case nf.TargetAccept, nf.TargetDrop, nf.TargetReject:
		if table == nf.TableNAT {
			t.fail("nat/%s: %s in the nat table: %q", r.Chain, r.Target.Name(), r.line)
			return nil
		}
		f.verdict = r.Target.Name()
		return []*flow{f}
	case nf.TargetReturn:
		f.verdict = returned
		return []*flow{f}
	case nf.TargetDNAT:
		if !t.natHook(table, r) {
			return nil
		}
		to := r.Target.To
		f.dst, f.dport, f.dnat = to.Addr(), int(to.Port()), to
		f.verdict = Accept
		return []*flow{f}
	case nf.TargetMasquerade:
		if !t.natHook(table, r) {
			return nil
		}
		f.masq, f.verdict = true, Accept
		return []*flow{f}
	case nf.TargetMark:
		if r.Target.MarkOp == nf.MarkOr {
			f.mark |= r.Target.Mark
		} else {
			f.mark ^= r.Target.Mark
		}
		f.steps[len(f.steps)-1].Mark = fmt.Sprintf("%#x", f.mark) // f's own copy (with)
		return []*flow{f}
	}
	return t.runChain(table, r.Target.Chain, f, depth+1)
}

func (t *tracer) natHook(table string, r *rule) bool {
	if table != "nat" {
		t.fail("%s/%s: %s outside the nat table: %q", table, r.Chain, r.Target.Name(), r.line)
		return false
	}
	return true
}

// evaluate gives the probability that r matches f: 0 or 1, or a statistic
// match's probability when every other match holds.
func (t *tracer) evaluate(r *rule, f *flow) float64 {
	if !t.header(&r.Rule, f) {
		return 0
	}
	p := 1.0
	for _, m := range r.Matches {
		if m.Kind == nf.MatchStatistic {
			p *= min(max(m.Probability, 0), 1)
			continue
		}
		if !t.test(&m, f) {
			return 0
		}
	}
	return p
}

// header says whether r's ip header part (-s, -d, -i, -p) holds for f.
func (t *tracer) header(r *nf.Rule, f *flow) bool {
	holds := func(a nf.Addr, addr netip.Addr) bool { return !a.Prefix.IsValid() || a.Prefix.Contains(addr) != a.Not }
	return holds(r.Src, f.src) && holds(r.Dst, f.dst) &&
		(r.In.Name == "" || inInterface(r.In.Name, f.in) != r.In.Not) &&
		(r.Proto.Num == 0 || (f.proto == r.Proto.Num) != r.Proto.Not)
}

// inInterface says whether a packet that came in on in matches -i name ("veth+"
// is a prefix); a packet from a local process came in on none.
func inInterface(name, in string) bool {
	if base, wild := strings.CutSuffix(name, "+"); wild {
		return in != "" && strings.HasPrefix(in, base)
	}
	return in != "" && in == name
}

// test says whether m holds for f.
func (t *tracer) test(m *nf.Match, f *flow) bool {
	switch m.Kind {
	case nf.MatchComment, nf.MatchNFAcct: // only a comment, only a counter
		return true
	case nf.MatchPort: // -p, in the header, checked the protocol
		return m.DPort == 0 || f.dport == int(m.DPort)
	case nf.MatchRecent: // a client seen for the first time: only --set matches
		return m.Recent == nf.RecentSet
	case nf.MatchMark:
		return (f.mark&m.Mask == m.Mark) != m.Not
	case nf.MatchConntrack:
		return (f.ctStates()&m.CtStates != 0) != m.Not
	case nf.MatchAddrType:
		return (m.SrcType == 0 || t.isLocal(f.src) != m.NotSrcType) &&
			(m.DstType == 0 || t.isLocal(f.dst) != m.NotDstType)
	}
	t.fail("internal: match kind %d", m.Kind)
	return false
}
