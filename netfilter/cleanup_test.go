package netfilter

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// programmed is a kube-proxy-style nat ruleset with chains of every kind that
// jump to each other.
const programmed = `*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVCS-16-AAAA - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-EXT-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-XLB-AAAAAAAAAAAAAAAA - [0:0]
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -j KUBE-SVCS-16-AAAA
-A KUBE-SVCS-16-AAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-EXT-AAAAAAAAAAAAAAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-XLB-AAAAAAAAAAAAAAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SEP-BBBBBBBBBBBBBBBB -j KUBE-MARK-MASQ
COMMIT
`

// foreign are other agents' chains and rules, which cleanup must leave.
const foreign = `*nat
:CNI-HOSTPORT-DNAT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
-A CNI-HOSTPORT-DNAT -p tcp --dport 8080 -j RETURN
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
COMMIT
*filter
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP
-A INPUT -j KUBE-FIREWALL
COMMIT
`

func TestCleanupRemovesKubeProxyChainsAndLeavesOthers(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		tool := Tool{Family: f}
		ns.Run(t, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for _, p := range []string{foreign, programmed} {
				if err := tool.Restore(ctx, []byte(p)); err != nil {
					t.Fatalf("%v: program: %v", f, err)
				}
			}
			if err := tool.EnsureJumps(ctx, Jumps(false)); err != nil {
				t.Fatalf("%v: jumps: %v", f, err)
			}
			if err := tool.EnsureCanaries(ctx, []string{TableNAT, TableFilter, TableMangle}); err != nil {
				t.Fatalf("%v: canaries: %v", f, err)
			}

			if err := tool.Cleanup(ctx); err != nil {
				t.Fatalf("%v: cleanup: %v", f, err)
			}

			for _, table := range []string{TableNAT, TableFilter, TableMangle} {
				chains, err := tool.ChainNames(ctx, table)
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range chains {
					if slices.Contains(fixedChains[table], c) || KindOf(c) != KindOther {
						if c != ChainLocalnetFirewall {
							t.Errorf("%v: %s/%s is left", f, table, c)
						}
					}
				}
				for _, r := range builtinRules(t, tool, table) {
					if strings.Contains(r, "-j KUBE-") && !strings.HasSuffix(r, "-j KUBE-FIREWALL") {
						t.Errorf("%v: jump left: %s", f, r)
					}
				}
			}
			// The foreign chains, their rules and the jump into them are intact.
			mustHave(t, tool, TableNAT, "CNI-HOSTPORT-DNAT", "-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8080 -j RETURN")
			mustHave(t, tool, TableNAT, "PREROUTING", "-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT")
			mustHave(t, tool, TableFilter, "KUBE-FIREWALL", "-A KUBE-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP")
			mustHave(t, tool, TableFilter, "INPUT", "-A INPUT -j KUBE-FIREWALL")
			for _, table := range []string{TableNAT, TableFilter} {
				if _, err := tool.ListChain(ctx, table, "KUBE-KUBELET-CANARY"); err != nil {
					t.Errorf("%v: %s/KUBE-KUBELET-CANARY: %v", f, table, err)
				}
			}
			// A second run finds nothing to do and succeeds.
			if err := tool.Cleanup(ctx); err != nil {
				t.Errorf("%v: second cleanup: %v", f, err)
			}
			return nil
		})
	}
}

func mustHave(t *testing.T, tool Tool, table, chain, rule string) {
	t.Helper()
	rules, err := tool.ListChain(context.Background(), table, chain)
	if err != nil || !slices.Contains(rules, rule) {
		t.Errorf("%v: %s/%s lost %q: has %q (%v)", tool.Family, table, chain, rule, rules, err)
	}
}

func TestDeleteNFTablesKubeProxyLeavesOtherTables(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	ns.Run(t, func() error {
		ctx := context.Background()
		for _, script := range []string{"add table ip kube-proxy", "add chain ip kube-proxy services", "add table ip6 kube-proxy", "add table inet kube-proxy", "add table ip other"} {
			if _, err := runNFT(ctx, strings.Fields(script)...); err != nil {
				netnstest.Unavailable(t, err.Error())
			}
		}
		if err := DeleteNFTablesKubeProxy(ctx); err != nil {
			t.Fatal(err)
		}
		out, err := runNFT(ctx, "list", "tables")
		if err != nil {
			t.Fatal(err)
		}
		got := strings.Fields(string(out))
		want := strings.Fields("table inet kube-proxy table ip other")
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("tables after delete: %q, want %q", out, want)
		}
		return DeleteNFTablesKubeProxy(ctx) // nothing left to do: no error
	})
}

// CleanupIPVS removes kube-proxy's ipsets (IPv4 names and their KUBE-6- IPv6
// twins, one cut to 31 characters), as its --cleanup does; another agent's ipset,
// a KUBE- ipset kube-proxy never makes and another link stay. A second run finds
// nothing to do.
func TestCleanupIPVSRemovesKubeProxysIPSets(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	ns.Run(t, func() error {
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "other0"}}); err != nil {
			t.Fatalf("add bridge other0: %v", err)
		}
		sets := []struct {
			name, kind string
			opts       netlink.IpsetCreateOptions
		}{
			{"KUBE-CLUSTER-IP", "hash:ip,port", netlink.IpsetCreateOptions{Family: syscall.AF_INET}},
			{"KUBE-6-CLUSTER-IP", "hash:ip,port", netlink.IpsetCreateOptions{Family: syscall.AF_INET6}},
			{"KUBE-6-LOAD-BALANCER-SOURCE-CID", "hash:ip,port,net", netlink.IpsetCreateOptions{Family: syscall.AF_INET6}},
			{"KUBE-NODE-PORT-TCP", "bitmap:port", netlink.IpsetCreateOptions{PortFrom: 0, PortTo: 65535}},
			{"KUBE-LOOP-BACK", "hash:ip,port,ip", netlink.IpsetCreateOptions{Family: syscall.AF_INET}},
			{"other-agent", "hash:ip", netlink.IpsetCreateOptions{Family: syscall.AF_INET}},
			{"KUBE-SOMEONE-ELSE", "hash:ip", netlink.IpsetCreateOptions{Family: syscall.AF_INET}},
		}
		for _, s := range sets {
			if err := netlink.IpsetCreate(s.name, s.kind, s.opts); err != nil {
				netnstest.Unavailable(t, fmt.Sprintf("create ipset %s (%s): %v", s.name, s.kind, err))
			}
		}
		if got := ipsetNames(t); len(got) != len(sets) {
			t.Fatalf("ipsets before cleanup %q: the check below could not fail", got)
		}
		for run := 1; run <= 2; run++ {
			if err := CleanupIPVS(); err != nil {
				t.Errorf("run %d: %v", run, err)
			}
			if got, want := ipsetNames(t), []string{"KUBE-SOMEONE-ELSE", "other-agent"}; !slices.Equal(got, want) {
				t.Errorf("run %d: ipsets %q; want %q", run, got, want)
			}
			if got, want := linkNames(t), []string{"lo", "other0"}; !slices.Equal(got, want) {
				t.Errorf("run %d: links %q; want %q", run, got, want)
			}
		}
		return nil
	})
}

// CleanupIPVS deletes a kube-ipvs0 dummy link and leaves another dummy. Needs a
// kernel with dummy links (this test bed's has none: then a skip; the fake in
// TestRemoveIPVSLink covers the decision).
func TestCleanupIPVSRemovesTheDummyLink(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	ns.Run(t, func() error {
		for _, name := range []string{IPVSDummyLink, "other0"} {
			if err := netlink.LinkAdd(&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: name}}); err != nil {
				t.Skipf("this kernel makes no dummy link: %v", err)
			}
		}
		if err := CleanupIPVS(); err != nil {
			t.Error(err)
		}
		if got, want := linkNames(t), []string{"lo", "other0"}; !slices.Equal(got, want) {
			t.Errorf("links %q; want %q", got, want)
		}
		return nil
	})
}

// A kube-ipvs0 that is not a dummy link is not kube-proxy's: it stays, and
// CleanupIPVS says so.
func TestCleanupIPVSLeavesAKubeIPVS0ThatIsNotADummy(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	ns.Run(t, func() error {
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: IPVSDummyLink}}); err != nil {
			t.Fatal(err)
		}
		if err := CleanupIPVS(); err == nil || !strings.Contains(err.Error(), IPVSDummyLink) {
			t.Errorf("CleanupIPVS with a bridge named %s: %v; want an error naming it", IPVSDummyLink, err)
		}
		if got := linkNames(t); !slices.Contains(got, IPVSDummyLink) {
			t.Errorf("links %q: the bridge %s was removed", got, IPVSDummyLink)
		}
		return nil
	})
}

// fakeLinks is a netlink with one link (or none).
type fakeLinks struct {
	link    netlink.Link
	deleted []string
}

func (f *fakeLinks) LinkByName(name string) (netlink.Link, error) {
	if f.link == nil || f.link.Attrs().Name != name {
		return nil, netlink.LinkNotFoundError{}
	}
	return f.link, nil
}

func (f *fakeLinks) LinkDel(l netlink.Link) error {
	f.deleted = append(f.deleted, l.Attrs().Name)
	return nil
}

// kube-ipvs0 is deleted when it is a dummy; none is no error, nor another
// dummy; kube-ipvs0 of another type is not kube-proxy's: kept, and an error
// naming it.
func TestRemoveIPVSLink(t *testing.T) {
	attrs := netlink.LinkAttrs{Name: IPVSDummyLink}
	for _, c := range []struct {
		link    netlink.Link
		deleted []string
		err     bool
	}{
		{&netlink.Dummy{LinkAttrs: attrs}, []string{IPVSDummyLink}, false},
		{nil, nil, false},
		{&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: "other0"}}, nil, false},
		{&netlink.Bridge{LinkAttrs: attrs}, nil, true},
	} {
		f := &fakeLinks{link: c.link}
		err := removeIPVSLink(f)
		if !slices.Equal(f.deleted, c.deleted) || (err != nil) != c.err || err != nil && !strings.Contains(err.Error(), IPVSDummyLink) {
			t.Errorf("link %v: deleted %q, err %v; want deleted %q, error %v naming %s", c.link, f.deleted, err, c.deleted, c.err, IPVSDummyLink)
		}
	}
}

func linkNames(t *testing.T) []string {
	t.Helper()
	links, err := netlink.LinkList()
	return sortedNames(t, links, err, func(l netlink.Link) string { return l.Attrs().Name })
}

func ipsetNames(t *testing.T) []string {
	t.Helper()
	sets, err := netlink.IpsetListAll()
	return sortedNames(t, sets, err, func(s netlink.IPSetResult) string { return s.SetName })
}

// sortedNames is the names of a listing, sorted; a listing that failed ends the test.
func sortedNames[T any](t *testing.T, list []T, err error, name func(T) string) []string {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, x := range list {
		names = append(names, name(x))
	}
	slices.Sort(names)
	return names
}

// kubeProxyIPVSChains are the chains kube-proxy v1.34's ipvs mode makes that its
// iptables mode does not (pkg/proxy/ipvs/proxier.go, iptablesCleanupChains).
var kubeProxyIPVSChains = map[string][]string{
	TableNAT:    {"KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"},
	TableFilter: {"KUBE-NODE-PORT", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"},
}

// ipvsLeftovers is what kube-proxy's ipvs mode leaves in family's tables
// (testdata), and the ipsets its rules refer to.
func ipvsLeftovers(t *testing.T, f bus.Family) (rules []byte, ipsets []string) {
	t.Helper()
	file := map[bus.Family]string{bus.IPv4: "testdata/kube-proxy-ipvs-v4.rules", bus.IPv6: "testdata/kube-proxy-ipvs-v6.rules"}[f]
	rules, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`--match-set (\S+)`).FindAllSubmatch(rules, -1) {
		if name := string(m[1]); !slices.Contains(ipsets, name) {
			ipsets = append(ipsets, name)
		}
	}
	return rules, ipsets
}

// otherAgentRules are another agent's chain, a rule in it that refers to its
// own ipset (one a family), and rules of its own in built-in chains: cleanup
// leaves all of them.
var otherAgentRules = []string{
	"-A OTHER-AGENT -m set --match-set %s src -j ACCEPT",
	"-A INPUT -j OTHER-AGENT",
	`-A OUTPUT -p tcp -m tcp --dport 9999 -m comment --comment "other agent" -j ACCEPT`,
}

// otherAgent is otherAgentRules with its ipset named set, as the lines
// ListChain prints and as a payload for iptables-restore.
func otherAgent(set string) (rules []string, payload []byte) {
	for _, r := range otherAgentRules {
		rules = append(rules, strings.ReplaceAll(r, "%s", set))
	}
	return rules, []byte("*filter\n:OTHER-AGENT - [0:0]\n" + strings.Join(rules, "\n") + "\nCOMMIT\n")
}

// On a node kube-proxy's ipvs mode programmed, Cleanup then CleanupIPVS (the
// order of kpipe --cleanup) remove its chains and the jumps into them in both
// families, and then its ipsets, which its rules referred to; another agent's
// chain, rules and ipset stay. A second run finds nothing to do.
func TestCleanupRemovesKubeProxyIPVSLeftovers(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	ns.Run(t, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		families := map[bus.Family]uint8{bus.IPv4: syscall.AF_INET, bus.IPv6: syscall.AF_INET6}
		otherSets := map[bus.Family]string{bus.IPv4: "other-agent", bus.IPv6: "other-agent-6"}
		for f, af := range families {
			rules, ipsets := ipvsLeftovers(t, f)
			for _, s := range append(ipsets, otherSets[f]) {
				if err := netlink.IpsetCreate(s, "hash:ip", netlink.IpsetCreateOptions{Family: af}); err != nil {
					netnstest.Unavailable(t, fmt.Sprintf("create ipset %s: %v", s, err))
				}
			}
			_, others := otherAgent(otherSets[f])
			for _, p := range [][]byte{rules, others} {
				if err := (Tool{Family: f}).restoreTool(ctx, p); err != nil {
					t.Fatalf("%v: program: %v", f, err)
				}
			}
		}
		for run := 1; run <= 2; run++ {
			for f := range families {
				tool := Tool{Family: f}
				if err := tool.Cleanup(ctx); err != nil {
					t.Errorf("run %d, %v: Cleanup: %v", run, f, err)
				}
				requireNoKubeProxyIPVSChains(t, tool)
				others, _ := otherAgent(otherSets[f])
				for _, r := range others {
					mustHave(t, tool, TableFilter, strings.Fields(r)[1], r)
				}
			}
			if err := CleanupIPVS(); err != nil {
				t.Errorf("run %d: CleanupIPVS: %v", run, err)
			}
			if got, want := ipsetNames(t), []string{"other-agent", "other-agent-6"}; !slices.Equal(got, want) {
				t.Errorf("run %d: ipsets %q; want %q", run, got, want)
			}
		}
		return nil
	})
}

// requireNoKubeProxyIPVSChains fails the test if tool's family still has one
// of kube-proxy's ipvs-mode chains or a jump into a KUBE- chain.
func requireNoKubeProxyIPVSChains(t *testing.T, tool Tool) {
	t.Helper()
	ctx := context.Background()
	for table, owned := range kubeProxyIPVSChains {
		chains, err := tool.ChainNames(ctx, table)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range chains {
			if slices.Contains(owned, c) || slices.Contains(fixedChains[table], c) {
				t.Errorf("%v: %s/%s is left", tool.Family, table, c)
			}
		}
		for _, r := range builtinRules(t, tool, table) {
			if strings.Contains(r, "-j KUBE-") {
				t.Errorf("%v: jump left: %s", tool.Family, r)
			}
		}
	}
}

// builtinChains are the built-in chains of the tables kpipe writes.
var builtinChains = map[string][]string{
	TableNAT:    {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
	TableFilter: {"INPUT", "FORWARD", "OUTPUT"},
}

// builtinRules are the rules of table's built-in chains in tool's family,
// failing the test if one cannot be listed.
func builtinRules(t *testing.T, tool Tool, table string) []string {
	t.Helper()
	var rules []string
	for _, chain := range builtinChains[table] {
		r, err := tool.ListChain(context.Background(), table, chain)
		if err != nil {
			t.Fatalf("%v: list %s/%s: %v", tool.Family, table, chain, err)
		}
		rules = append(rules, r...)
	}
	return rules
}
