package tracer

import (
	"math"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// sharedNode is what iptables-save prints on a node shared with Docker: its
// FORWARD policy DROP, its rules (some the tracer cannot evaluate) around
// kube-proxy's, one ClusterIP service default/web with two endpoints.
const sharedNode = "testdata/shared-node.rules"

func parseNode(t *testing.T, path string) *nf.Ruleset {
	t.Helper()
	text, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := nf.ParseRulesetOf(text, bus.IPv4)
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// A node's rules, other agents' included: the service's two endpoints each
// with probability 1/2, and the rules of other agents the paths passed are
// listed, not guessed.
func TestTraceRulesetOnASharedNode(t *testing.T) {
	rs := parseNode(t, sharedNode)
	res := TraceRuleset(rs, nodeIPs, tcp(podSrc, netip.MustParseAddr("10.96.0.80"), 80))
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if got, want := res.Endpoints, aps("10.244.1.5:8080", "10.244.2.6:8080"); !slices.Equal(got, want) {
		t.Fatalf("endpoints %v, want %v\n%s", got, want, strings.Join(res.Trace(), "\n"))
	}
	if res.Verdict != Accept || res.Masqueraded {
		t.Fatalf("got %s; want ACCEPT, not masqueraded (a pod's own source)\n%s", res, strings.Join(res.Trace(), "\n"))
	}
	sum := 0.0
	for _, p := range res.Paths {
		if math.Abs(p.Probability-0.5) > 1e-9 {
			t.Errorf("path to %s has probability %v, want 0.5", p.Endpoint, p.Probability)
		}
		sum += p.Probability
		// KUBE-FORWARD accepts the pod's packet before Docker's -o rule.
		if len(p.Unevaluated) != 2 || !strings.HasPrefix(p.Unevaluated[0], "nat/PREROUTING: -A PREROUTING -j LOG") ||
			!strings.HasPrefix(p.Unevaluated[1], "nat/POSTROUTING: -A POSTROUTING -s 172.17.0.0/16 ! -o docker0") {
			t.Errorf("path to %s passed unevaluated %q; want the LOG rule and Docker's MASQUERADE", p.Endpoint, p.Unevaluated)
		}
		if !slices.ContainsFunc(p.Steps, func(s Step) bool { return strings.HasPrefix(s.Chain, "KUBE-SEP-") && s.Comment == "default/web:http" }) {
			t.Errorf("path to %s: no step names default/web:http in its endpoint's chain: %v", p.Endpoint, p.Trace())
		}
	}
	if math.Abs(sum-1) > 1e-9 {
		t.Errorf("the paths' probabilities add up to %v", sum)
	}
}

// A packet from outside the cluster's pod range is masqueraded; one that no
// rule accepts in FORWARD meets Docker's policy DROP.
func TestTraceRulesetMasqueradeAndPolicy(t *testing.T) {
	rs := parseNode(t, sharedNode)
	outside := Packet{Source: netip.MustParseAddr("172.30.0.7"), Dest: netip.MustParseAddr("10.96.0.80"), Proto: "tcp", DPort: 80, From: FromPrerouting, InInterface: "eth0"}
	if res := TraceRuleset(rs, nodeIPs, outside); res.Verdict != Accept || !res.Masqueraded || len(res.Endpoints) != 2 {
		t.Errorf("from outside: %s; want ACCEPT, masqueraded, both endpoints", res)
	}
	elsewhere := outside
	elsewhere.Dest = netip.MustParseAddr("10.50.0.1")
	res := TraceRuleset(rs, nodeIPs, elsewhere)
	if res.Verdict != Drop {
		t.Fatalf("routed through, not a service, from outside the pod range: %s; want DROP by FORWARD's policy", res)
	}
	if last := res.Paths[0].Steps[len(res.Paths[0].Steps)-1]; last.Comment != "policy DROP" || last.Chain != "FORWARD" {
		t.Errorf("last step %+v; want filter/FORWARD's policy DROP", last)
	}
}

// A ruleset without the nat or filter table cannot be traced: an error,
// never an empty trace.
func TestTraceRulesetNeedsNATAndFilter(t *testing.T) {
	for _, text := range []string{"*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n", "*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n"} {
		rs, err := nf.ParseRulesetOf([]byte(text), bus.IPv4)
		if err != nil {
			t.Fatal(err)
		}
		if res := TraceRuleset(rs, nodeIPs, tcp(podSrc, vip, 80)); res.Err == nil {
			t.Errorf("traced %q: %s", text, res)
		}
	}
}
