package netfilter

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Jump is a rule in a built-in chain that sends traffic into a kpipe chain.
type Jump struct {
	Table, From, To, Comment string
	Match                    []string
}

// Jumps are kube-proxy's jump rules, in the order kube-proxy ensures them.
func Jumps(localnetFirewall bool) []Jump {
	ctNew := []string{"-m", "conntrack", "--ctstate", "NEW"}
	js := []Jump{
		{TableFilter, "INPUT", ChainExternalServices, "kubernetes externally-visible service portals", ctNew},
		{TableFilter, "FORWARD", ChainExternalServices, "kubernetes externally-visible service portals", ctNew},
		{TableFilter, "INPUT", ChainNodePorts, "kubernetes health check service ports", nil},
		{TableFilter, "FORWARD", ChainServices, "kubernetes service portals", ctNew},
		{TableFilter, "OUTPUT", ChainServices, "kubernetes service portals", ctNew},
		{TableFilter, "FORWARD", ChainForward, "kubernetes forwarding rules", nil},
		{TableFilter, "INPUT", ChainProxyFirewall, "kubernetes load balancer firewall", ctNew},
		{TableFilter, "OUTPUT", ChainProxyFirewall, "kubernetes load balancer firewall", ctNew},
		{TableFilter, "FORWARD", ChainProxyFirewall, "kubernetes load balancer firewall", ctNew},
		{TableNAT, "OUTPUT", ChainServices, "kubernetes service portals", nil},
		{TableNAT, "PREROUTING", ChainServices, "kubernetes service portals", nil},
		{TableNAT, "POSTROUTING", ChainPostrouting, "kubernetes postrouting rules", nil},
	}
	if localnetFirewall {
		js = append(js,
			Jump{TableFilter, "INPUT", ChainLocalnetFirewall, "", nil},
			Jump{TableFilter, "OUTPUT", ChainLocalnetFirewall, "", nil})
	}
	return js
}

// spec is the rule of j, without the chain it is in.
func (j Jump) spec() []string {
	spec := append([]string{}, j.Match...)
	if j.Comment != "" {
		spec = append(spec, "-m", "comment", "--comment", j.Comment)
	}
	return append(spec, "-j", j.To)
}

// Line is j as iptables-save prints it: "-A FROM [matches] -m comment
// --comment "..." -j TO".
func (j Jump) Line() string {
	words := append([]string{"-A", j.From}, j.Match...)
	if j.Comment != "" {
		words = append(words, "-m", "comment", "--comment", strconv.Quote(j.Comment))
	}
	return strings.Join(append(words, "-j", j.To), " ")
}

// FreshBuiltins are the rules js leave in the built-in chains of a node that
// had none, by table and chain: EnsureJumps inserts each one first, so the
// last of js ends up first.
func FreshBuiltins(js []Jump) map[string]map[string][]string {
	out := map[string]map[string][]string{}
	for _, j := range js {
		if out[j.Table] == nil {
			out[j.Table] = map[string][]string{}
		}
		out[j.Table][j.From] = append([]string{j.Line()}, out[j.Table][j.From]...)
	}
	return out
}

// EnsureJumps makes sure every jump is in its built-in chain, inserting a missing
// one first (as kube-proxy does). A jump that is there stays where it is, behind
// whatever another agent put in front of it: moving it would reorder that
// agent's rules, and an agent that keeps its own hook first (a CNI's policy
// chain, Docker's DOCKER-USER) would be bypassed until it moved back, each
// rewriting the other for ever. It reads each built-in chain once with -S, which
// is cheap, and only creates chains and inserts rules for what is missing: a
// check with -C loads the whole table, which takes ~0.2 s at 10k services.
func (t Tool) EnsureJumps(ctx context.Context, js []Jump) error {
	listed := map[string][]string{}
	missing := map[string][]Jump{} // by table, in js's order
	var tables []string
	for _, j := range js {
		key := j.Table + "/" + j.From
		rules, ok := listed[key]
		if !ok {
			var err error
			if rules, err = t.ListChain(ctx, j.Table, j.From); err != nil {
				return fmt.Errorf("list %s: %w", key, err)
			}
			listed[key] = rules
		}
		if jumpPresent(rules, j) {
			continue
		}
		if err := t.ensureChain(ctx, j.Table, j.To); err != nil {
			return err
		}
		if missing[j.Table] == nil {
			tables = append(tables, j.Table)
		}
		missing[j.Table] = append(missing[j.Table], j)
	}
	for _, table := range tables {
		if err := t.insertJumps(ctx, table, missing[table]); err != nil {
			return err
		}
	}
	return nil
}

// insertJumps inserts js (all of table) at the top of their chains, in turn,
// in one iptables-restore: each iptables -I reads the whole table first, 0.1 to
// 0.3 s at 10k services, and a first sync inserts a dozen jumps.
func (t Tool) insertJumps(ctx context.Context, table string, js []Jump) error {
	var b strings.Builder
	b.WriteString("*" + table + "\n")
	for _, j := range js {
		b.WriteString("-I " + j.From + " 1")
		for _, arg := range j.spec() {
			if strings.ContainsAny(arg, " \"") {
				arg = strconv.Quote(arg)
			}
			b.WriteString(" " + arg)
		}
		b.WriteString("\n")
	}
	b.WriteString("COMMIT\n")
	if err := t.restoreTool(ctx, []byte(b.String())); err != nil {
		return fmt.Errorf("ensure jumps in %s: %w", table, err)
	}
	return nil
}

// jumpPresent says whether a listed chain (iptables -S lines) has j: a rule that
// jumps to j.To and carries j's comment and matches.
func jumpPresent(rules []string, j Jump) bool {
	for _, l := range rules {
		if !strings.HasSuffix(l, " -j "+j.To) {
			continue
		}
		if j.Comment != "" && !strings.Contains(l, `--comment "`+j.Comment+`"`) && !strings.Contains(l, "--comment "+j.Comment+" ") {
			continue
		}
		if len(j.Match) > 0 && !strings.Contains(l, strings.Join(j.Match, " ")) {
			continue
		}
		return true
	}
	return false
}

// canaryRule is the one rule of a canary chain: a flush (-F) removes it even though
// the chain itself survives. canaryLine is how iptables -S prints it.
var (
	canaryRule = []string{"-m", "comment", "--comment", "kpipe canary", "-j", "RETURN"}
	canaryLine = "-A " + ChainCanary + ` -m comment --comment "kpipe canary" -j RETURN`
)

// canaryHoldsRule says whether table's canary holds canaryRule. The mangle canary
// is an empty chain, as kube-proxy keeps it: kpipe has no rules in mangle, so a
// flush there needs no resync, and kube-proxy --cleanup deletes that chain
// without flushing it first (it could not delete it with a rule in it).
func canaryHoldsRule(table string) bool { return table != TableMangle }

// EnsureCanaries creates the canary chain in each table, with its rule where it
// holds one.
func (t Tool) EnsureCanaries(ctx context.Context, tables []string) error {
	for _, table := range tables {
		if err := t.ensureChain(ctx, table, ChainCanary); err != nil {
			return err
		}
		rules, err := t.ListChain(ctx, table, ChainCanary)
		if err != nil {
			return err
		}
		if !canaryHoldsRule(table) {
			if len(rules) > 0 { // an older kpipe's rule
				if _, err := t.iptables(ctx, "-t", table, "-F", ChainCanary); err != nil {
					return fmt.Errorf("empty the canary in %s: %w", table, err)
				}
			}
			continue
		}
		if slices.Contains(rules, canaryLine) {
			continue
		}
		if _, err := t.iptables(ctx, append([]string{"-t", table, "-A", ChainCanary}, canaryRule...)...); err != nil {
			return fmt.Errorf("ensure canary rule in %s: %w", table, err)
		}
	}
	return nil
}

// CanaryAlive says whether table still holds the canary chain (and its rule, where
// it holds one): false (and no error) when the chain was deleted or flushed; an
// error only when iptables could not answer.
func (t Tool) CanaryAlive(ctx context.Context, table string) (bool, error) {
	rules, err := t.ListChain(ctx, table, ChainCanary)
	if errors.Is(err, ErrNoChain) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return !canaryHoldsRule(table) || slices.Contains(rules, canaryLine), nil
}
