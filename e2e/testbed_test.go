package e2e

import (
	"errors"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// These tests check the test bed itself, without kpipe: if they fail, the
// scenarios' results mean nothing.

func TestTestbedPodsAnswerDirectly(t *testing.T) {
	for _, p := range tb.Pods {
		for _, addr := range []string{p.Addr4(testbed.EchoPort), p.Addr6(testbed.EchoPort)} {
			a, err := tb.DialTCP(tb.NodeNS, addr, 2*time.Second)
			if err != nil {
				t.Fatalf("node -> pod %d: %v", p.N, err)
			}
			if want := strings.Trim(addr[:strings.LastIndex(addr, ":")], "[]"); a.Endpoint != want {
				t.Fatalf("node -> %s: answered by %q", addr, a.Endpoint)
			}
			if _, err := tb.DialUDP(tb.NodeNS, addr, 2*time.Second, 0); err != nil {
				t.Fatalf("node -> pod %d over UDP: %v", p.N, err)
			}
		}
	}
	// pod to pod: the echo server sees the client pod's own address
	from, to := tb.Pod(clientPod), tb.Pod(1)
	a, err := tb.DialTCP(from.NS, to.Addr4(testbed.EchoPort), 2*time.Second)
	if err != nil {
		t.Fatalf("pod %d -> pod %d: %v", from.N, to.N, err)
	}
	if a.Endpoint != to.IPv4 || a.SourceIP() != from.IPv4 {
		t.Fatalf("pod %d -> pod %d: got %+v", from.N, to.N, a)
	}
	a, err = tb.DialUDP(from.NS, to.Addr6(testbed.EchoPort), 2*time.Second, 40123)
	if err != nil {
		t.Fatalf("pod %d -> pod %d over UDP/IPv6: %v", from.N, to.N, err)
	}
	if a.Endpoint != to.IPv6 || a.SeenSource != "["+from.IPv6+"]:40123" {
		t.Fatalf("pod %d -> pod %d over UDP/IPv6 from port 40123: got %+v", from.N, to.N, a)
	}
	// the external client reaches a pod through the node
	a, err = tb.DialTCP(tb.ClientNS, to.Addr4(testbed.EchoPort), 2*time.Second)
	if err != nil {
		t.Fatalf("client -> pod %d: %v", to.N, err)
	}
	if a.SourceIP() != testbed.ClientIPv4 {
		t.Fatalf("client -> pod %d: echo server saw %s, want the client's %s", to.N, a.SeenSource, testbed.ClientIPv4)
	}
}

func TestTestbedRefusedVersusTimeout(t *testing.T) {
	p := tb.Pod(1)
	// nobody listens on port 9: TCP RST / ICMP port unreachable
	start := time.Now()
	_, err := tb.DialTCP(tb.Pod(clientPod).NS, p.Addr4(9), 2*time.Second)
	if !errors.Is(err, testbed.ErrRefused) || errors.Is(err, testbed.ErrTimeout) {
		t.Fatalf("TCP to a closed port: want ErrRefused, got %v", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("TCP refusal took %v", d)
	}
	_, err = tb.DialUDP(tb.Pod(clientPod).NS, p.Addr6(9), 2*time.Second, 0)
	if !errors.Is(err, testbed.ErrRefused) {
		t.Fatalf("UDP to a closed port: want ErrRefused, got %v", err)
	}
	// an unallocated ClusterIP: routed to the client namespace, which drops it
	start = time.Now()
	_, err = tb.DialTCP(tb.Pod(clientPod).NS, "10.96.255.254:80", 500*time.Millisecond)
	if !errors.Is(err, testbed.ErrTimeout) || errors.Is(err, testbed.ErrRefused) {
		t.Fatalf("TCP to a black hole: want ErrTimeout, got %v", err)
	}
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Fatalf("timeout after only %v", d)
	}
	_, err = tb.DialUDP(tb.Pod(clientPod).NS, "10.96.255.254:80", 500*time.Millisecond, 0)
	if !errors.Is(err, testbed.ErrTimeout) {
		t.Fatalf("UDP to a black hole: want ErrTimeout, got %v", err)
	}
}

func TestTestbedNodeObject(t *testing.T) {
	n, err := tb.Client().CoreV1().Nodes().Get(t.Context(), testbed.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n.Labels["topology.kubernetes.io/zone"] != "zone-a" || len(n.Spec.PodCIDRs) != 2 || len(n.Status.Addresses) < 2 {
		t.Fatalf("node: labels %v podCIDRs %v addresses %v", n.Labels, n.Spec.PodCIDRs, n.Status.Addresses)
	}
	// the node namespace's sysctls
	for key, want := range map[string]string{
		"net.ipv4.ip_forward":                 "1",
		"net.ipv6.conf.all.forwarding":        "1",
		"net.bridge.bridge-nf-call-iptables":  "1",
		"net.bridge.bridge-nf-call-ip6tables": "1",
	} {
		out, err := tb.Exec(tb.NodeNS, "sysctl", "-n", key)
		if err != nil {
			t.Fatal(err)
		}
		if strings.TrimSpace(out) != want {
			t.Errorf("%s = %q in the node namespace, want %s", key, strings.TrimSpace(out), want)
		}
	}
}
