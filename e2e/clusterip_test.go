package e2e

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// reachFromPodAndNode checks that a ClusterIP with endpoints on pods 1-3 is
// answered from a pod and from the node, and that over 50 requests each
// endpoint answers at least once.
func reachFromPodAndNode(t *testing.T, proto corev1.Protocol, d dialer) {
	e := setup(t)
	svc := e.service("echo", testbed.Port("echo", proto, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2, 3)
	addr := testbed.ClusterAddr(svc, 80)
	want := podIPs(1, 2, 3)
	client := tb.Pod(clientPod)

	start := time.Now()
	a := waitAnswer(t, d, client.NS, addr, 20*time.Second)
	t.Logf("first answer through %s %s after %v: %+v", proto, addr, since(start), a)

	seen := spread(t, d, client.NS, addr, 50)
	t.Logf("from pod %d: answers by endpoint %v", clientPod, seen)
	requireExactly(t, seen, want)
	// Pod-to-service traffic stays inside the cluster CIDR: not masqueraded.
	a, err := d.dial(client.NS, addr)
	if err != nil {
		t.Fatal(err)
	}
	if a.SourceIP() != client.IPv4 {
		t.Errorf("endpoint saw source %s for a request from pod %s; want the pod's own address", a.SeenSource, client.IPv4)
	}

	a = waitAnswer(t, d, tb.NodeNS, addr, 10*time.Second)
	seen = spread(t, d, tb.NodeNS, addr, 50)
	t.Logf("from the node: answers by endpoint %v (source seen: %s)", seen, a.SeenSource)
	requireExactly(t, seen, want)
}

func TestClusterIPTCPFromPodAndNode(t *testing.T) {
	reachFromPodAndNode(t, corev1.ProtocolTCP, tcp(2*time.Second))
}

func TestClusterIPUDPFromPodAndNode(t *testing.T) {
	reachFromPodAndNode(t, corev1.ProtocolUDP, udp(2*time.Second))
}

// A dual-stack service answers on its IPv6 ClusterIP too, from IPv6 endpoints.
func TestClusterIPDualStack(t *testing.T) {
	e := setup(t)
	spec := testbed.Service(e.ns, "dual",
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort))
	policy := corev1.IPFamilyPolicyRequireDualStack
	spec.Spec.IPFamilyPolicy = &policy
	spec.Spec.IPFamilies = []corev1.IPFamily{corev1.IPv4Protocol, corev1.IPv6Protocol}
	svc, err := tb.CreateService(e.ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if len(svc.Spec.ClusterIPs) != 2 {
		t.Fatalf("dual-stack service got ClusterIPs %v", svc.Spec.ClusterIPs)
	}
	e.endpoints(svc, 1, 2)
	if _, err := tb.SetEndpoints(e.ctx, svc, tb.ReadyEndpoints6(1, 2)); err != nil {
		t.Fatal(err)
	}
	client := tb.Pod(clientPod)
	for i, ip := range svc.Spec.ClusterIPs {
		addr := net.JoinHostPort(ip, "80")
		want := podIPs(1, 2)
		self := client.IPv4
		if i == 1 {
			want = []string{tb.Pod(1).IPv6, tb.Pod(2).IPv6}
			self = client.IPv6
		}
		for _, p := range []struct {
			name string
			d    dialer
		}{{"TCP", tcp(2 * time.Second)}, {"UDP", udp(2 * time.Second)}} {
			a := waitAnswer(t, p.d, client.NS, addr, 20*time.Second)
			if a.SourceIP() != self {
				t.Errorf("%s %s: endpoint saw source %s, want the pod's %s", p.name, addr, a.SeenSource, self)
			}
			seen := spread(t, p.d, client.NS, addr, 30)
			t.Logf("%s %s: answers by endpoint %v", p.name, addr, seen)
			requireExactly(t, seen, want)
		}
	}
}

func TestEndpointRemovedAndAdded(t *testing.T) {
	e := setup(t)
	svc := e.service("echo", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2, 3)
	addr := testbed.ClusterAddr(svc, 80)
	from := tb.Pod(clientPod).NS
	d := tcp(2 * time.Second)
	waitAnswer(t, d, from, addr, 20*time.Second)
	requireExactly(t, spread(t, d, from, addr, 50), podIPs(1, 2, 3))

	// Remove pod 3: within a few seconds it stops getting traffic.
	removed := podIP(3)
	e.endpoints(svc, 1, 2)
	start := time.Now()
	testbed.Eventually(t, 10*time.Second, func() error {
		for i := 0; i < 10; i++ {
			a, err := d.dial(from, addr)
			if err != nil {
				return err
			}
			if a.Endpoint == removed {
				return fmt.Errorf("removed endpoint %s still answers", removed)
			}
		}
		return nil
	})
	t.Logf("removed endpoint stopped answering within %v", since(start))
	seen := spread(t, d, from, addr, 30)
	if seen[removed] > 0 {
		t.Fatalf("removed endpoint %s answered %d of 30 requests: %v", removed, seen[removed], seen)
	}
	requireExactly(t, seen, podIPs(1, 2))

	// Add pod 4: it starts getting traffic.
	added := podIP(4)
	e.endpoints(svc, 1, 2, 4)
	start = time.Now()
	testbed.Eventually(t, 10*time.Second, func() error {
		a, err := d.dial(from, addr)
		if err != nil {
			return err
		}
		if a.Endpoint != added {
			return fmt.Errorf("new endpoint %s has not answered yet (last answer from %s)", added, a.Endpoint)
		}
		return nil
	})
	t.Logf("added endpoint answered within %v", since(start))
	requireExactly(t, spread(t, d, from, addr, 50), podIPs(1, 2, 4))
}

func TestServiceDeletedRemovesChains(t *testing.T) {
	e := setup(t)
	svc := e.service("doomed",
		testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("dns", corev1.ProtocolUDP, 53, testbed.EchoPort),
	)
	e.endpoints(svc, 1, 2)
	from := tb.Pod(clientPod).NS
	waitAnswer(t, tcp(2*time.Second), from, testbed.ClusterAddr(svc, 80), 20*time.Second)
	waitAnswer(t, udp(2*time.Second), from, testbed.ClusterAddr(svc, 53), 10*time.Second)

	mention := e.ns + "/" + svc.Name + ":"
	nat := e.iptablesSave("nat")
	for _, port := range []string{"http", "dns"} {
		if c := testbed.ServiceComment(e.ns, svc.Name, port); !strings.Contains(nat, c) {
			t.Fatalf("iptables-save -t nat does not mention %q while the service works:\n%s", c, filterRules(nat, e.ns+"/"))
		}
	}

	// Delete the Service only: its EndpointSlice lingers, as it does until the
	// garbage collector gets to it in a real cluster.
	if err := tb.DeleteService(e.ctx, e.ns, svc.Name); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	testbed.Eventually(t, 10*time.Second, func() error {
		for _, table := range []string{"nat", "filter"} {
			out := e.iptablesSave(table)
			var lines []string
			for _, l := range strings.Split(out, "\n") {
				if strings.Contains(l, mention) || strings.Contains(l, " "+svc.Spec.ClusterIP+"/32 ") {
					lines = append(lines, l)
				}
			}
			if len(lines) > 0 {
				return fmt.Errorf("iptables-save -t %s still mentions the deleted service:\n%s", table, strings.Join(lines, "\n"))
			}
		}
		return nil
	})
	t.Logf("rules gone %v after the delete", since(start))
	if a, err := tb.DialTCP(from, testbed.ClusterAddr(svc, 80), time.Second); err == nil {
		t.Fatalf("deleted service's ClusterIP still answered: %+v", a)
	}
}

func TestNoEndpointsRefused(t *testing.T) {
	e := setup(t)
	svc := e.service("empty", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	addr := testbed.ClusterAddr(svc, 80)
	client := tb.Pod(clientPod).NS

	check := func(what string) {
		t.Helper()
		// Wait until kpipe has programmed the service (refusals start) ...
		testbed.Eventually(t, 20*time.Second, func() error {
			_, err := tb.DialTCP(client, addr, time.Second)
			if !errors.Is(err, testbed.ErrRefused) {
				return fmt.Errorf("%s: want connection refused, got %v", what, err)
			}
			return nil
		})
		// ... then every attempt, from a pod and from the node, is refused at once.
		for _, ns := range []string{client, tb.NodeNS} {
			for i := 0; i < 5; i++ {
				start := time.Now()
				_, err := tb.DialTCP(ns, addr, 3*time.Second)
				took := time.Since(start)
				if !errors.Is(err, testbed.ErrRefused) {
					t.Fatalf("%s: connect from %s: want refused, got %v (after %v)", what, ns, err, took)
				}
				if took >= time.Second {
					t.Fatalf("%s: connect from %s refused only after %v", what, ns, took)
				}
				if i == 0 {
					t.Logf("%s: from %s refused in %v: %v", what, ns, took, err)
				}
			}
		}
	}
	check("no EndpointSlice")

	if _, err := tb.SetEndpoints(e.ctx, svc, nil); err != nil {
		t.Fatal(err)
	}
	check("empty EndpointSlice")

	if _, err := tb.SetEndpoints(e.ctx, svc, []testbed.Endpoint{{IP: podIP(1), Ready: false, Serving: false}}); err != nil {
		t.Fatal(err)
	}
	check("only a not-ready endpoint")
}

func TestUDPConntrackClearedOnEndpointRemoval(t *testing.T) {
	e := setup(t)
	svc := e.service("dns", testbed.Port("dns", corev1.ProtocolUDP, 53, testbed.EchoPort))
	e.endpoints(svc, 1)
	addr := testbed.ClusterAddr(svc, 53)
	client := tb.Pod(clientPod)
	port := 40000 + rand.IntN(10000)
	send := func() (testbed.Answer, error) { return tb.DialUDP(client.NS, addr, time.Second, port) }

	var a testbed.Answer
	testbed.Eventually(t, 20*time.Second, func() error {
		var err error
		a, err = send()
		return err
	})
	if a.Endpoint != podIP(1) {
		t.Fatalf("answered by %s, want the only endpoint %s", a.Endpoint, podIP(1))
	}
	t.Logf("client %s:%d talks to %s through %s", client.IPv4, port, a.Endpoint, addr)
	if ct, err := tb.Exec(tb.NodeNS, "conntrack", "-L", "-p", "udp", "--sport", fmt.Sprint(port)); err == nil {
		t.Logf("conntrack before the change:\n%s", strings.TrimSpace(ct))
	}

	// Keep the flow alive (so its conntrack entry never expires) while the
	// endpoint is replaced.
	e.endpoints(svc, 2)
	start := time.Now()
	var last testbed.Answer
	err := testbed.Poll(15*time.Second, 100*time.Millisecond, func() error {
		a, err := send()
		if err != nil {
			return err
		}
		last = a
		if a.Endpoint != podIP(2) {
			return fmt.Errorf("same flow (source port %d) still answered by %s, want the new endpoint %s", port, a.Endpoint, podIP(2))
		}
		return nil
	})
	if err != nil {
		if ct, cerr := tb.Exec(tb.NodeNS, "conntrack", "-L", "-p", "udp", "--sport", fmt.Sprint(port)); cerr == nil {
			t.Logf("conntrack now:\n%s", strings.TrimSpace(ct))
		}
		t.Fatal(err)
	}
	t.Logf("same flow answered by the new endpoint %v after the change: %+v", since(start), last)
}

func TestCanaryRepairsFlushedNAT(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)
	e.repairsFlushedNAT(svc, addr, client, 10*time.Second) // canary interval is 1s: "a few" of them
}

// repairsFlushedNAT flushes the node's nat table behind kpipe's back (its rules,
// then its rules and chains) and expects svc at addr to answer from client again
// within the given time, its NAT rules back.
func (e *env) repairsFlushedNAT(svc *corev1.Service, addr, client string, within time.Duration) {
	t := e.t
	t.Helper()
	for _, round := range []struct {
		name string
		cmd  []string
	}{
		{"flush nat rules", []string{"iptables", "-t", "nat", "-F"}},
		// In one transaction: kpipe repairs fast enough to jump to its chains
		// again between an "iptables -F" and an "iptables -X" (then EBUSY).
		{"flush and delete nat chains", []string{"sh", "-c", `printf '*nat\nCOMMIT\n' | iptables-restore`}},
	} {
		if _, err := tb.Exec(tb.NodeNS, round.cmd...); err != nil {
			t.Fatalf("%s: %v", round.name, err)
		}
		start := time.Now()
		_, err := tb.DialTCP(client, addr, 200*time.Millisecond)
		t.Logf("%s: right after: %v", round.name, errString(err))
		testbed.Eventually(t, within, func() error {
			_, err := tb.DialTCP(client, addr, 500*time.Millisecond)
			return err
		})
		t.Logf("%s: service answers again %v later", round.name, since(start))
		if nat := e.iptablesSave("nat"); !strings.Contains(nat, testbed.ServiceComment(e.ns, svc.Name, "http")) {
			t.Fatalf("%s: service works but its NAT rules are not back:\n%s", round.name, filterRules(nat, e.ns+"/"))
		}
	}
}

func errString(err error) string {
	if err == nil {
		return "answered (already repaired)"
	}
	return err.Error()
}

// A pod that is itself an endpoint of a service reaches every endpoint through
// it, itself included (hairpin), and the other endpoints see its own address:
// like kube-proxy, only traffic that loops back to its sender is masqueraded.
func TestEndpointPodCallingItsOwnService(t *testing.T) {
	e := setup(t)
	svc := e.service("echo", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2, 3)
	addr := testbed.ClusterAddr(svc, 80)
	self := tb.Pod(1)
	waitAnswer(t, tcp(2*time.Second), self.NS, addr, 20*time.Second)

	seen := map[string]int{}
	sources := map[string]map[string]int{}
	for i := 0; i < 60; i++ {
		a, err := tb.DialTCP(self.NS, addr, 2*time.Second)
		if err != nil {
			t.Fatalf("request %d from endpoint pod %s: %v (answers so far %v)", i+1, self.IPv4, err, seen)
		}
		seen[a.Endpoint]++
		if sources[a.Endpoint] == nil {
			sources[a.Endpoint] = map[string]int{}
		}
		sources[a.Endpoint][a.SourceIP()]++
	}
	t.Logf("from endpoint pod %s: source seen, by answering endpoint: %v", self.IPv4, sources)
	requireExactly(t, seen, podIPs(1, 2, 3))
	for ep, src := range sources {
		if ep == self.IPv4 {
			continue
		}
		for ip, n := range src {
			if ip != self.IPv4 {
				t.Errorf("endpoint %s saw %d requests from pod %s come from %s, want the pod's own address (only hairpin traffic to itself needs masquerading)", ep, n, self.IPv4, ip)
			}
		}
	}
}

// SCTP services are programmed like the others. (The test kernel has no SCTP
// sockets, so no traffic: the rules are what can be checked.)
func TestClusterIPSCTPRules(t *testing.T) {
	e := setup(t)
	svc := e.service("sctp", testbed.Port("assoc", corev1.ProtocolSCTP, 9000, testbed.EchoPort))
	e.endpoints(svc, 1, 2)
	comment := testbed.ServiceComment(e.ns, svc.Name, "assoc")
	rule := func(l string) bool {
		return strings.Contains(l, comment) && strings.Contains(l, "-p sctp")
	}
	testbed.Eventually(t, 20*time.Second, func() error {
		nat := e.iptablesSave("nat")
		dnat := 0
		for _, l := range strings.Split(nat, "\n") {
			if rule(l) && strings.Contains(l, "-j DNAT") {
				dnat++
			}
		}
		if dnat != 2 {
			return fmt.Errorf("want 2 SCTP DNAT rules for %s, have %d:\n%s", comment, dnat, filterRules(nat, e.ns+"/"))
		}
		return nil
	})
	if err := tb.DeleteService(e.ctx, e.ns, svc.Name); err != nil {
		t.Fatal(err)
	}
	testbed.Eventually(t, 10*time.Second, func() error {
		if nat := e.iptablesSave("nat"); strings.Contains(nat, comment) {
			return fmt.Errorf("deleted SCTP service still in the NAT table:\n%s", filterRules(nat, e.ns+"/"))
		}
		return nil
	})
}

// TestPeriodicSyncRepairsDeletedRules: rules removed by hand that the canary cannot
// see (the jump from PREROUTING, the KUBE-SERVICES rule that sends the service's
// addresses to their bucket) come back within the sync period (5 s here), as
// kube-proxy's periodic sync brings them back.
func TestPeriodicSyncRepairsDeletedRules(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)

	nat := e.iptablesSave("nat")
	ip := net.ParseIP(svc.Spec.ClusterIP).To4()
	bucket := fmt.Sprintf(`"services in %d.%d.0.0/16"`, ip[0], ip[1])
	serviceRule := ""
	for _, l := range strings.Split(nat, "\n") {
		if strings.HasPrefix(l, "-A KUBE-SERVICES ") && strings.Contains(l, bucket) {
			serviceRule = l
		}
	}
	if serviceRule == "" {
		t.Fatalf("no KUBE-SERVICES rule for the service's bucket %s:\n%s", bucket, nat)
	}
	for _, round := range []struct {
		name string
		del  []string
	}{
		{"the jump from PREROUTING", []string{"iptables", "-t", "nat", "-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"}},
		{"the KUBE-SERVICES rule for the service's bucket", append([]string{"iptables", "-t", "nat", "-D"}, ruleArgs(strings.TrimPrefix(serviceRule, "-A "))...)},
	} {
		if out, err := tb.Exec(tb.NodeNS, round.del...); err != nil {
			t.Fatalf("delete %s: %v %s", round.name, err, out)
		}
		start := time.Now()
		if _, err := tb.DialTCP(client, addr, 500*time.Millisecond); err == nil {
			t.Fatalf("deleted %s, yet the service still answers: the test deleted nothing that matters", round.name)
		}
		testbed.Eventually(t, 15*time.Second, func() error {
			_, err := tb.DialTCP(client, addr, 500*time.Millisecond)
			return err
		})
		t.Logf("deleted %s: the service answers again %v later", round.name, since(start))
	}
}

// ruleArgs splits an iptables-save rule into arguments, keeping "quoted words" whole.
func ruleArgs(rule string) []string {
	var args []string
	for i, part := range strings.Split(rule, `"`) {
		if i%2 == 1 {
			args = append(args, part)
		} else {
			args = append(args, strings.Fields(part)...)
		}
	}
	return args
}
