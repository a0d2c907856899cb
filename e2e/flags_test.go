package e2e

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// Every --detect-local-mode tells pod traffic from the rest: a pod reaching a
// ClusterIP keeps its own source IP, the external client reaching it (through
// a route to the service range) is masqueraded to a node address, and a pod
// reaching an externalTrafficPolicy Local NodePort with no local endpoint is
// short-circuited to the remote endpoints.
func TestDetectLocalModes(t *testing.T) {
	e := setup(t)
	svc := e.service("echo", testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2)
	spec := typed(e.ns, "local", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	spec.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	lsvc := e.create(spec)
	e.setEndpoints(lsvc, remote(3))
	addr := testbed.ClusterAddr(svc, 80)
	np := testbed.NodePortOf(lsvc, "tcp")
	pod := tb.Pod(clientPod)

	for _, m := range []struct {
		mode  string
		flags []string
		match string // the "not local" match in the ClusterIP's masquerade rule
	}{
		{"ClusterCIDR", nil, "! -s " + testbed.ClusterCIDR},
		{"NodeCIDR", []string{"--detect-local-mode=NodeCIDR"}, "! -s " + testbed.PodCIDRIPv4},
		{"BridgeInterface", []string{"--detect-local-mode=BridgeInterface", "--pod-bridge-interface=" + testbed.BridgeName}, "! -i " + testbed.BridgeName},
		{"InterfaceNamePrefix", []string{"--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=kpbr"}, "! -i kpbr+"},
	} {
		if m.flags != nil {
			e.restartKpipe(m.flags...)
		}
		expectExactly(t, m.mode+": ClusterIP from a pod, not masqueraded", tcp2, pod.NS, addr, podIPs(1, 2), pod.IPv4)
		expectExactly(t, m.mode+": ClusterIP from the client, masqueraded", tcp2, tb.ClientNS, addr, podIPs(1, 2), nodeAddrs4...)
		expectExactly(t, m.mode+": Local NodePort from a pod, no local endpoint: short-circuit", tcp2, pod.NS, testbed.HostPort(testbed.BridgeIPv4, np), podIPs(3), pod.IPv4)
		nat := e.iptablesSave("nat")
		comment := testbed.ServiceComment(e.ns, svc.Name, "tcp") + " cluster IP"
		if rules := rulesMatching(nat, comment, " "+m.match+" ", "-j KUBE-MARK-MASQ"); len(rules) != 1 {
			t.Fatalf("%s: want the ClusterIP's masquerade rule with %q, found %q:\n%s", m.mode, m.match, rules, filterRules(nat, e.ns+"/"))
		}
	}
}

// --masquerade-all: even a pod reaching a ClusterIP is masqueraded (the
// endpoint sees a node address), where by default it keeps its own source.
func TestMasqueradeAll(t *testing.T) {
	e := setup(t)
	svc := e.service("echo", testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2)
	addr := testbed.ClusterAddr(svc, 80)
	pod := tb.Pod(clientPod)
	expectExactly(t, "default: ClusterIP from a pod keeps the pod's source", tcp2, pod.NS, addr, podIPs(1, 2), pod.IPv4)

	e.restartKpipe("--masquerade-all")
	expectExactly(t, "--masquerade-all: ClusterIP from a pod, masqueraded", tcp2, pod.NS, addr, podIPs(1, 2), nodeAddrs4...)
	expectExactly(t, "--masquerade-all: ClusterIP from the client, masqueraded", tcp2, tb.ClientNS, addr, podIPs(1, 2), nodeAddrs4...)
}

// --iptables-masquerade-bit=5: the rules use mark 0x20, and NodePort traffic
// from the client (Cluster policy, masqueraded) still works. Back on the
// default, the mark is 0x4000 again and 0x20 is gone.
func TestMasqueradeBit(t *testing.T) {
	e := setup(t)
	svc := e.create(typed(e.ns, "np", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	np := testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(svc, "tcp"))
	marks := func(what, want, gone string) {
		t.Helper()
		nat, filter := e.iptablesSave("nat"), e.iptablesSave("filter")
		for _, c := range []struct{ table, save, rule string }{
			// iptables-save shows --or-mark M as --set-xmark M/M and
			// --xor-mark M as --set-xmark M/0x0.
			{"nat", nat, "-A KUBE-MARK-MASQ -j MARK --set-xmark " + want + "/" + want},
			{"nat", nat, "-A KUBE-POSTROUTING -m mark ! --mark " + want + "/" + want + " -j RETURN"},
			{"nat", nat, "-A KUBE-POSTROUTING -j MARK --set-xmark " + want + "/0x0"},
			{"filter", filter, "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark " + want + "/" + want + " -j ACCEPT"},
		} {
			if len(rulesMatching(c.save, c.rule)) == 0 {
				t.Fatalf("%s: no %q in %s:\n%s", what, c.rule, c.table, filterRules(c.save, e.ns+"/"))
			}
		}
		stale := regexp.MustCompile(`mark ` + gone + `(/|\s|$)`)
		for table, save := range map[string]string{"nat": nat, "filter": filter} {
			for _, l := range strings.Split(save, "\n") {
				if stale.MatchString(l) {
					t.Fatalf("%s: mark %s still in %s: %s", what, gone, table, l)
				}
			}
		}
	}

	e.restartKpipe("--iptables-masquerade-bit=5")
	marks("masquerade bit 5", "0x20", "0x4000")
	expectExactly(t, "masquerade bit 5: NodePort from the client", tcp2, tb.ClientNS, np, podIPs(1, 2), nodeAddrs4...)
	expectExactly(t, "masquerade bit 5: NodePort from the node", tcp2, tb.NodeNS, np, podIPs(1, 2))

	e.restoreKpipe()
	marks("back on the default bit 14", "0x4000", "0x20")
	expectExactly(t, "default bit: NodePort from the client", tcp2, tb.ClientNS, np, podIPs(1, 2), nodeAddrs4...)
}

// KUBE-FORWARD drops packets conntrack finds INVALID, unless the node's
// nf_conntrack_tcp_be_liberal is 1 when kpipe starts. The drop is shown with
// traffic: SYN+FIN segments (an invalid flag combination) forwarded from the
// client to a pod raise that rule's packet counter.
func TestInvalidDropRule(t *testing.T) {
	e := setup(t)
	// With or without the nfacct match that counts the drops (TestNFAcctMetrics).
	rule := []string{"-A KUBE-FORWARD -m conntrack --ctstate INVALID ", " -j DROP"}
	hasRule := func() bool { return len(rulesMatching(e.iptablesSave("filter"), rule...)) > 0 }
	setSysctl := func(v string) error {
		_, err := tb.Exec(tb.NodeNS, "sysctl", "-q", "-w", liberalSysctl+"="+v)
		return err
	}
	requireStrictConntrack(t)

	if !hasRule() {
		t.Fatalf("liberal conntrack off, but no %q in the filter table:\n%s", rule, e.iptablesSave("filter"))
	}
	// Dropped SYN+FIN segments count on the rule. (A full resync would reset
	// the counter, hence the retry.)
	target := tb.Pod(1)
	testbed.Eventually(t, 10*time.Second, func() error {
		before, err := invalidDrops()
		if err != nil {
			return err
		}
		const n = 5
		if err := sendSynFin(target.IPv4, 40000, n); err != nil {
			return err
		}
		var after int
		err = testbed.Poll(2*time.Second, 50*time.Millisecond, func() error {
			after, err = invalidDrops()
			if err != nil {
				return err
			}
			if after < before+n {
				return fmt.Errorf("INVALID DROP counter went from %d to %d after %d SYN+FIN segments from the client to %s", before, after, n, target.IPv4)
			}
			return nil
		})
		if err == nil {
			t.Logf("INVALID DROP counter: %d -> %d after %d SYN+FIN segments client -> %s:%d", before, after, n, target.IPv4, testbed.EchoPort)
		}
		return err
	})

	// Liberal conntrack: after a restart kpipe leaves the rule out.
	e.restoreKpipeAtEnd()
	t.Cleanup(func() { // runs before the restart that restores kpipe (cleanups are LIFO)
		if err := setSysctl("0"); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := setSysctl("1"); err != nil {
		t.Fatal(err)
	}
	e.restartKpipe()
	if hasRule() {
		t.Fatalf("%s=1 when kpipe started, yet %q is in the filter table", liberalSysctl, rule)
	}
	t.Logf("%s=1: no INVALID drop rule in KUBE-FORWARD", liberalSysctl)
	svc := e.service("echo", testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2)
	expectExactly(t, "liberal conntrack: a ClusterIP still works", tcp2, tb.Pod(clientPod).NS, testbed.ClusterAddr(svc, 80), podIPs(1, 2))

	// And back.
	if err := setSysctl("0"); err != nil {
		t.Fatal(err)
	}
	e.restoreKpipe()
	if !hasRule() {
		t.Fatalf("%s=0 again and kpipe restarted, but no %q", liberalSysctl, rule)
	}
}

// invalidDrops is the packet counter of KUBE-FORWARD's INVALID DROP rule.
func invalidDrops() (int, error) {
	out, err := tb.Exec(tb.NodeNS, "iptables", "-w", "-t", "filter", "-L", "KUBE-FORWARD", "-v", "-x", "-n")
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) > 3 && f[2] == "DROP" && strings.Contains(l, "ctstate INVALID") {
			return strconv.Atoi(f[0])
		}
	}
	return 0, fmt.Errorf("no INVALID DROP rule in KUBE-FORWARD:\n%s", out)
}

const liberalSysctl = "net.netfilter.nf_conntrack_tcp_be_liberal"

// requireStrictConntrack fails the test unless the node namespace's conntrack
// is strict (nf_conntrack_tcp_be_liberal 0, the test bed's): only then does
// kpipe write KUBE-FORWARD's INVALID drop rule.
func requireStrictConntrack(t *testing.T) {
	t.Helper()
	if out, err := tb.Exec(tb.NodeNS, "sysctl", "-n", liberalSysctl); err != nil || strings.TrimSpace(out) != "0" {
		t.Fatalf("%s in the node namespace: %q, %v; want 0 (else there is no INVALID drop rule)", liberalSysctl, out, err)
	}
}

// sendSynFin sends n SYN+FIN segments (an invalid flag combination, dropped as
// INVALID in KUBE-FORWARD) from the client to ip's echo port, from source
// ports firstPort on.
func sendSynFin(ip string, firstPort, n int) error {
	for i := range n {
		if err := tb.SendTCPSegment(tb.ClientNS, testbed.ClientIPv4, ip, uint16(firstPort+i), testbed.EchoPort, testbed.TCPSyn|testbed.TCPFin); err != nil {
			return err
		}
	}
	return nil
}

// oneShot runs bin with args and --write-config-to, so that a command line
// kube-proxy and kpipe accept writes a file and exits 0 instead of running
// (both validate everything first): the exit code and the output.
func oneShot(t *testing.T, bin string, args ...string) (int, string) {
	t.Helper()
	args = append(args, "--write-config-to="+filepath.Join(t.TempDir(), "written.conf"))
	return runOnce(t, 30*time.Second, bin, args...)
}

// oneShotBinaries are upstream kube-proxy's binary and kpipe's.
func oneShotBinaries(t *testing.T) (kubeProxy, kpipe string) {
	t.Helper()
	if kpipeErr != nil {
		t.Fatalf("kpipe unavailable: %v", kpipeErr)
	}
	kp, err := tb.KubeProxy("iptables", t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	return kp.Bin, tb.Kpipe().Bin
}

// Command lines and configuration files kube-proxy v1.34 refuses, kpipe
// refuses the same way: exit 1, the bad value named. Those it accepts, kpipe
// accepts (exit 0).
func TestValidationAsKubeProxy(t *testing.T) {
	kubeProxy, kpipe := oneShotBinaries(t)
	config := func(old, new string) string {
		text := kubeadmConfigText(t)
		if !strings.Contains(text, old) {
			t.Fatalf("kubeadm's file has no %q", old)
		}
		return "--config=" + configFile(t, strings.Replace(text, old, new, 1))
	}
	for _, tt := range []struct {
		args    []string
		mention string // "" for a command line both accept
	}{
		{[]string{"--no-such-flag"}, "no-such-flag"},
		{[]string{"--kube-api-qps=fast"}, "fast"},
		{[]string{"an-argument"}, "an-argument"},
		{[]string{"--config=/no/such/file"}, "/no/such/file"},
		{[]string{"--iptables-masquerade-bit=32"}, "32"},
		{[]string{"--healthz-bind-address=nope"}, "nope"},
		{[]string{"--healthz-bind-address=1.2.3.4:99999"}, "99999"},
		{[]string{"--metrics-bind-address=127.0.0.1:metrics"}, "127.0.0.1:metrics"},
		{[]string{"--bind-address=node-1"}, "node-1"},
		{[]string{"--hostname-override=  "}, "hostname-override"},
		{[]string{"--cluster-cidr=10.0.0.0/8,10.1.0.0/16"}, "10.1.0.0/16"},
		{[]string{"--cluster-cidr=10.0.0.0/8,fd00::/64,fd01::/64"}, "fd01::/64"},
		{[]string{"--feature-gates=NoSuchGate=true"}, "NoSuchGate"},
		{[]string{"--feature-gates=NFTablesProxyMode=false"}, "NFTablesProxyMode"},
		{[]string{config(`healthzBindAddress: ""`, "healthzBindAddress: 1.2.3.4:70000")}, "70000"},
		{[]string{config("clusterCIDR: "+testbed.ClusterCIDR, "clusterCIDR: fd00::/64,fd01::/64")}, "fd01::/64"},
		{[]string{config("bindAddressHardFail: false", "bindAddressHardFail: false\nfeatureGates: {NoSuchGate: true}")}, "NoSuchGate"},
		{[]string{"--cluster-cidr=10.0.0.0/8,fd00::/64", "--healthz-bind-address=[::1]:10256", "--hostname-override=Node-1"}, ""},
		{[]string{"--detect-local-mode=NodeCIDR", "--cluster-cidr=10.0.0.0/8,10.1.0.0/16"}, ""},
		{[]string{"--feature-gates=AllAlpha=true,NFTablesProxyMode=true", "--log-text-split-stream=false", "--boot-id-file=/x", "--machine-id-file=/y"}, ""},
	} {
		want := 1
		if tt.mention == "" {
			want = 0
		}
		for _, bin := range []string{kubeProxy, kpipe} {
			code, out := oneShot(t, bin, tt.args...)
			if code != want || !strings.Contains(out, tt.mention) {
				t.Errorf("%s %q: exit %d; want %d naming %q; output:\n%s", filepath.Base(bin), tt.args, code, want, tt.mention, out)
			}
		}
	}
}

// Every feature gate kube-proxy's --help lists (its alpha, beta and
// deprecated gates), set against its default, is accepted or refused by kpipe
// as by kube-proxy; the same name in lower case (gate names are
// case-sensitive) is refused by both.
func TestFeatureGatesAsKubeProxy(t *testing.T) {
	kubeProxy, kpipe := oneShotBinaries(t)
	help, err := exec.Command(kubeProxy, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("kube-proxy --help: %v\n%s", err, help)
	}
	listed := regexp.MustCompile(`(?m)^\s+([A-Za-z0-9]+)=true\|false \([A-Z]+ - default=(true|false)\)$`).FindAllStringSubmatch(string(help), -1)
	if len(listed) < 100 {
		t.Fatalf("kube-proxy --help lists %d feature gates; want its 100 and more:\n%s", len(listed), help)
	}
	for _, g := range listed {
		flipped := fmt.Sprintf("--feature-gates=%s=%v", g[1], g[2] != "true")
		unknown := "--feature-gates=" + strings.ToLower(g[1]) + "=" + g[2]
		for _, gate := range []string{flipped, unknown} {
			kpCode, kpOut := oneShot(t, kubeProxy, gate)
			code, out := oneShot(t, kpipe, gate)
			if code != kpCode || gate == unknown && code != 1 {
				t.Errorf("%s: kpipe exit %d, kube-proxy exit %d (want 1 for an unknown name)\nkpipe: %s\nkube-proxy: %s", gate, code, kpCode, out, kpOut)
			}
		}
	}
	if !t.Failed() {
		t.Logf("%d feature gates, each set against its default and named in lower case: kpipe exits as kube-proxy does", len(listed))
	}
}
