package netfilter

import (
	"fmt"
	"strings"

	"github.com/coreos/go-iptables/iptables"

	"github.com/kpipe/kpipe/bus"
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

// Rules is a go-iptables handle for one family, for the few rules kpipe keeps
// outside its own chains (jumps, canaries).
type Rules struct{ ipt *iptables.IPTables }

// NewRules makes a handle for family.
func NewRules(family bus.Family) (*Rules, error) {
	proto := iptables.ProtocolIPv4
	if family == bus.IPv6 {
		proto = iptables.ProtocolIPv6
	}
	ipt, err := iptables.NewWithProtocol(proto)
	if err != nil {
		return nil, fmt.Errorf("open iptables for %v: %w", family, err)
	}
	return &Rules{ipt: ipt}, nil
}

// EnsureChain creates chain in table if it does not exist; it never flushes it.
func (r *Rules) EnsureChain(table, chain string) error {
	ok, err := r.ipt.ChainExists(table, chain)
	if err != nil {
		return fmt.Errorf("check chain %s/%s: %w", table, chain, err)
	}
	if ok {
		return nil
	}
	if err := r.ipt.NewChain(table, chain); err != nil {
		// Lost a race with another writer: fine if it exists now.
		if ok, _ := r.ipt.ChainExists(table, chain); ok {
			return nil
		}
		return fmt.Errorf("create chain %s/%s: %w", table, chain, err)
	}
	return nil
}

// EnsureJumps makes sure every jump is in its built-in chain, inserting a missing
// one first (as kube-proxy does). It reads each built-in chain once with -S,
// which is cheap, and only creates chains and inserts rules for what is missing:
// a check with -C loads the whole table, which takes ~0.2 s at 10k services.
func (r *Rules) EnsureJumps(js []Jump) error {
	listed := map[string][]string{}
	for _, j := range js {
		key := j.Table + "/" + j.From
		rules, ok := listed[key]
		if !ok {
			var err error
			if rules, err = r.ipt.List(j.Table, j.From); err != nil {
				return fmt.Errorf("list %s: %w", key, err)
			}
			listed[key] = rules
		}
		if jumpPresent(rules, j) {
			continue
		}
		if err := r.EnsureChain(j.Table, j.To); err != nil {
			return err
		}
		spec := append([]string{}, j.Match...)
		if j.Comment != "" {
			spec = append(spec, "-m", "comment", "--comment", j.Comment)
		}
		spec = append(spec, "-j", j.To)
		if err := r.ipt.InsertUnique(j.Table, j.From, 1, spec...); err != nil {
			return fmt.Errorf("ensure jump %s -> %s: %w", key, j.To, err)
		}
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
// the chain itself survives.
var canaryRule = []string{"-m", "comment", "--comment", "kpipe canary", "-j", "RETURN"}

// EnsureCanaries creates the canary chain, with its rule, in each table.
func (r *Rules) EnsureCanaries(tables []string) error {
	for _, t := range tables {
		if err := r.EnsureChain(t, ChainCanary); err != nil {
			return err
		}
		if err := r.ipt.AppendUnique(t, ChainCanary, canaryRule...); err != nil {
			return fmt.Errorf("ensure canary rule in %s: %w", t, err)
		}
	}
	return nil
}

// CanaryAlive says whether table still holds the canary chain and its rule.
func (r *Rules) CanaryAlive(table string) bool {
	ok, err := r.ipt.Exists(table, ChainCanary, canaryRule...)
	return err == nil && ok
}
