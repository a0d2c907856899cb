package e2e

// A client loop makes a new connection to the same ClusterIP every few
// milliseconds, so its kernel soon gives it a source port it used before. These
// tests make that reuse happen on purpose, from a fixed source port: a reused
// port must be answered like a new one (issue 20, "the unanswered SYN").

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// TestProbeBeforeTheRulesLeavesNoBlackHole: a connection to a ClusterIP tried
// before the proxy has programmed it goes unanswered; once the service
// answers, a connection from the same source port is answered too. The
// client's kernel picks the same source port again for the same destination
// (its ports for one destination advance by small steps through the range),
// and the unanswered try left a conntrack entry of its own (SYN_SENT, never
// DNATed, 120 s): a waiting helper's probe made a client loop's connection
// fail 2 s later (issue 20).
func TestProbeBeforeTheRulesLeavesNoBlackHole(t *testing.T) {
	probeBeforeTheRules(t, setup(t))
}

func probeBeforeTheRules(t *testing.T, e *env) {
	client := tb.Pod(clientPod).NS
	ip := unallocatedClusterIP(t, e)
	addr := testbed.HostPort(ip, 80)
	const port = 41234
	_, err := tb.DialTCPFromPort(client, port, addr, time.Second)
	if !errors.Is(err, testbed.ErrTimeout) {
		t.Fatalf("%s before its service exists: want a timeout, got %v", addr, err)
	}
	t.Logf("before its service exists: %v", err)
	svc := testbed.Service(e.ns, "late", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	svc.Spec.ClusterIP = ip
	e.endpoints(e.create(svc), 1, 2)
	waitAnswer(t, tcp2, client, addr, 20*time.Second)
	for i := 1; i <= 3; i++ {
		a, err := tb.DialTCPFromPort(client, port, addr, 2*time.Second)
		if err != nil {
			t.Fatalf("connection %d from source port %d, the port of the unanswered try, once %s answers: %v", i, port, addr, err)
		}
		t.Logf("connection %d from source port %d: answered by %s", i, port, a.Endpoint)
	}
}

// unallocatedClusterIP is an IPv4 address of the service range that no
// service has.
func unallocatedClusterIP(t *testing.T, e *env) string {
	t.Helper()
	svcs, err := tb.Client().CoreV1().Services("").List(e.ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	used := map[string]bool{}
	for _, s := range svcs.Items {
		for _, ip := range s.Spec.ClusterIPs {
			used[ip] = true
		}
	}
	_, cidr, _ := net.ParseCIDR(testbed.ServiceCIDRIPv4)
	for i := 200; i < 250; i++ {
		ip := fmt.Sprintf("%d.%d.%d.%d", cidr.IP[0], cidr.IP[1], i, 77)
		if !used[ip] {
			return ip
		}
	}
	t.Fatal("no unallocated ClusterIP in 10.96.200-249.77")
	return ""
}

// TestReusedPortAcrossClusterIPsAnsweredAtOnce: a connection to ClusterIP B
// from a source port an earlier connection to ClusterIP A used, to the same
// pod, is answered at its first SYN. The echo server closes first, so the pod
// holds that 4-tuple in TIME_WAIT for 60 s, and takes a new SYN on it only if
// the SYN's timestamp is newer than the last it saw. With Linux's default
// (net.ipv4.tcp_timestamps=1) a client's timestamps have a random offset per
// destination address, and the destination is the ClusterIP, before DNAT:
// half the time B's SYN looks older, the pod answers it with a bare ACK
// (PAWS), and the client retries; two such in a row (a retry is DNATed anew,
// maybe to another pod in the same state) put the next retry past 2 s.
//
// conntrack keeps A's flow (TIME_WAIT, 120 s) and, while it does, gives B's a
// new source port to the pod; A's flow goes when A's next connection from
// that port is DNATed to another endpoint, as a loop's reused ports are: the
// test does that by moving A to pod 2.
func TestReusedPortAcrossClusterIPsAnsweredAtOnce(t *testing.T) {
	e := setup(t)
	client := tb.Pod(clientPod).NS
	port := testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort)
	a, b := e.service("reuse-a", port), e.service("reuse-b", port)
	e.endpoints(a, 1)
	e.endpoints(b, 1)
	addrA, addrB := testbed.ClusterAddr(a, 80), testbed.ClusterAddr(b, 80)
	waitAnswer(t, tcp2, client, addrA, 20*time.Second)
	waitAnswer(t, tcp2, client, addrB, 20*time.Second)

	const n = 20
	ports := make([]int, n)
	for i := range ports {
		ports[i] = 42000 + i
		dialFromPort(t, client, ports[i], addrA, podIP(1))
	}
	e.endpoints(a, 2)
	expectExactly(t, "A moved to pod 2", tcp2, client, addrA, podIPs(2))
	for _, p := range ports {
		dialFromPort(t, client, p, addrA, podIP(2))
	}
	retrans, paws := tcpCounter(t, client, "TCPSynRetrans"), tcpCounter(t, tb.Pod(1).NS, "PAWSTimewait")
	for _, p := range ports {
		dialFromPort(t, client, p, addrB, podIP(1))
	}
	retrans, paws = tcpCounter(t, client, "TCPSynRetrans")-retrans, tcpCounter(t, tb.Pod(1).NS, "PAWSTimewait")-paws
	t.Logf("%d source ports used for %s (pod 1), %s (pod 2), then %s (pod 1): %d SYNs retransmitted, pod 1 rejected %d SYNs in TIME_WAIT (PAWS)", n, addrA, addrA, addrB, retrans, paws)
	if retrans > 0 || paws > 0 {
		t.Errorf("%d of %d connections to %s from a reused source port were not answered at their first SYN (pod 1's PAWSTimewait +%d)", retrans, n, addrB, paws)
	}
}

// dialFromPort connects from source port port of ns to addr and fails the
// test unless endpoint answers.
func dialFromPort(t *testing.T, ns string, port int, addr, endpoint string) {
	t.Helper()
	a, err := tb.DialTCPFromPort(ns, port, addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if a.Endpoint != endpoint {
		t.Fatalf("%s from source port %d answered by %s, want %s", addr, port, a.Endpoint, endpoint)
	}
}

// tcpCounter is the TcpExt counter name of namespace ns (/proc/net/netstat).
func tcpCounter(t *testing.T, ns, name string) int64 {
	t.Helper()
	out, err := tb.Exec(ns, "cat", "/proc/net/netstat")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(out, "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		keys, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(keys) == 0 || keys[0] != "TcpExt:" || len(keys) != len(values) {
			continue
		}
		for j, k := range keys {
			if k == name {
				v, err := strconv.ParseInt(values[j], 10, 64)
				if err != nil {
					t.Fatalf("TcpExt %s in %s: %v", name, ns, err)
				}
				return v
			}
		}
	}
	t.Fatalf("no TcpExt %s in %s", name, ns)
	return 0
}
