package main

import (
	"strings"
	"testing"

	nf "github.com/kpipe/kpipe/netfilter"
)

// rulesetOf reads a one-family document (the test's fixed input).
func rulesetOf(t *testing.T, text string) nf.Ruleset {
	t.Helper()
	sets, err := nf.ParseRulesets([]byte(text))
	if err != nil || len(sets) != 1 {
		t.Fatalf("fixture: %v (%d rulesets)", err, len(sets))
	}
	return sets[0]
}

// rendered is what render wrote for two services, with kpipe's jumps.
const rendered = `*nat
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SVC-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SERVICES - [0:0]
:PREROUTING ACCEPT [0:0]
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SVC-AAAAAAAAAAAAAAAA -m comment --comment "ns/a cluster IP" -m tcp -p tcp -d 10.96.0.1/32 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-AAAAAAAAAAAAAAAA -m comment --comment "ns/a -> 10.244.0.10:8080" -m tcp -p tcp -j DNAT --to-destination 10.244.0.10:8080
-A KUBE-SVC-BBBBBBBBBBBBBBBB -m comment --comment "ns/b -> 10.244.0.11:8080" -m tcp -p tcp -j DNAT --to-destination 10.244.0.11:8080
-A KUBE-SERVICES -m comment --comment "ns/a cluster IP" -m tcp -p tcp -d 10.96.0.1/32 --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SERVICES -m comment --comment "ns/b cluster IP" -m tcp -p tcp -d 10.96.0.2/32 --dport 80 -j KUBE-SVC-BBBBBBBBBBBBBBBB
-A KUBE-SERVICES -m comment --comment "ns/c has no endpoints" -m tcp -p tcp -d 10.96.0.3/32 --dport 80 -j REJECT
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
COMMIT
`

// inSync is the node holding exactly that, as iptables-save prints it (its
// option order, --set-xmark, REJECT's default named), with another agent's
// chain and rules (one before kpipe's jump), and a top-level chain and a jump
// kpipe did not render, which it leaves.
const inSync = `*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SVC-BBBBBBBBBBBBBBBB - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A INPUT -j KUBE-FIREWALL
-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8443 -j DNAT --to-destination 10.244.0.99:443
-A KUBE-FIREWALL -j DROP
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment "ns/a cluster IP" -m tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SERVICES -d 10.96.0.2/32 -p tcp -m comment --comment "ns/b cluster IP" -m tcp --dport 80 -j KUBE-SVC-BBBBBBBBBBBBBBBB
-A KUBE-SERVICES -d 10.96.0.3/32 -p tcp -m comment --comment "ns/c has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
-A KUBE-SVC-AAAAAAAAAAAAAAAA ! -s 10.244.0.0/16 -d 10.96.0.1/32 -p tcp -m comment --comment "ns/a cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-AAAAAAAAAAAAAAAA -p tcp -m comment --comment "ns/a -> 10.244.0.10:8080" -m tcp -j DNAT --to-destination 10.244.0.10:8080
-A KUBE-SVC-BBBBBBBBBBBBBBBB -p tcp -m comment --comment "ns/b -> 10.244.0.11:8080" -m tcp -j DNAT --to-destination 10.244.0.11:8080
COMMIT
`

func TestDiffRulesetInSync(t *testing.T) {
	if diffs := diffRuleset(rulesetOf(t, inSync), rulesetOf(t, rendered)); len(diffs) != 0 {
		t.Errorf("a node holding the rendering differs: %+v", diffs)
	}
}

// One service's endpoint changed, a stale endpoint chain left, kpipe's jump
// gone: the diff shows those chains, nothing of the rest or of the other
// agent's.
func TestDiffRulesetShowsOnlyWhatChanged(t *testing.T) {
	live := strings.NewReplacer(
		"10.244.0.11:8080", "10.244.0.12:8080",
		`-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`+"\n", "",
		":KUBE-SVC-BBBBBBBBBBBBBBBB - [0:0]\n", ":KUBE-SVC-BBBBBBBBBBBBBBBB - [0:0]\n:KUBE-SEP-CCCCCCCCCCCCCCCC - [0:0]\n",
		"COMMIT", "-A KUBE-SEP-CCCCCCCCCCCCCCCC -j DNAT --to-destination 10.244.0.13:8080\nCOMMIT",
	).Replace(inSync)
	var out strings.Builder
	if err := writeDiff(&out, "IPv4", diffRuleset(rulesetOf(t, live), rulesetOf(t, rendered))); err != nil {
		t.Fatal(err)
	}
	want := `--- live IPv4
+++ rendered IPv4
@@ nat KUBE-SVC-BBBBBBBBBBBBBBBB @@
--A KUBE-SVC-BBBBBBBBBBBBBBBB -p tcp -m comment --comment "ns/b -> 10.244.0.12:8080" -m tcp -j DNAT --to-destination 10.244.0.12:8080
+-A KUBE-SVC-BBBBBBBBBBBBBBBB -m comment --comment "ns/b -> 10.244.0.11:8080" -m tcp -p tcp -j DNAT --to-destination 10.244.0.11:8080
@@ nat PREROUTING @@
+-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
@@ nat KUBE-SEP-CCCCCCCCCCCCCCCC @@
-:KUBE-SEP-CCCCCCCCCCCCCCCC -
--A KUBE-SEP-CCCCCCCCCCCCCCCC -j DNAT --to-destination 10.244.0.13:8080
`
	if out.String() != want {
		t.Errorf("diff:\n%s\nwant:\n%s", out.String(), want)
	}
}

// A chain the node lacks shows whole, declaration first; a table the node
// lacks is every chain of it.
func TestDiffRulesetChainOnlyRendered(t *testing.T) {
	diffs := diffRuleset(nf.Ruleset{}, rulesetOf(t, rendered))
	if len(diffs) != 5 {
		t.Fatalf("%d chains differ; want all 5: %+v", len(diffs), diffs)
	}
	if d := diffs[1]; d.chain != "KUBE-SVC-AAAAAAAAAAAAAAAA" || len(d.lines) != 3 || d.lines[0] != "+:KUBE-SVC-AAAAAAAAAAAAAAAA -" ||
		!strings.HasPrefix(d.lines[2], "+-A KUBE-SVC-AAAAAAAAAAAAAAAA") {
		t.Errorf("the service chain's diff is %+v", d)
	}
}

// Rules in another order are a difference: a chain's rules are tried in order.
func TestDiffRulesOrder(t *testing.T) {
	got := diffRules([]string{"-A X -j A", "-A X -j B", "-A X -j C"}, []string{"-A X -j B", "-A X -j A", "-A X -j C"})
	if want := []string{"--A X -j A", "+-A X -j A"}; strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("got %q; want %q", got, want)
	}
}
