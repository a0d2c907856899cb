package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// Addresses from testbed.ExternalRangeIPv4 (no interface has them).
const (
	externalIP    = "203.0.113.10"
	lbIP          = "203.0.113.20"
	lbIPProxyMode = "203.0.113.21"
	lbIPVIPMode   = "203.0.113.22"
	lbIPRanges    = "203.0.113.30"
	lbIPLocal     = "203.0.113.40"
	externalLocal = "203.0.113.41"
)

// spec.externalIPs: the node DNATs packets for them, from outside, from a pod
// and from the node; outside traffic is masqueraded (Cluster policy). Other
// ports of the address, and the address once removed, are not answered.
func TestExternalIPs(t *testing.T) {
	e := setup(t)
	spec := testbed.Service(e.ns, "ext",
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort))
	spec.Spec.ExternalIPs = []string{externalIP}
	svc := e.create(spec)
	e.endpoints(svc, 1, 2, 3)
	want := podIPs(1, 2, 3)
	addr := testbed.HostPort(externalIP, 80)
	client, pod := tb.ClientNS, tb.Pod(clientPod).NS

	expectExactly(t, "TCP externalIP from the client", tcp2, client, addr, want, nodeAddrs4...)
	expectExactly(t, "UDP externalIP from the client", udp2, client, addr, want, nodeAddrs4...)
	expectExactly(t, "TCP externalIP from a pod", tcp2, pod, addr, want)
	expectExactly(t, "TCP externalIP from the node", tcp2, tb.NodeNS, addr, want)
	eventuallyDropped(t, "externalIP, a port the service does not have", tcp1, client, testbed.HostPort(externalIP, 81))

	if _, err := tb.UpdateService(e.ctx, e.ns, svc.Name, func(s *corev1.Service) { s.Spec.ExternalIPs = nil }); err != nil {
		t.Fatal(err)
	}
	eventuallyDropped(t, "externalIP removed from the service", tcp1, client, addr)
	if nat := e.iptablesSave("nat"); strings.Contains(nat, externalIP) {
		t.Fatalf("externalIP %s removed but still in the NAT table:\n%s", externalIP, strings.Join(rulesMatching(nat, externalIP), "\n"))
	}
}

// status.loadBalancer.ingress IPs are DNATed like externalIPs, except an entry
// with ipMode Proxy, which must not be programmed (the load balancer proxies
// and sends traffic to the node itself).
func TestLoadBalancerIngress(t *testing.T) {
	e := setup(t)
	svc := e.create(typed(e.ns, "lb", corev1.ServiceTypeLoadBalancer,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	if _, err := tb.SetLoadBalancerIngress(e.ctx, e.ns, svc.Name,
		testbed.LBIngressIP(lbIP, ""),
		testbed.LBIngressIP(lbIPProxyMode, corev1.LoadBalancerIPModeProxy),
		testbed.LBIngressIP(lbIPVIPMode, corev1.LoadBalancerIPModeVIP)); err != nil {
		t.Fatal(err)
	}
	want := podIPs(1, 2)
	client := tb.ClientNS

	expectExactly(t, "TCP LB IP (ipMode unset) from the client", tcp2, client, testbed.HostPort(lbIP, 80), want, nodeAddrs4...)
	expectExactly(t, "UDP LB IP (ipMode unset) from the client", udp2, client, testbed.HostPort(lbIP, 80), want, nodeAddrs4...)
	expectExactly(t, "TCP LB IP (ipMode VIP) from the client", tcp2, client, testbed.HostPort(lbIPVIPMode, 80), want, nodeAddrs4...)
	expectExactly(t, "TCP LB IP from a pod", tcp2, tb.Pod(clientPod).NS, testbed.HostPort(lbIP, 80), want)
	expectExactly(t, "TCP LB IP from the node", tcp2, tb.NodeNS, testbed.HostPort(lbIP, 80), want)
	expectExactly(t, "TCP NodePort of the LoadBalancer service", tcp2, client, testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(svc, "tcp")), want, nodeAddrs4...)
	eventuallyDropped(t, "TCP LB IP with ipMode Proxy", tcp1, client, testbed.HostPort(lbIPProxyMode, 80))
	eventuallyDropped(t, "UDP LB IP with ipMode Proxy", udp1, client, testbed.HostPort(lbIPProxyMode, 80))
	for _, table := range []string{"nat", "filter"} {
		if rules := rulesMatching(e.iptablesSave(table), lbIPProxyMode); len(rules) > 0 {
			t.Fatalf("ipMode Proxy ingress IP %s is programmed in %s:\n%s", lbIPProxyMode, table, strings.Join(rules, "\n"))
		}
	}
	if rules := rulesMatching(e.iptablesSave("nat"), "-d "+lbIP+"/32", "loadbalancer IP"); len(rules) == 0 {
		t.Fatalf("no load-balancer rule for %s in the NAT table", lbIP)
	}

	// The load balancer drops an address: so does the node.
	if _, err := tb.SetLoadBalancerIngress(e.ctx, e.ns, svc.Name, testbed.LBIngressIP(lbIPVIPMode, "")); err != nil {
		t.Fatal(err)
	}
	eventuallyDropped(t, "LB IP no longer in the status", tcp1, client, testbed.HostPort(lbIP, 80))
	expectExactly(t, "the remaining LB IP", tcp2, client, testbed.HostPort(lbIPVIPMode, 80), want)
}

// loadBalancerSourceRanges: sources inside reach the LB IP, others are dropped
// (a timeout, not a refusal); a range holding the node's own IP lets the node
// in. The ranges guard the LB IP only, not the NodePort.
func TestLoadBalancerSourceRanges(t *testing.T) {
	e := setup(t)
	addAddress(t, tb.ClientNS, "eth0", clientAltIPv4+"/24")
	spec := typed(e.ns, "fw", corev1.ServiceTypeLoadBalancer, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	spec.Spec.LoadBalancerSourceRanges = []string{testbed.ClientIPv4 + "/32", testbed.NodeIPv4 + "/32"}
	svc := e.create(spec)
	e.endpoints(svc, 1, 2)
	if _, err := tb.SetLoadBalancerIngress(e.ctx, e.ns, svc.Name, testbed.LBIngressIP(lbIPRanges, "")); err != nil {
		t.Fatal(err)
	}
	want := podIPs(1, 2)
	addr := testbed.HostPort(lbIPRanges, 80)
	client := tb.ClientNS
	fromIn, fromOut := tcpFrom(testbed.ClientIPv4, 2*time.Second), tcpFrom(clientAltIPv4, time.Second)

	expectExactly(t, "LB IP from "+testbed.ClientIPv4+" (in the ranges)", fromIn, client, addr, want, nodeAddrs4...)
	expectExactly(t, "LB IP from the node (its IP is in the ranges)", tcp2, tb.NodeNS, addr, want)
	eventuallyDropped(t, "LB IP from "+clientAltIPv4+" (outside the ranges)", fromOut, client, addr)
	expectExactly(t, "NodePort from "+clientAltIPv4+" (ranges do not apply)", tcpFrom(clientAltIPv4, 2*time.Second), client,
		testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(svc, "tcp")), want)

	// Swap the ranges: the other client address is in, the first one and the
	// node are out.
	if _, err := tb.UpdateService(e.ctx, e.ns, svc.Name, func(s *corev1.Service) {
		s.Spec.LoadBalancerSourceRanges = []string{clientAltIPv4 + "/32"}
	}); err != nil {
		t.Fatal(err)
	}
	expectExactly(t, "LB IP from "+clientAltIPv4+" (now in the ranges)", tcpFrom(clientAltIPv4, 2*time.Second), client, addr, want, nodeAddrs4...)
	eventuallyDropped(t, "LB IP from "+testbed.ClientIPv4+" (now outside)", tcpFrom(testbed.ClientIPv4, time.Second), client, addr)
	eventuallyUnanswered(t, "LB IP from the node (now outside)", tcp1, tb.NodeNS, addr)
}

// externalTrafficPolicy Local: outside traffic to the NodePort, LB IP and
// externalIP goes only to endpoints on this node and keeps the client's
// source IP; with no local endpoint it is dropped. Traffic from a pod or from
// the node still reaches every endpoint.
func TestExternalTrafficPolicyLocal(t *testing.T) { setup(t).externalTrafficPolicyLocal() }

// externalTrafficPolicyLocal is TestExternalTrafficPolicyLocal in e's namespace,
// with kpipe as it runs.
func (e *env) externalTrafficPolicyLocal() {
	t := e.t
	t.Helper()
	spec := typed(e.ns, "local", corev1.ServiceTypeLoadBalancer,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort))
	spec.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	spec.Spec.ExternalIPs = []string{externalLocal}
	svc := e.create(spec)
	if _, err := tb.SetLoadBalancerIngress(e.ctx, e.ns, svc.Name, testbed.LBIngressIP(lbIPLocal, "")); err != nil {
		t.Fatal(err)
	}
	e.setEndpoints(svc, local(1, 2), remote(3, 4))
	npTCP, npUDP := testbed.NodePortOf(svc, "tcp"), testbed.NodePortOf(svc, "udp")
	client, pod := tb.ClientNS, tb.Pod(clientPod).NS
	external := []struct {
		name string
		d    dialer
		drop dialer
		addr string
	}{
		{"TCP NodePort", tcp2, tcp1, testbed.HostPort(testbed.NodeIPv4, npTCP)},
		{"UDP NodePort", udp2, udp1, testbed.HostPort(testbed.NodeIPv4, npUDP)},
		{"TCP LB IP", tcp2, tcp1, testbed.HostPort(lbIPLocal, 80)},
		{"TCP externalIP", tcp2, tcp1, testbed.HostPort(externalLocal, 80)},
	}
	for _, x := range external {
		expectExactly(t, x.name+" from the client: local endpoints only, client IP kept", x.d, client, x.addr, podIPs(1, 2), testbed.ClientIPv4)
	}
	inside := []struct {
		name string
		from string
		addr string
	}{
		{"TCP NodePort from a pod", pod, testbed.HostPort(testbed.BridgeIPv4, npTCP)},
		{"TCP LB IP from a pod", pod, testbed.HostPort(lbIPLocal, 80)},
		{"TCP NodePort from the node", tb.NodeNS, testbed.HostPort(testbed.NodeIPv4, npTCP)},
		{"TCP LB IP from the node", tb.NodeNS, testbed.HostPort(lbIPLocal, 80)},
	}
	for _, x := range inside {
		expectExactly(t, x.name+": every endpoint", tcp2, x.from, x.addr, podIPs(1, 2, 3, 4))
	}

	// No local endpoint left: outside traffic is dropped, inside traffic goes on.
	e.setEndpoints(svc, remote(3, 4))
	for _, x := range external {
		eventuallyDropped(t, x.name+" from the client, no local endpoints", x.drop, client, x.addr)
	}
	for _, x := range inside {
		expectExactly(t, x.name+", no local endpoints", tcp2, x.from, x.addr, podIPs(3, 4))
	}
}

// healthCheckNodePort (LoadBalancer + Local): kpipe answers HTTP on it, 200
// with the number of local ready endpoints, 503 with none, in kube-proxy's
// JSON; the server goes away with the service.
func TestHealthCheckNodePort(t *testing.T) {
	e := setup(t)
	spec := typed(e.ns, "hc", corev1.ServiceTypeLoadBalancer, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	spec.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	svc := e.create(spec)
	hc := svc.Spec.HealthCheckNodePort
	if hc == 0 {
		t.Fatalf("no healthCheckNodePort allocated: %+v", svc.Spec)
	}
	e.setEndpoints(svc, local(1, 2), remote(3))
	url := "http://" + net.JoinHostPort(testbed.NodeIPv4, strconv.Itoa(int(hc))) + "/healthz"

	type reply struct {
		Service struct {
			Namespace string `json:"namespace"`
			Name      string `json:"name"`
		} `json:"service"`
		LocalEndpoints      int  `json:"localEndpoints"`
		ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
	}
	expect := func(what string, from string, wantCode, wantLocal int) {
		t.Helper()
		var last string
		testbed.Eventually(t, 20*time.Second, func() error {
			resp, err := tb.HTTPClient(from, 2*time.Second).Get(url)
			if err != nil {
				return fmt.Errorf("%s: GET %s from %s: %w", what, url, short(from), err)
			}
			defer resp.Body.Close()
			raw, err := io.ReadAll(resp.Body)
			if err != nil {
				return fmt.Errorf("%s: GET %s from %s: read body: %w", what, url, short(from), err)
			}
			body := string(raw)
			last = fmt.Sprintf("HTTP %d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
			var r reply
			if err := json.Unmarshal([]byte(body), &r); err != nil {
				return fmt.Errorf("%s: body is not JSON: %v: %s", what, err, last)
			}
			if resp.StatusCode != wantCode || r.LocalEndpoints != wantLocal {
				return fmt.Errorf("%s: want HTTP %d with localEndpoints %d, got %s", what, wantCode, wantLocal, last)
			}
			if r.Service.Namespace != e.ns || r.Service.Name != svc.Name || !r.ServiceProxyHealthy {
				return fmt.Errorf("%s: want service %s/%s and serviceProxyHealthy true, got %s", what, e.ns, svc.Name, last)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				return fmt.Errorf("%s: Content-Type %q, want application/json", what, ct)
			}
			if !strings.HasPrefix(body, "{\n\t\"service\": {\n\t\t\"namespace\": ") {
				return fmt.Errorf("%s: body is not kube-proxy's tab-indented JSON: %q", what, body)
			}
			return nil
		})
		t.Logf("%s: GET %s from %s: %s", what, url, short(from), last)
	}
	expect("two local endpoints", tb.ClientNS, http.StatusOK, 2)
	expect("two local endpoints, asked from a pod", tb.Pod(clientPod).NS, http.StatusOK, 2)

	e.setEndpoints(svc, local(1), remote(3))
	expect("one local endpoint", tb.ClientNS, http.StatusOK, 1)

	e.setEndpoints(svc, remote(3), terminating(testbed.NodeName, 2))
	expect("only a remote ready and a local terminating endpoint", tb.ClientNS, http.StatusServiceUnavailable, 0)

	e.setEndpoints(svc, local(1, 2), remote(3))
	expect("local endpoints back", tb.ClientNS, http.StatusOK, 2)

	if err := tb.DeleteService(e.ctx, e.ns, svc.Name); err != nil {
		t.Fatal(err)
	}
	var last error
	testbed.Eventually(t, 20*time.Second, func() error {
		code, body, err := tb.HTTPGet(tb.ClientNS, url)
		if err == nil {
			return fmt.Errorf("service deleted but GET %s still answers: HTTP %d: %s", url, code, body)
		}
		last = err
		return nil
	})
	t.Logf("service deleted: GET %s: %v", url, last)
}
