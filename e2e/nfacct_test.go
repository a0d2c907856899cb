package e2e

import (
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// kube-proxy's two counters kept in nfacct objects, which kpipe's rules count in.
const (
	invalidDroppedMetric = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total"
	localhostNPMetric    = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total"
)

// TestNFAcctMetrics: packets KUBE-FORWARD drops as conntrack INVALID, and
// packets to a NodePort on 127.0.0.1, are counted in kube-proxy's nfacct
// objects and show on /metrics; a NodePort reached on the node's own address
// does not count as localhost.
func TestNFAcctMetrics(t *testing.T) {
	e := setup(t)
	requireStrictConntrack(t)

	// SYN+FIN segments (an invalid flag combination) forwarded from the client
	// to a pod are dropped as INVALID, each counted.
	target := tb.Pod(1)
	before := counter(t, invalidDroppedMetric)
	const n = 5
	if err := sendSynFin(target.IPv4, 41000, n); err != nil {
		t.Fatal(err)
	}
	testbed.Eventually(t, 5*time.Second, func() error {
		if after := counter(t, invalidDroppedMetric); after < before+n {
			return fmt.Errorf("%s went from %v to %v after %d SYN+FIN segments from the client to %s", invalidDroppedMetric, before, after, n, target.IPv4)
		}
		return nil
	})
	t.Logf("%s: %v before %d SYN+FIN segments, %v after", invalidDroppedMetric, before, n, counter(t, invalidDroppedMetric))

	// A NodePort on 127.0.0.1 from the node: every connection's first packet counts.
	svc := e.create(typed(e.ns, "np-nfacct", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	np := testbed.NodePortOf(svc, "tcp")
	expectExactly(t, "TCP NodePort on 127.0.0.1", tcp2, tb.NodeNS, testbed.HostPort("127.0.0.1", np), podIPs(1, 2), nodeAddrs4...)
	before = counter(t, localhostNPMetric)
	h, err := sample(tcp2, tb.NodeNS, testbed.HostPort("127.0.0.1", np), 10)
	if err != nil {
		t.Fatal(err)
	}
	after := counter(t, localhostNPMetric)
	if after < before+10 {
		t.Fatalf("%s went from %v to %v after 10 connections to 127.0.0.1:%d (%v)", localhostNPMetric, before, after, np, h)
	}
	t.Logf("%s: %v before 10 connections to 127.0.0.1:%d, %v after", localhostNPMetric, before, np, after)

	// The same NodePort on the node's address, from the node and from the
	// client: answered, never counted as localhost.
	for round := 0; round < 3; round++ {
		for _, from := range []string{tb.NodeNS, tb.ClientNS} {
			if _, err := sample(tcp2, from, testbed.HostPort(testbed.NodeIPv4, np), 5); err != nil {
				t.Fatal(err)
			}
			if now := counter(t, localhostNPMetric); now != after {
				t.Fatalf("round %d: %s went from %v to %v after connections from %s to the node's address %s:%d", round, localhostNPMetric, after, now, short(from), testbed.NodeIPv4, np)
			}
		}
	}
}

// counter is the value of a label-less counter on kpipe's /metrics, which must
// be there.
func counter(t *testing.T, name string) float64 {
	t.Helper()
	m, err := kpipeMetrics()
	if err != nil {
		t.Fatal(err)
	}
	v, ok := m[name]
	if !ok {
		t.Fatalf("no %s on /metrics", name)
	}
	return v
}
