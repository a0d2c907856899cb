package e2e

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// An IPv6 NodePort answers from the client on the node's IPv6 address, and a
// RequireDualStack NodePort service answers on both families, from the client
// (NodePort) and from a pod (both ClusterIPs), each family from its own
// endpoints.
func TestDualStackNodePort(t *testing.T) {
	e := setup(t)
	client, pod := tb.ClientNS, tb.Pod(clientPod)

	spec := typed(e.ns, "v6", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort))
	spec.Spec.IPFamilyPolicy = ptr.To(corev1.IPFamilyPolicySingleStack)
	spec.Spec.IPFamilies = []corev1.IPFamily{corev1.IPv6Protocol}
	v6 := e.create(spec)
	if !strings.Contains(v6.Spec.ClusterIP, ":") {
		t.Fatalf("IPv6 service got ClusterIP %q", v6.Spec.ClusterIP)
	}
	e.setEndpoints(v6, tb.ReadyEndpoints6(1, 2))
	want6 := podIPs6(1, 2)
	expectExactly(t, "IPv6 TCP NodePort from the client", tcp2, client, testbed.HostPort(testbed.NodeIPv6, testbed.NodePortOf(v6, "tcp")), want6, nodeAddrs6...)
	expectExactly(t, "IPv6 UDP NodePort from the client", udp2, client, testbed.HostPort(testbed.NodeIPv6, testbed.NodePortOf(v6, "udp")), want6, nodeAddrs6...)
	expectExactly(t, "IPv6 TCP NodePort from a pod", tcp2, pod.NS, testbed.HostPort(testbed.BridgeIPv6, testbed.NodePortOf(v6, "tcp")), want6)
	eventuallyUnanswered(t, "IPv6-only service: its NodePort on IPv4", tcp1, client, testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(v6, "tcp")))

	dual := e.create(dualStack(typed(e.ns, "dual", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))))
	if len(dual.Spec.ClusterIPs) != 2 {
		t.Fatalf("dual-stack service got ClusterIPs %v", dual.Spec.ClusterIPs)
	}
	e.endpoints(dual, 3, 4)
	e.setEndpoints(dual, tb.ReadyEndpoints6(3, 4))
	np := testbed.NodePortOf(dual, "tcp")
	expectExactly(t, "dual-stack NodePort from the client, IPv4", tcp2, client, testbed.HostPort(testbed.NodeIPv4, np), podIPs(3, 4), nodeAddrs4...)
	expectExactly(t, "dual-stack NodePort from the client, IPv6", tcp2, client, testbed.HostPort(testbed.NodeIPv6, np), podIPs6(3, 4), nodeAddrs6...)
	expectExactly(t, "dual-stack ClusterIP from a pod, IPv4", tcp2, pod.NS, net.JoinHostPort(dual.Spec.ClusterIPs[0], "80"), podIPs(3, 4), pod.IPv4)
	expectExactly(t, "dual-stack ClusterIP from a pod, IPv6", tcp2, pod.NS, net.JoinHostPort(dual.Spec.ClusterIPs[1], "80"), podIPs6(3, 4), pod.IPv6)
}

// What a node proxy must leave alone: ExternalName and headless services, and
// services (with their slices) labelled for another proxy, get no rules, and
// the other proxy's ClusterIP is not answered. A port with an appProtocol
// works. A slice with an address kpipe cannot read loses that endpoint only,
// and kpipe counts it in kpipe_skipped_objects_total.
func TestIgnoredServices(t *testing.T) {
	e := setup(t)
	pod := tb.Pod(clientPod).NS
	port := testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)

	extName := testbed.Service(e.ns, "extname")
	extName.Spec.Type = corev1.ServiceTypeExternalName
	extName.Spec.ExternalName = "echo.example.invalid"
	extName.Spec.Ports = []corev1.ServicePort{port}
	extName = e.create(extName)
	e.endpoints(extName, 1)

	headless := testbed.Service(e.ns, "headless", port)
	headless.Spec.ClusterIP = corev1.ClusterIPNone
	headless = e.create(headless)
	slice := testbed.EndpointSlice(headless, "", tb.ReadyEndpoints(1, 2))
	slice.Labels[corev1.IsHeadlessService] = ""
	if _, err := tb.ApplyEndpointSlice(e.ctx, slice); err != nil {
		t.Fatal(err)
	}
	headlessUnlabelled := testbed.EndpointSlice(headless, "headless-unlabelled", tb.ReadyEndpoints(3))
	if _, err := tb.ApplyEndpointSlice(e.ctx, headlessUnlabelled); err != nil {
		t.Fatal(err)
	}

	const proxyName = "service.kubernetes.io/service-proxy-name"
	other := testbed.Service(e.ns, "other-proxy", port)
	other.Labels = map[string]string{proxyName: "other"}
	other = e.create(other)
	slice = testbed.EndpointSlice(other, "", tb.ReadyEndpoints(1, 2))
	slice.Labels[proxyName] = "other"
	if _, err := tb.ApplyEndpointSlice(e.ctx, slice); err != nil {
		t.Fatal(err)
	}

	skippedBefore := metricSum(t, "kpipe_skipped_objects_total", map[string]string{"kind": "EndpointSlice"})
	app := testbed.Service(e.ns, "app", port)
	app.Spec.Ports[0].AppProtocol = ptr.To("kubernetes.io/h2c")
	app = e.create(app)
	e.endpoints(app, 1, 2)
	// A second slice: one endpoint fine, one with a non-canonical address the
	// apiserver still accepts (leading zeros) but kpipe cannot parse. (The
	// apiserver refuses an IPv6 address or plain garbage in an IPv4 slice.)
	bad := testbed.EndpointSlice(app, "app-bad", append(tb.ReadyEndpoints(3), testbed.Endpoint{IP: "10.244.0.099", Ready: true, Serving: true}))
	if bad.AddressType != discoveryv1.AddressTypeIPv4 {
		t.Fatalf("slice %s has address type %s", bad.Name, bad.AddressType)
	}
	if _, err := tb.ApplyEndpointSlice(e.ctx, bad); err != nil {
		t.Fatal(err)
	}
	expectExactly(t, "service with appProtocol, one slice partly unreadable", tcp2, pod, testbed.ClusterAddr(app, 80), podIPs(1, 2, 3))
	testbed.Eventually(t, 10*time.Second, func() error {
		if after := metricSum(t, "kpipe_skipped_objects_total", map[string]string{"kind": "EndpointSlice"}); after <= skippedBefore {
			return fmt.Errorf("kpipe_skipped_objects_total{kind=\"EndpointSlice\"} still %v (was %v before the bad slice)", after, skippedBefore)
		}
		return nil
	})
	t.Logf("kpipe_skipped_objects_total{kind=\"EndpointSlice\"}: %v -> %v", skippedBefore, metricSum(t, "kpipe_skipped_objects_total", map[string]string{"kind": "EndpointSlice"}))

	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		for _, table := range []string{"nat", "filter"} {
			out, err := tb.Exec(tb.NodeNS, save, "-t", table)
			if err != nil {
				t.Fatal(err)
			}
			for _, name := range []string{"extname", "headless", "other-proxy"} {
				if rules := rulesMatching(out, e.ns+"/"+name+":"); len(rules) > 0 {
					t.Errorf("%s -t %s has rules for %s/%s, which kpipe must ignore:\n%s", save, table, e.ns, name, strings.Join(rules, "\n"))
				}
			}
			if rules := rulesMatching(out, other.Spec.ClusterIP+"/"); len(rules) > 0 {
				t.Errorf("%s -t %s has rules for the other proxy's ClusterIP %s:\n%s", save, table, other.Spec.ClusterIP, strings.Join(rules, "\n"))
			}
			if rules := rulesMatching(out, "10.244.0.99"); len(rules) > 0 {
				t.Errorf("%s -t %s has rules for the unreadable address:\n%s", save, table, strings.Join(rules, "\n"))
			}
		}
	}
	eventuallyDropped(t, "ClusterIP of a service for another proxy", tcp1, pod, testbed.ClusterAddr(other, 80))
}
