package e2e

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// kpipe explain reads the rules upstream kube-proxy's iptables mode writes
// (it is meant to be useful before and after a swap): on a node run by
// kube-proxy, each request series below is put to explain, as every feature
// test's is (explainAgrees), and its prediction must be what the packets did
// — a ClusterIP, a NodePort, externalTrafficPolicy Local with and without
// local endpoints, and Services without endpoints. It names the Service behind
// a refusal, and with --kubeconfig the policy behind a drop.
func TestExplainKubeProxyRules(t *testing.T) {
	e := setup(t)
	kp := e.kubeProxy("iptables")
	t.Cleanup(func() { // runs first: kpipe then starts as on a fresh node, without kube-proxy's KUBE-FIREWALL
		if err := kp.Stop(); err != nil {
			t.Errorf("stop kube-proxy: %v", err)
		}
		removeKubeFirewall(t)
	})
	e.toKubeProxy(kp)
	pod, client := tb.Pod(clientPod), tb.ClientNS
	before := explained.Load()

	web := e.create(typed(e.ns, "web", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort)))
	e.endpoints(web, 1, 2)
	expectExactly(t, "kube-proxy: TCP ClusterIP from a pod", tcp2, pod.NS, testbed.ClusterAddr(web, 80), podIPs(1, 2), pod.IPv4)
	expectExactly(t, "kube-proxy: UDP ClusterIP from a pod", udp2, pod.NS, testbed.ClusterAddr(web, 80), podIPs(1, 2), pod.IPv4)
	expectExactly(t, "kube-proxy: TCP ClusterIP from the node", tcp2, tb.NodeNS, testbed.ClusterAddr(web, 80), podIPs(1, 2))
	expectExactly(t, "kube-proxy: NodePort from outside (masqueraded)", tcp2, client,
		testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(web, "tcp")), podIPs(1, 2), nodeAddrs4...)

	spec := typed(e.ns, "local", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	spec.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	lsvc := e.create(spec)
	np := testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(lsvc, "tcp"))
	e.setEndpoints(lsvc, remote(1), local(3))
	expectExactly(t, "kube-proxy: Local NodePort from outside, a local endpoint (source kept)", tcp2, client, np, podIPs(3), testbed.ClientIPv4)
	e.setEndpoints(lsvc, remote(1))
	eventuallyDropped(t, "kube-proxy: Local NodePort from outside, no local endpoint", tcp1, client, np)

	empty := e.create(typed(e.ns, "empty", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
	eventuallyRefused(t, "kube-proxy: ClusterIP without endpoints", tcp1, pod.NS, testbed.ClusterAddr(empty, 80))
	eventuallyRefused(t, "kube-proxy: NodePort without endpoints", tcp1, client, testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(empty, "tcp")))

	if n := explained.Load() - before; n != 8 {
		t.Fatalf("%d request series put to kpipe explain; want 8", n)
	}
	// What the operator reads names the Service and why it refuses.
	out, err := tb.Exec(tb.NodeNS, tb.Kpipe().Bin, "explain", "--from", "pod", "--src", pod.IPv4, "--dst", testbed.ClusterAddr(empty, 80))
	if err != nil {
		t.Fatal(err)
	}
	if want := "REJECT by a rule of filter/KUBE-SERVICES: " + e.ns + "/empty:tcp has no endpoints"; !strings.Contains(out, want) {
		t.Fatalf("kpipe explain on kube-proxy's rules does not say %q:\n%s", want, out)
	}
	t.Logf("kpipe explain, on kube-proxy's rules:\n%s", out)

	// With --kubeconfig it says what the apiserver holds of the Service
	// behind the drop: the policy that made it.
	out, err = tb.Exec(tb.NodeNS, tb.Kpipe().Bin, "explain", "--from", "outside", "--src", testbed.ClientIPv4, "--dst", np, "--kubeconfig", tb.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if want := e.ns + "/local: type NodePort, externalTrafficPolicy Local"; !strings.Contains(out, want) {
		t.Fatalf("kpipe explain --kubeconfig does not say %q:\n%s", want, out)
	}
	t.Logf("kpipe explain --kubeconfig, on kube-proxy's rules:\n%s", out)
}
