// Package tracer follows the first packet of a new connection through the rules
// of a render plan, as the kernel would: nat PREROUTING or OUTPUT, the routing
// decision, filter INPUT, FORWARD or OUTPUT, nat POSTROUTING. It knows exactly
// the matches and targets kpipe writes (stages/render/rules.go) and the jumps
// commit puts in the built-in chains (netfilter.Jumps); anything else is an
// error, never a guess.
//
// A rule with -m statistic forks the walk: one path takes it, one does not, so
// a trace covers every endpoint a service may pick. Session affinity is traced
// as a client seen for the first time: --rcheck and --update do not match,
// --set does.
//
// The built-in chains hold only kpipe's jumps, in the order EnsureJumps leaves
// them on a node that had none (each one inserted first, so the last of
// netfilter.Jumps is first), and their policy is ACCEPT.
package tracer

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Where a packet enters the node's netfilter hooks.
const (
	FromPrerouting = "prerouting" // routed in: from another host or from a pod
	FromOutput     = "output"     // sent by a process on the node
)

// Verdicts.
const (
	Accept = "ACCEPT"
	Drop   = "DROP"
	Reject = "REJECT"
	// Error is the verdict of a trace that failed (see Result.Err).
	Error = "ERROR"
)

// Packet is the first packet of a new connection.
type Packet struct {
	Source, Dest netip.Addr
	Proto        string // "tcp", "udp", "sctp"
	DPort        int
	// From is where it enters: FromPrerouting or FromOutput.
	From string
	// InInterface is the interface it arrives on, for -i matches ("cbr0",
	// "veth1234"); empty for FromOutput, where "-i X" never matches.
	InInterface string
}

// Path is one way through the rules (the statistic matches taken or not).
type Path struct {
	// Endpoint is where DNAT sent the packet; invalid when it was not DNATed.
	Endpoint netip.AddrPort
	// Masqueraded: the packet leaves through nat POSTROUTING and KUBE-POSTROUTING
	// MASQUERADEs it (KUBE-MARK-MASQ set the mark KUBE-POSTROUTING tests). A
	// packet delivered to this host (filter INPUT only) never is.
	Masqueraded bool
	// Verdict is ACCEPT, DROP or REJECT.
	Verdict string
	// Affinity lists the xt_recent lists the packet was recorded in (--set):
	// where session affinity will send the client's next connection.
	Affinity []string
	// Steps are the rules that matched, and the built-in chains entered.
	Steps []Step
	// Probability is the chance a new connection takes this path (the
	// statistic matches it took or passed); the paths' sum is 1.
	Probability float64
	// Unevaluated are the rules of other agents this path passed without
	// knowing whether they match ("table/CHAIN: rule (why)"): the trace
	// assumed they do not.
	Unevaluated []string
}

// Step is one entry of a path: a rule that matched, or the packet entering a
// built-in chain or meeting its policy (Rule empty, Comment says which).
type Step struct {
	Table string `json:"table"`
	Chain string `json:"chain"`
	Rule  string `json:"rule,omitempty"`
	// Comment is the rule's -m comment (kpipe's and kube-proxy's name the
	// Service and port behind the rule); for a step with no rule, what
	// happened ("entered", "policy DROP").
	Comment string `json:"comment,omitempty"`
	// Mark is the packet's mark after a -j MARK rule ("0x4000"), "" for any
	// other step.
	Mark string `json:"mark,omitempty"`
}

// Trace lists the path's steps, as "table/CHAIN: rule".
func (p Path) Trace() []string {
	out := make([]string, len(p.Steps))
	for i, s := range p.Steps {
		out[i] = s.String()
	}
	return out
}

func (s Step) String() string {
	if s.Rule == "" {
		return s.Table + "/" + s.Chain + ": (" + s.Comment + ")"
	}
	return s.Table + "/" + s.Chain + ": " + s.Rule
}

// Result is what happens to the packet, over all its paths.
type Result struct {
	// Endpoints are the DNAT targets of every path, sorted, without duplicates;
	// empty when no path DNATs the packet.
	Endpoints []netip.AddrPort
	// Masqueraded: some path leaves the node masqueraded (see Path.Masqueraded;
	// Paths says which).
	Masqueraded bool
	// Verdict is the verdict every path agrees on; when they differ, the
	// distinct verdicts sorted and joined by "|" (such as "ACCEPT|DROP"); Error
	// when the trace failed.
	Verdict string
	Paths   []Path
	// Err says why the trace failed: a rule the tracer does not understand, a
	// jump to a chain the plan does not hold, a packet of the wrong family.
	Err error
}

// Trace is every path's trace, each headed by "path N:", for failure messages.
func (r Result) Trace() []string {
	var out []string
	for i, path := range r.Paths {
		out = append(out, fmt.Sprintf("path %d: %s", i+1, path.Verdict))
		for _, line := range path.Trace() {
			out = append(out, "  "+line)
		}
	}
	return out
}

// String is a one-line summary for failure messages.
func (r Result) String() string {
	if r.Err != nil {
		return "error: " + r.Err.Error()
	}
	return fmt.Sprintf("verdict %s, endpoints %v, masqueraded %v", r.Verdict, r.Endpoints, r.Masqueraded)
}

// Trace follows p through plan, which must be a full plan (every chain). The
// addresses of type LOCAL (addrtype, and the routing decision between INPUT and
// FORWARD) are nodeIPs, localAddrs, 127.0.0.0/8 and ::1.
func Trace(plan *bus.Plan, nodeIPs []netip.Addr, localAddrs []netip.Addr, p Packet) Result {
	t, err := newTracer(plan, append(slices.Clone(nodeIPs), localAddrs...))
	return t.trace(err, p)
}

// TraceRuleset follows p through rules a node holds (its built-in chains as
// they are, other agents' rules included); local are the node's addresses of
// type LOCAL besides loopback. A rule the tracer cannot evaluate (another
// agent's match or target) is taken as not matching, and each path lists the
// ones it passed in Unevaluated: a trace that needed them says so.
func TraceRuleset(rs *nf.Ruleset, local []netip.Addr, p Packet) Result {
	t, err := rulesetTracer(rs, local)
	return t.trace(err, p)
}

func (t *tracer) trace(err error, p Packet) Result {
	if err == nil {
		err = t.check(p)
	}
	if err != nil {
		return Result{Verdict: Error, Err: err}
	}
	paths, err := t.run(p)
	if err != nil {
		return Result{Verdict: Error, Err: err}
	}
	return summarize(paths)
}

func summarize(paths []Path) Result {
	res := Result{Paths: paths}
	var verdicts []string
	for _, path := range paths {
		if path.Endpoint.IsValid() {
			res.Endpoints = append(res.Endpoints, path.Endpoint)
		}
		res.Masqueraded = res.Masqueraded || path.Masqueraded
		verdicts = append(verdicts, path.Verdict)
	}
	slices.SortFunc(res.Endpoints, netip.AddrPort.Compare)
	res.Endpoints = slices.Compact(res.Endpoints)
	slices.Sort(verdicts)
	res.Verdict = strings.Join(slices.Compact(verdicts), "|")
	return res
}

// tracer holds a plan's or a node's parsed rules.
type tracer struct {
	family bus.Family
	local  []netip.Addr
	chains map[string]map[string][]*rule // table -> chain -> rules
	policy map[string]map[string]string  // table -> built-in chain -> DROP (ACCEPT when absent)
	err    error                         // the first failure of the walk
}

func newTracer(plan *bus.Plan, local []netip.Addr) (*tracer, error) {
	if plan == nil {
		return nil, fmt.Errorf("no plan")
	}
	t := &tracer{family: plan.Family, local: local, chains: map[string]map[string][]*rule{}}
	for _, tp := range plan.Tables {
		if tp.Table != nf.TableNAT && tp.Table != nf.TableFilter {
			return nil, fmt.Errorf("plan has table %q", tp.Table)
		}
		chains := map[string][]*rule{}
		for _, c := range tp.Chains {
			if _, dup := chains[c.Name]; dup {
				return nil, fmt.Errorf("%s: chain %s twice", tp.Table, c.Name)
			}
			chains[c.Name] = []*rule{}
			for _, line := range strings.Split(c.Rules, "\n") {
				if line == "" {
					continue
				}
				r, err := parseRule(c.Name, line)
				if err != nil {
					return nil, fmt.Errorf("%s/%s: %w", tp.Table, c.Name, err)
				}
				chains[c.Name] = append(chains[c.Name], r)
			}
		}
		t.chains[tp.Table] = chains
	}
	for _, table := range []string{nf.TableNAT, nf.TableFilter} {
		if t.chains[table] == nil {
			return nil, fmt.Errorf("plan has no %s table", table)
		}
	}
	// commit writes the localnet firewall jumps exactly when render writes the chain.
	_, localnet := t.chains[nf.TableFilter][nf.ChainLocalnetFirewall]
	if err := t.addBuiltins(nf.Jumps(localnet)); err != nil {
		return nil, err
	}
	return t, nil
}

// rulesetTracer reads a node's rules: every rule it cannot evaluate is kept,
// opaque, where it stands.
func rulesetTracer(rs *nf.Ruleset, local []netip.Addr) (*tracer, error) {
	if rs == nil {
		return nil, fmt.Errorf("no rules")
	}
	t := &tracer{family: rs.Family, local: local, chains: map[string]map[string][]*rule{}, policy: map[string]map[string]string{}}
	for table, builtins := range builtinChains {
		tb := rs.Table(table)
		if tb == nil {
			return nil, fmt.Errorf("no %s table", table)
		}
		declared := tb.ByName()
		chains := map[string][]*rule{}
		t.policy[table] = map[string]string{}
		for _, c := range tb.Chains {
			chains[c.Name] = make([]*rule, 0, len(c.Rules))
			for _, line := range c.Rules {
				chains[c.Name] = append(chains[c.Name], parseOrOpaque(c.Name, line, declared))
			}
			t.policy[table][c.Name] = c.Policy
		}
		for _, name := range builtins {
			if chains[name] == nil {
				chains[name] = []*rule{}
			}
		}
		t.chains[table] = chains
	}
	return t, nil
}

// builtinChains are the hooks the tracer walks.
var builtinChains = map[string][]string{
	nf.TableNAT:    {"PREROUTING", "OUTPUT", "POSTROUTING"},
	nf.TableFilter: {"INPUT", "FORWARD", "OUTPUT"},
}

// addBuiltins writes the jumps into the built-in chains as a fresh node has them.
func (t *tracer) addBuiltins(jumps []nf.Jump) error {
	for table, names := range builtinChains {
		for _, name := range names {
			if _, clash := t.chains[table][name]; clash {
				return fmt.Errorf("plan writes the built-in chain %s/%s", table, name)
			}
			t.chains[table][name] = []*rule{}
		}
	}
	for table, chains := range nf.FreshBuiltins(jumps) {
		for chain, lines := range chains {
			if t.chains[table][chain] == nil {
				return fmt.Errorf("jump from %s/%s, a chain the tracer does not walk", table, chain)
			}
			for _, line := range lines {
				r, err := parseRule(chain, line)
				if err != nil {
					return fmt.Errorf("jump %s/%s: %w", table, chain, err)
				}
				t.chains[table][chain] = append(t.chains[table][chain], r)
			}
		}
	}
	return nil
}

func (t *tracer) check(p Packet) error {
	switch {
	case !p.Source.IsValid() || !p.Dest.IsValid():
		return fmt.Errorf("packet needs a source and a destination")
	case bus.FamilyOf(p.Source) != t.family || bus.FamilyOf(p.Dest) != t.family:
		return fmt.Errorf("packet %s -> %s is not of the plan's family %v", p.Source, p.Dest, t.family)
	case p.Proto != "tcp" && p.Proto != "udp" && p.Proto != "sctp":
		return fmt.Errorf("unknown protocol %q", p.Proto)
	case p.DPort < 1 || p.DPort > 65535:
		return fmt.Errorf("bad destination port %d", p.DPort)
	case p.From != FromPrerouting && p.From != FromOutput:
		return fmt.Errorf("unknown entry point %q (want %q or %q)", p.From, FromPrerouting, FromOutput)
	case p.From == FromOutput && p.InInterface != "":
		return fmt.Errorf("a packet from a local process has no input interface")
	}
	return nil
}

// isLocal says whether a is an address of type LOCAL on this node.
func (t *tracer) isLocal(a netip.Addr) bool {
	a = a.Unmap()
	if a.IsLoopback() {
		return true
	}
	return slices.ContainsFunc(t.local, func(l netip.Addr) bool { return l.Unmap() == a })
}

// run walks p through the hooks and returns every path's outcome.
func (t *tracer) run(p Packet) ([]Path, error) {
	proto, _ := nf.ParseProto(p.Proto) // check took only tcp, udp and sctp
	start := &flow{src: p.Source, dst: p.Dest, proto: proto, dport: p.DPort, in: p.InInterface, prob: 1}
	natHook := "PREROUTING"
	if p.From == FromOutput {
		natHook = "OUTPUT"
	}
	var out []Path
	for _, f := range t.hook(nf.TableNAT, natHook, start) {
		for _, f := range t.afterNAT(p.From, f) {
			out = append(out, f.path())
		}
	}
	if t.err != nil {
		return nil, t.err
	}
	return out, nil
}

// afterNAT takes one path from the nat hook it entered to its end.
func (t *tracer) afterNAT(from string, f *flow) []*flow {
	if f.verdict != "" {
		return []*flow{f}
	}
	var hooks []string // filter hooks, then "POSTROUTING" for nat
	switch {
	case from == FromOutput && t.isLocal(f.dst):
		hooks = []string{"OUTPUT", "POSTROUTING", "INPUT"}
	case from == FromOutput:
		hooks = []string{"OUTPUT", "POSTROUTING"}
	case t.isLocal(f.dst):
		hooks = []string{"INPUT"}
	default:
		hooks = []string{"FORWARD", "POSTROUTING"}
	}
	flows := []*flow{f}
	for _, hook := range hooks {
		table := nf.TableFilter
		if hook == "POSTROUTING" {
			table = nf.TableNAT
		}
		var next []*flow
		for _, f := range flows {
			if f.verdict != "" {
				next = append(next, f)
				continue
			}
			next = append(next, t.hook(table, hook, f)...)
		}
		flows = next
	}
	for _, f := range flows {
		if f.verdict == "" {
			f.verdict = Accept // the built-in chains' policy
		}
	}
	return flows
}

// hook runs a built-in chain; a path that ACCEPTs there (or is NATed, which ends
// the nat table for this hook) goes on to the next hook.
func (t *tracer) hook(table, chain string, f *flow) []*flow {
	f = f.with(Step{Table: table, Chain: chain, Comment: "entered"})
	out := t.runChain(table, chain, f, 0)
	for i, f := range out {
		switch {
		case f.verdict == Accept:
			f.verdict = ""
		case f.verdict == "" && t.policy[table][chain] == Drop: // fell off the end
			out[i] = f.with(Step{Table: table, Chain: chain, Comment: "policy DROP"})
			out[i].verdict = Drop
		}
	}
	return out
}
