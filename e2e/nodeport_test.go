package e2e

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// NodePorts answer on the node's addresses from outside (the client), from a
// pod and from the node itself, over TCP and UDP; with the Cluster policy the
// endpoints see a node address (masqueraded). Before the service has
// endpoints, its NodePort refuses. SCTP has its rules (no SCTP sockets here).
func TestNodePortTCPUDP(t *testing.T) {
	e := setup(t)
	svc := e.create(typed(e.ns, "np", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort),
		testbed.Port("sctp", corev1.ProtocolSCTP, 80, testbed.EchoPort)))
	npTCP, npUDP, npSCTP := testbed.NodePortOf(svc, "tcp"), testbed.NodePortOf(svc, "udp"), testbed.NodePortOf(svc, "sctp")
	if npTCP == 0 || npUDP == 0 || npSCTP == 0 {
		t.Fatalf("nodePorts not allocated: %+v", svc.Spec.Ports)
	}
	t.Logf("nodePorts: tcp %d, udp %d, sctp %d", npTCP, npUDP, npSCTP)
	client, pod := tb.ClientNS, tb.Pod(clientPod).NS

	eventuallyRefused(t, "no endpoints yet, TCP", tcp1, client, testbed.HostPort(testbed.NodeIPv4, npTCP))
	eventuallyRefused(t, "no endpoints yet, UDP", udp1, client, testbed.HostPort(testbed.NodeIPv4, npUDP))

	e.endpoints(svc, 1, 2, 3)
	want := podIPs(1, 2, 3)
	for _, c := range []struct {
		from, ip string
		masq     bool // the endpoint must see a node address
	}{
		{client, testbed.NodeIPv4, true},
		{pod, testbed.BridgeIPv4, false},
		{pod, testbed.NodeIPv4, false},
		{tb.NodeNS, testbed.NodeIPv4, false},
		{tb.NodeNS, testbed.BridgeIPv4, false},
	} {
		for _, p := range []struct {
			name string
			d    dialer
			port int32
		}{{"TCP", tcp2, npTCP}, {"UDP", udp2, npUDP}} {
			what := fmt.Sprintf("%s NodePort on %s from %s", p.name, c.ip, short(c.from))
			var sources []string
			if c.masq {
				sources = nodeAddrs4
			}
			expectExactly(t, what, p.d, c.from, testbed.HostPort(c.ip, p.port), want, sources...)
		}
	}

	nat := e.iptablesSave("nat")
	comment := testbed.ServiceComment(e.ns, svc.Name, "sctp")
	rules := rulesMatching(nat, "-A KUBE-NODEPORTS", comment, "-p sctp", "--dport "+strconv.Itoa(int(npSCTP)), "-j KUBE-EXT-")
	// Not the rule before it that only counts packets to 127.0.0.0/8 (nfacct).
	rules = slices.DeleteFunc(rules, func(r string) bool { return strings.Contains(r, "--nfacct-name") })
	if len(rules) != 1 {
		t.Fatalf("want one SCTP rule for nodePort %d in KUBE-NODEPORTS, found %q:\n%s", npSCTP, rules, filterRules(nat, e.ns+"/"))
	}
	ext := rules[0][strings.Index(rules[0], "-j KUBE-EXT-")+3:]
	if n := len(rulesMatching(nat, "-A "+ext+" ")); n == 0 {
		t.Fatalf("SCTP nodePort jumps to %s, which has no rules:\n%s", ext, filterRules(nat, e.ns+"/"))
	}
	t.Logf("SCTP: %s", rules[0])
}

// --nodeport-addresses with CIDRs: NodePorts answer only on local addresses in
// them, including one added while kpipe runs; a family without a CIDR keeps
// NodePorts on all its addresses (kube-proxy's rule).
func TestNodePortAddresses(t *testing.T) {
	e := setup(t)
	svc := e.create(dualStack(typed(e.ns, "np", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))))
	e.endpoints(svc, 1, 2)
	e.setEndpoints(svc, tb.ReadyEndpoints6(1, 2))
	np := testbed.NodePortOf(svc, "tcp")
	client, pod := tb.ClientNS, tb.Pod(clientPod).NS

	e.restartKpipe("--nodeport-addresses=198.51.100.0/24")
	expectExactly(t, "NodePort on the node's address in 198.51.100.0/24", tcp2, client, testbed.HostPort(testbed.NodeIPv4, np), podIPs(1, 2), nodeAddrs4...)
	eventuallyUnanswered(t, "NodePort on the bridge address (outside the CIDRs)", tcp1, pod, testbed.HostPort(testbed.BridgeIPv4, np))
	eventuallyUnanswered(t, "NodePort on 127.0.0.1 (outside the CIDRs)", tcp1, tb.NodeNS, testbed.HostPort("127.0.0.1", np))
	expectExactly(t, "IPv6 NodePort (no IPv6 CIDR given: every address)", tcp2, client, testbed.HostPort(testbed.NodeIPv6, np), podIPs6(1, 2))

	// An address added to the node later, inside the CIDR, gets the NodePort.
	addAddress(t, tb.NodeNS, "eth0", nodeAltIPv4+"/24")
	start := time.Now()
	expectExactly(t, "NodePort on an address added while kpipe runs", tcp2, client, testbed.HostPort(nodeAltIPv4, np), podIPs(1, 2), nodeAddrs4...)
	t.Logf("the added address %s answered %v after it was added", nodeAltIPv4, since(start))
	eventuallyUnanswered(t, "NodePort on the bridge address, still", tcp1, pod, testbed.HostPort(testbed.BridgeIPv4, np))
}

// With default flags a NodePort answers on 127.0.0.1 inside the node
// (localhost NodePorts); with --iptables-localhost-nodeports=false it does not,
// while the node's other addresses still work.
func TestNodePortLocalhost(t *testing.T) {
	e := setup(t)
	svc := e.create(typed(e.ns, "np", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	npTCP, npUDP := testbed.NodePortOf(svc, "tcp"), testbed.NodePortOf(svc, "udp")
	node := tb.NodeNS

	expectExactly(t, "TCP NodePort on 127.0.0.1", tcp2, node, testbed.HostPort("127.0.0.1", npTCP), podIPs(1, 2), nodeAddrs4...)
	expectExactly(t, "UDP NodePort on 127.0.0.1", udp2, node, testbed.HostPort("127.0.0.1", npUDP), podIPs(1, 2), nodeAddrs4...)

	e.restartKpipe("--iptables-localhost-nodeports=false")
	// The UDP flows of the requests above keep their DNAT (as with kube-proxy,
	// whose clean-up keeps a flow whose endpoint still serves): a new request
	// that happened to reuse one of their source ports would be answered
	// through it (seen once). The check is about new flows, so those go.
	if out, err := tb.Exec(node, "conntrack", "-D", "-p", "udp", "--orig-dst", "127.0.0.1", "--dport", strconv.Itoa(int(npUDP))); err != nil && !strings.Contains(err.Error(), "0 flow entries") {
		t.Fatalf("delete the earlier UDP flows: %v: %s", err, out)
	}
	eventuallyUnanswered(t, "TCP NodePort on 127.0.0.1 with localhost NodePorts off", tcp1, node, testbed.HostPort("127.0.0.1", npTCP))
	eventuallyUnanswered(t, "UDP NodePort on 127.0.0.1 with localhost NodePorts off", udp1, node, testbed.HostPort("127.0.0.1", npUDP))
	expectExactly(t, "TCP NodePort on the node's address, localhost NodePorts off", tcp2, node, testbed.HostPort(testbed.NodeIPv4, npTCP), podIPs(1, 2))
	expectExactly(t, "TCP NodePort from the client, localhost NodePorts off", tcp2, tb.ClientNS, testbed.HostPort(testbed.NodeIPv4, npTCP), podIPs(1, 2), nodeAddrs4...)
}

// --nodeport-addresses=primary: NodePorts answer only on the node's primary
// InternalIP as its Node object gives it, and follow the Node object when that
// address changes.
func TestNodeAddressesFromNodeObject(t *testing.T) {
	e := setup(t)
	svc := e.create(typed(e.ns, "np", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	np := testbed.NodePortOf(svc, "tcp")
	client, pod := tb.ClientNS, tb.Pod(clientPod).NS
	addAddress(t, tb.NodeNS, "eth0", nodeAltIPv4+"/24")
	t.Cleanup(func() {
		if _, err := tb.UpdateNodeStatus(e.ctx, func(n *corev1.Node) { n.Status.Addresses = testbed.NodeAddresses() }); err != nil {
			t.Errorf("cleanup: restore the node's addresses: %v", err)
		}
	})

	e.restartKpipe("--nodeport-addresses=primary")
	primary, other := testbed.HostPort(testbed.NodeIPv4, np), testbed.HostPort(nodeAltIPv4, np)
	expectExactly(t, "NodePort on the primary InternalIP", tcp2, client, primary, podIPs(1, 2), nodeAddrs4...)
	eventuallyUnanswered(t, "NodePort on a second address of eth0", tcp1, client, other)
	eventuallyUnanswered(t, "NodePort on the bridge address", tcp1, pod, testbed.HostPort(testbed.BridgeIPv4, np))

	if _, err := tb.UpdateNodeStatus(e.ctx, func(n *corev1.Node) {
		n.Status.Addresses = []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: nodeAltIPv4},
			{Type: corev1.NodeInternalIP, Address: testbed.NodeIPv6},
			{Type: corev1.NodeHostName, Address: testbed.NodeName},
		}
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("Node %s: InternalIP changed to %s", testbed.NodeName, nodeAltIPv4)
	start := time.Now()
	expectExactly(t, "NodePort on the new primary InternalIP", tcp2, client, other, podIPs(1, 2), nodeAddrs4...)
	t.Logf("NodePort moved to %s within %v", nodeAltIPv4, since(start))
	eventuallyUnanswered(t, "NodePort on the old InternalIP", tcp1, client, primary)
}
