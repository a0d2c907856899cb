package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
	nf "github.com/kpipe/kpipe/netfilter"
)

// runKpipeOnce runs the kpipe binary in the node's namespace with args (a
// one-shot mode) and returns its exit code and output.
func runKpipeOnce(t *testing.T, args ...string) (int, string) {
	t.Helper()
	if kpipeErr != nil {
		t.Fatalf("kpipe unavailable: %v", kpipeErr)
	}
	return runOnce(t, time.Minute, "ip", append([]string{"netns", "exec", tb.NodeNS, tb.Kpipe().Bin}, args...)...)
}

// leftovers lists, for both families, the chains of kpipe or kube-proxy and the
// jumps into KUBE-* chains left in the node's nat, filter and mangle tables
// (kubelet's KUBE-FIREWALL and KUBE-KUBELET-CANARY are not theirs).
func leftovers(t *testing.T) []string {
	t.Helper()
	var left []string
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		for _, table := range []string{"nat", "filter", "mangle"} {
			out, err := tb.Exec(tb.NodeNS, save, "-t", table)
			if err != nil {
				t.Fatalf("%s -t %s: %v", save, table, err)
			}
			for _, l := range strings.Split(out, "\n") {
				fields := strings.Fields(l)
				switch {
				case strings.HasPrefix(l, ":") && kpipeChain(fields[0][1:]):
					left = append(left, save+" "+table+" chain "+fields[0][1:])
				case strings.HasPrefix(l, "-A ") && !strings.HasPrefix(fields[1], "KUBE-") && strings.Contains(l, "-j KUBE-") &&
					!strings.HasSuffix(l, "-j KUBE-FIREWALL") && !strings.HasSuffix(l, "-j KUBE-KUBELET-CANARY"):
					left = append(left, save+" "+table+" rule "+l)
				}
			}
		}
	}
	return left
}

// removeKubeFirewall removes what --cleanup leaves on purpose, as upstream's
// does (KUBE-FIREWALL, shared with the kubelet, and the jumps to it), so that
// the next kpipe programs the node as a fresh one: it puts its jumps in
// front in its own order, and later comparisons with a fresh kpipe's rules
// (requireLikeFresh) hold.
func removeKubeFirewall(t *testing.T) {
	t.Helper()
	for _, family := range []string{"iptables", "ip6tables"} {
		save, err := tb.Exec(tb.NodeNS, family+"-save", "-t", "filter")
		if err != nil {
			t.Fatalf("%s-save: %v", family, err)
		}
		if !strings.Contains(save, ":KUBE-FIREWALL ") {
			continue
		}
		payload := "*filter\n"
		for _, l := range strings.Split(save, "\n") {
			if strings.HasPrefix(l, "-A ") && !strings.HasPrefix(l, "-A KUBE-FIREWALL ") && strings.HasSuffix(l, "-j KUBE-FIREWALL") {
				payload += "-D" + strings.TrimPrefix(l, "-A") + "\n"
			}
		}
		payload += "-F KUBE-FIREWALL\n-X KUBE-FIREWALL\nCOMMIT\n"
		if err := restoreInNode(t, family, payload); err != nil {
			t.Fatalf("remove KUBE-FIREWALL: %v", err)
		}
	}
}

// restoreInNode writes payload with family's iptables-restore --noflush in the
// node's namespace.
func restoreInNode(t *testing.T, family, payload string) error {
	t.Helper()
	file := filepath.Join(t.TempDir(), family+".rules")
	if err := os.WriteFile(file, []byte(payload), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := tb.Exec(tb.NodeNS, family+"-restore", "-w", "5", "--noflush", file); err != nil {
		return fmt.Errorf("%s-restore: %w %s", family, err, out)
	}
	return nil
}

// kpipeChain says whether --cleanup must delete chain: kpipe's, and kube-proxy's
// of its iptables and ipvs modes. kube-proxy's --cleanup leaves KUBE-FIREWALL,
// which kubelet owns too.
func kpipeChain(chain string) bool {
	if chain == nf.ChainLocalnetFirewall {
		return false
	}
	return chain == nf.ChainCanary || nf.KindOf(chain) != nf.KindOther || slices.Contains(kubeProxyIPVSChains, chain)
}

// kubeProxyIPVSChains are the chains kube-proxy v1.34's ipvs mode makes that its
// iptables mode does not (pkg/proxy/ipvs/proxier.go, iptablesCleanupChains).
var kubeProxyIPVSChains = []string{"KUBE-NODE-PORT", "KUBE-LOAD-BALANCER", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER"}

// kpipe --cleanup, run on a node kpipe has programmed, removes every chain and
// jump of kpipe's (kube-proxy's) in both families, exits 0, and leaves another
// agent's chain and rule alone; service addresses are then no longer proxied.
// Running it again finds nothing and exits 0 too.
func TestCleanupRemovesKpipeRules(t *testing.T) {
	e := setup(t)
	svc := e.create(typed(e.ns, "np", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	addr := testbed.ClusterAddr(svc, 80)
	expectExactly(t, "TCP ClusterIP from a pod, before", tcp2, tb.Pod(clientPod).NS, addr, podIPs(1, 2))

	foreign := [][]string{
		{"iptables", "-w", "-t", "nat", "-N", "CNI-HOSTPORT-DNAT"},
		{"iptables", "-w", "-t", "nat", "-A", "CNI-HOSTPORT-DNAT", "-p", "tcp", "--dport", "8080", "-j", "RETURN"},
		{"iptables", "-w", "-t", "nat", "-A", "PREROUTING", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "CNI-HOSTPORT-DNAT"},
	}
	for _, c := range foreign {
		if out, err := tb.Exec(tb.NodeNS, c...); err != nil {
			t.Fatalf("%q: %v %s", c, err, out)
		}
	}
	t.Cleanup(func() {
		_, _ = tb.Exec(tb.NodeNS, "iptables", "-w", "-t", "nat", "-D", "PREROUTING", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "CNI-HOSTPORT-DNAT")
		_, _ = tb.Exec(tb.NodeNS, "iptables", "-w", "-t", "nat", "-F", "CNI-HOSTPORT-DNAT")
		_, _ = tb.Exec(tb.NodeNS, "iptables", "-w", "-t", "nat", "-X", "CNI-HOSTPORT-DNAT")
	})

	e.restoreKpipeAtEnd()                       // kpipe comes back with the test bed's defaults
	t.Cleanup(func() { removeKubeFirewall(t) }) // runs first: kpipe then starts as on a fresh node
	if err := e.k.Stop(); err != nil {
		t.Fatalf("stop kpipe: %v", err)
	}
	if left := leftovers(t); len(left) == 0 {
		t.Fatal("no kpipe chains before --cleanup: the check below could not fail")
	}
	makeIPSets(t, "KUBE-CLUSTER-IP", "KUBE-6-CLUSTER-IP", "KUBE-LOOP-BACK", "cni-other", "KUBE-NOT-KUBE-PROXYS")
	for run := 1; run <= 2; run++ {
		requireCleanedUp(t, run)
	}
	nat := e.iptablesSave("nat")
	for _, want := range []string{":CNI-HOSTPORT-DNAT", "-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8080 -j RETURN", "-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT"} {
		if !strings.Contains(nat, want) {
			t.Errorf("--cleanup removed another agent's %q; nat now:\n%s", want, nat)
		}
	}
	eventuallyDropped(t, "TCP ClusterIP from a pod, after --cleanup", tcp1, tb.Pod(clientPod).NS, addr)
}

// otherAgentFilter is another agent's filter chain, whose rule refers to its own
// ipset, and rules of its own in built-in chains.
var otherAgentFilter = []string{
	"-A OTHER-AGENT -m set --match-set cni-other src -j ACCEPT",
	"-A INPUT -j OTHER-AGENT",
	`-A OUTPUT -p tcp -m tcp --dport 9999 -m comment --comment "other agent" -j ACCEPT`,
}

// kpipe --cleanup on a node that kube-proxy's ipvs mode programmed (the rules it
// writes, netfilter/testdata, in both families) removes its chains and the
// jumps into them, then its ipsets, which those rules refer to; another agent's
// chain, its rules in built-in chains and its ipset stay. It exits 0, and again
// when it finds nothing.
func TestCleanupRemovesKubeProxyIPVSLeftovers(t *testing.T) {
	e := setup(t)
	e.restoreKpipeAtEnd()
	t.Cleanup(func() { removeKubeFirewall(t) })
	if err := e.k.Stop(); err != nil {
		t.Fatalf("stop kpipe: %v", err)
	}
	// kube-proxy's ipvs mode programs the node after kpipe left it.
	if code, out := runKpipeOnce(t, "--cleanup"); code != 0 {
		t.Fatalf("kpipe --cleanup of kpipe's rules: exit %d:\n%s", code, out)
	}
	rules := map[string]string{"iptables": ipvsRules(t, "v4"), "ip6tables": ipvsRules(t, "v6")}
	makeIPSets(t, append(referencedIPSets(rules["iptables"]+rules["ip6tables"]), "cni-other", "KUBE-NOT-KUBE-PROXYS")...)
	t.Cleanup(func() { undoIPVSRules(t, rules) }) // before the ipsets go
	for family, payload := range rules {
		if err := restoreInNode(t, family, payload); err != nil {
			t.Fatalf("write kube-proxy's ipvs-mode rules: %v", err)
		}
	}
	if err := restoreInNode(t, "iptables", "*filter\n:OTHER-AGENT - [0:0]\n"+strings.Join(otherAgentFilter, "\n")+"\nCOMMIT\n"); err != nil {
		t.Fatalf("write another agent's rules: %v", err)
	}
	t.Cleanup(func() {
		_ = restoreInNode(t, "iptables", "*filter\n-D INPUT -j OTHER-AGENT\n-D"+strings.TrimPrefix(otherAgentFilter[2], "-A")+"\n-F OTHER-AGENT\n-X OTHER-AGENT\nCOMMIT\n")
	})
	if left := leftovers(t); len(left) == 0 {
		t.Fatal("no kube-proxy chains before --cleanup: the check below could not fail")
	}

	for run := 1; run <= 2; run++ {
		requireCleanedUp(t, run)
		filter := e.iptablesSave("filter")
		for _, want := range append([]string{":OTHER-AGENT"}, otherAgentFilter...) {
			if !strings.Contains(filter, want) {
				t.Errorf("--cleanup (run %d) removed another agent's %q; filter now:\n%s", run, want, filter)
			}
		}
	}
}

// ipvsRules is what kube-proxy's ipvs mode writes in one family (v4, v6).
func ipvsRules(t *testing.T, family string) string {
	t.Helper()
	b, err := os.ReadFile("../netfilter/testdata/kube-proxy-ipvs-" + family + ".rules")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// referencedIPSets are the ipsets that rules match on, once each.
func referencedIPSets(rules string) []string {
	var names []string
	for _, m := range regexp.MustCompile(`--match-set (\S+)`).FindAllStringSubmatch(rules, -1) {
		if !slices.Contains(names, m[1]) {
			names = append(names, m[1])
		}
	}
	return names
}

// undoIPVSRules removes what is left of rules (by family) from the node, so
// that the tests after a failed one find it as they expect: each jump they
// inserted into a built-in chain, then the chains they declared (flushed
// first, as they jump to each other).
func undoIPVSRules(t *testing.T, rules map[string]string) {
	t.Helper()
	for family, payload := range rules {
		var table, declared, deleted string
		for _, l := range strings.Split(payload, "\n") {
			switch f := strings.Fields(l); {
			case strings.HasPrefix(l, "*"):
				table, declared, deleted = l, "", ""
			case strings.HasPrefix(l, ":"):
				declared += l + "\n"
				deleted += "-X " + f[0][1:] + "\n"
			case strings.HasPrefix(l, "-I "): // -I CHAIN 1 rule
				_ = restoreInNode(t, family, table+"\n-D "+f[1]+" "+strings.Join(f[3:], " ")+"\nCOMMIT\n")
			case l == "COMMIT":
				_ = restoreInNode(t, family, table+"\n"+declared+deleted+"COMMIT\n")
			}
		}
	}
}

// requireCleanedUp runs kpipe --cleanup (the run-th time) and fails the test
// unless it exits 0 and leaves none of kpipe's or kube-proxy's chains, jumps
// and ipsets, and the two other ipsets the tests make (makeIPSets) stay.
func requireCleanedUp(t *testing.T, run int) {
	t.Helper()
	if code, out := runKpipeOnce(t, "--cleanup"); code != 0 {
		t.Errorf("kpipe --cleanup (run %d): exit %d:\n%s", run, code, out)
	}
	if left := leftovers(t); len(left) > 0 {
		t.Errorf("after --cleanup (run %d), left:\n%s", run, strings.Join(left, "\n"))
	}
	if got, want := nodeIPSets(t), []string{"KUBE-NOT-KUBE-PROXYS", "cni-other"}; !slices.Equal(got, want) {
		t.Errorf("after --cleanup (run %d), ipsets %q; want %q (kube-proxy's ipvs-mode sets gone, the others kept)", run, got, want)
	}
}

const establishedSysctl = "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established"

// kpipe --init-only sets the node up and exits 0 without proxying: the conntrack
// timeout it is given is in the node's namespace (nf_conntrack_max, global, can
// not be set from a namespace: a warning, not a failure), and kube-proxy's
// nftables-mode tables are gone while other nftables tables stay.
func TestInitOnlySetsUpTheNode(t *testing.T) {
	setup(t)
	keepNodeSysctl(t, establishedSysctl)
	t.Cleanup(func() {
		_, _ = tb.Exec(tb.NodeNS, "nft", "delete", "table", "ip", "kpipetest-other")
		_, _ = tb.Exec(tb.NodeNS, "nft", "delete", "table", "ip", "kube-proxy")
	})
	for _, c := range [][]string{{"add", "table", "ip", "kube-proxy"}, {"add", "chain", "ip", "kube-proxy", "services"}, {"add", "table", "ip", "kpipetest-other"}} {
		if out, err := tb.Exec(tb.NodeNS, append([]string{"nft"}, c...)...); err != nil {
			t.Fatalf("nft %q: %v %s", c, err, out)
		}
	}
	start := time.Now()
	code, out := runKpipeOnce(t, "--init-only", "--kubeconfig="+tb.Kubeconfig, "--hostname-override="+testbed.NodeName,
		"--conntrack-tcp-timeout-established=1234s", "--conntrack-max-per-core=1000000")
	if code != 0 {
		t.Fatalf("kpipe --init-only: exit %d:\n%s", code, out)
	}
	t.Logf("kpipe --init-only exited 0 after %v", since(start))
	got, err := tb.Exec(tb.NodeNS, "cat", establishedSysctl)
	if err != nil || strings.TrimSpace(got) != "1234" {
		t.Errorf("%s = %q (%v); want 1234", establishedSysctl, got, err)
	}
	tables, err := tb.Exec(tb.NodeNS, "nft", "list", "tables")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(tables, "table ip kube-proxy") || !strings.Contains(tables, "table ip kpipetest-other") {
		t.Errorf("nftables tables after --init-only:\n%s\nwant ip kube-proxy gone and ip kpipetest-other kept", tables)
	}
}

const routeLocalnetSysctl = "/proc/sys/net/ipv4/conf/all/route_localnet"

// kpipe --init-only sets route_localnet=1 in the node's namespace when NodePorts
// answer on 127.0.0.1 (the default), as kube-proxy's --init-only does, so that
// a daemon with CAP_NET_ADMIN alone can run after it; with
// --iptables-localhost-nodeports=false it leaves it at 0. The daemon, which
// sets it too, is stopped meanwhile.
func TestInitOnlySetsRouteLocalnet(t *testing.T) {
	e := setup(t)
	keepNodeSysctl(t, routeLocalnetSysctl)
	e.restoreKpipeAtEnd()
	if err := e.k.Stop(); err != nil {
		t.Fatalf("stop kpipe: %v", err)
	}
	routeLocalnet := func() string {
		t.Helper()
		v, err := tb.Exec(tb.NodeNS, "cat", routeLocalnetSysctl)
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(v)
	}
	if out, err := tb.Exec(tb.NodeNS, "sh", "-c", "echo 0 > "+routeLocalnetSysctl); err != nil {
		t.Fatalf("set route_localnet=0: %v %s", err, out)
	}
	common := []string{"--init-only", "--kubeconfig=" + tb.Kubeconfig, "--hostname-override=" + testbed.NodeName, "--conntrack-max-per-core=0"}
	for _, c := range []struct {
		flag, want string
	}{{"--iptables-localhost-nodeports=false", "0"}, {"--iptables-localhost-nodeports=true", "1"}} {
		code, out := runKpipeOnce(t, append(common, c.flag)...)
		if code != 0 {
			t.Fatalf("kpipe --init-only %s: exit %d:\n%s", c.flag, code, out)
		}
		if got := routeLocalnet(); got != c.want {
			t.Errorf("after kpipe --init-only %s: route_localnet %s; want %s", c.flag, got, c.want)
		}
	}
}

// makeIPSets makes hash:ip ipsets in the node's namespace (an IPv6 one for a
// KUBE-6- name), destroyed when the test ends if still there.
func makeIPSets(t *testing.T, names ...string) {
	t.Helper()
	err := tb.InNamespace(tb.NodeNS, func() error {
		for _, n := range names {
			family := uint8(syscall.AF_INET)
			if strings.HasPrefix(n, "KUBE-6-") {
				family = syscall.AF_INET6
			}
			if err := netlink.IpsetCreate(n, "hash:ip", netlink.IpsetCreateOptions{Family: family}); err != nil {
				return fmt.Errorf("create ipset %s: %w", n, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tb.InNamespace(tb.NodeNS, func() error {
			for _, n := range names {
				_ = netlink.IpsetDestroy(n)
			}
			return nil
		})
	})
}

// nodeIPSets lists the ipsets in the node's namespace, sorted.
func nodeIPSets(t *testing.T) []string {
	t.Helper()
	var names []string
	err := tb.InNamespace(tb.NodeNS, func() error {
		sets, err := netlink.IpsetListAll()
		for _, s := range sets {
			names = append(names, s.SetName)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(names)
	return names
}
