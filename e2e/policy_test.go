package e2e

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// internalTrafficPolicy Local: from a pod (and from the node) only endpoints
// on this node answer; with none, the ClusterIP drops (timeout).
func TestInternalTrafficPolicyLocal(t *testing.T) {
	e := setup(t)
	spec := testbed.Service(e.ns, "itp",
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort),
		testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort))
	spec.Spec.InternalTrafficPolicy = ptr.To(corev1.ServiceInternalTrafficPolicyLocal)
	svc := e.create(spec)
	e.setEndpoints(svc, local(1, 2), remote(3, 4))
	addr := testbed.ClusterAddr(svc, 80)
	pod := tb.Pod(clientPod)

	expectExactly(t, "TCP ClusterIP from a pod: local endpoints only", tcp2, pod.NS, addr, podIPs(1, 2), pod.IPv4)
	expectExactly(t, "UDP ClusterIP from a pod: local endpoints only", udp2, pod.NS, addr, podIPs(1, 2), pod.IPv4)
	expectExactly(t, "TCP ClusterIP from the node: local endpoints only", tcp2, tb.NodeNS, addr, podIPs(1, 2))

	e.setEndpoints(svc, remote(3, 4))
	eventuallyDropped(t, "TCP ClusterIP from a pod, no local endpoints", tcp1, pod.NS, addr)
	eventuallyDropped(t, "UDP ClusterIP from a pod, no local endpoints", udp1, pod.NS, addr)

	e.setEndpoints(svc, remote(3), local(4))
	expectExactly(t, "TCP ClusterIP from a pod, a local endpoint again", tcp2, pod.NS, addr, podIPs(4))
}

// sessionAffinity ClientIP with a 2 s timeout: a client that keeps talking
// sticks to one endpoint (each new connection renews the affinity, as in
// kube-proxy), whether the endpoints are on this node or not; a client that
// stays quiet longer than the timeout gets a fresh choice.
func TestSessionAffinity(t *testing.T) {
	e := setup(t)
	const timeout = 2
	mk := func(name string) *corev1.Service {
		spec := testbed.Service(e.ns, name, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
		spec.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
		spec.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](timeout)}}
		return e.create(spec)
	}
	localSvc, remoteSvc, allSvc := mk("sticky-local"), mk("sticky-remote"), mk("sticky-all")
	all := make([]int, endpointPods)
	for i := range all {
		all[i] = i + 1
	}
	e.setEndpoints(localSvc, local(all...))
	e.setEndpoints(remoteSvc, remote(all...))
	e.setEndpoints(allSvc, local(all[:5]...), remote(all[5:]...))
	pod := tb.Pod(clientPod).NS
	for _, s := range []*corev1.Service{localSvc, remoteSvc, allSvc} {
		waitAnswer(t, tcp2, pod, testbed.ClusterAddr(s, 80), 20*time.Second)
	}
	nat := e.iptablesSave("nat")
	// One affinity check per endpoint: --rcheck before a KUBE-SEP- chain (which
	// renews with --set), --update on an inline DNAT.
	checks := len(rulesMatching(nat, e.ns+"/sticky-all:tcp", "--rcheck --seconds 2 --reap")) +
		len(rulesMatching(nat, e.ns+"/sticky-all:tcp", "--update --seconds 2 --reap"))
	if checks != endpointPods {
		t.Errorf("want %d affinity checks (recent --rcheck/--update --seconds 2) for sticky-all, found %d:\n%s", endpointPods, checks, filterRules(nat, e.ns+"/"))
	}

	// Continuous traffic: a request every 400 ms for ~6.5 s (three timeouts)
	// keeps going to the same endpoint, on this node or not (10 endpoints: an
	// affinity that lapsed anyway would land on the same one again three
	// times running with probability 1e-3). Run on the local and the remote
	// service at once, while the idle part below runs.
	type stuck struct {
		name string
		h    hits
		seq  []string // "+<seconds since the first request> <endpoint>"
		err  error
	}
	results := make(chan stuck, 2)
	var wg sync.WaitGroup
	for _, s := range []*corev1.Service{localSvc, remoteSvc} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := hits{endpoints: map[string]int{}, sources: map[string]int{}}
			var seq []string
			addr := testbed.ClusterAddr(s, 80)
			first := time.Now()
			for i := 0; i < 17; i++ {
				a, err := tb.DialTCP(pod, addr, 2*time.Second)
				if err != nil {
					results <- stuck{s.Name, h, seq, err}
					return
				}
				h.endpoints[a.Endpoint]++
				h.sources[a.SourceIP()]++
				seq = append(seq, fmt.Sprintf("+%.1fs %s", time.Since(first).Seconds(), a.Endpoint))
				time.Sleep(400 * time.Millisecond)
			}
			results <- stuck{s.Name, h, seq, nil}
		}()
	}

	// Idle longer than the timeout between requests: each request is a fresh
	// pick among 10 endpoints. 8 picks all landing on the same endpoint has
	// probability 1e-7.
	const rounds = 8
	addr := testbed.ClusterAddr(allSvc, 80)
	var picks []string
	for i := 0; i < rounds; i++ {
		if i > 0 {
			time.Sleep(timeout*time.Second + 400*time.Millisecond)
		}
		a, err := tb.DialTCP(pod, addr, 2*time.Second)
		if err != nil {
			t.Fatalf("idle round %d: %v", i+1, err)
		}
		// Right after, the same client sticks.
		b, err := tb.DialTCP(pod, addr, 2*time.Second)
		if err != nil {
			t.Fatalf("idle round %d, second request: %v", i+1, err)
		}
		if b.Endpoint != a.Endpoint {
			t.Errorf("idle round %d: two requests 0 s apart answered by %s, then %s", i+1, a.Endpoint, b.Endpoint)
		}
		picks = append(picks, a.Endpoint)
	}
	distinct := map[string]int{}
	for _, p := range picks {
		distinct[p]++
	}
	t.Logf("after idle periods of %ds+0.4s the client went to: %v", timeout, picks)
	if len(distinct) < 2 {
		t.Errorf("after %d idle periods longer than the %d s timeout, the client always went to %v: affinity never expired", rounds-1, timeout, picks)
	}

	wg.Wait()
	close(results)
	for r := range results {
		if r.err != nil {
			t.Errorf("%s, continuous traffic: %v", r.name, r.err)
			continue
		}
		t.Logf("%s, a request every 400 ms for ~6.5 s: %v", r.name, r.h)
		if len(r.h.endpoints) != 1 {
			t.Errorf("%s: a client talking every 400 ms (timeout %d s) moved between endpoints: %v; answers in order: %s",
				r.name, timeout, r.h.endpoints, strings.Join(r.seq, ", "))
		}
	}
}

// Terminating endpoints (serving, not ready) are used only when there is no
// ready one; endpoints that no longer serve never are. Checked for the Cluster
// policy (ClusterIP from a pod) and for externalTrafficPolicy Local (NodePort
// from the client: a local terminating endpoint when no local ready one).
func TestTerminatingEndpoints(t *testing.T) {
	e := setup(t)
	node := testbed.NodeName
	pod, client := tb.Pod(clientPod).NS, tb.ClientNS

	svc := e.create(testbed.Service(e.ns, "cluster", testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
	addr := testbed.ClusterAddr(svc, 80)
	e.setEndpoints(svc, local(1), terminating(node, 2), notServing(node, 3))
	// One wanted endpoint: also make sure the others never answer.
	h := expectExactly(t, "Cluster: a ready, a terminating and a not-serving endpoint", tcp2, pod, addr, podIPs(1))
	if h2, err := sample(tcp2, pod, addr, 40); err != nil || h2.exactly(podIPs(1)) != nil {
		t.Fatalf("Cluster, ready endpoint present: %v %v (before: %v)", h2, err, h)
	}
	e.setEndpoints(svc, terminating(node, 2), notServing(node, 3), terminating(otherNode, 4))
	expectExactly(t, "Cluster: no ready endpoint, terminating ones used", tcp2, pod, addr, podIPs(2, 4))
	e.setEndpoints(svc, notServing(node, 3))
	eventuallyRefused(t, "Cluster: only a not-serving endpoint (no endpoints)", tcp1, pod, addr)

	spec := typed(e.ns, "local", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	spec.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	lsvc := e.create(spec)
	np := testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(lsvc, "tcp"))
	npFromPod := testbed.HostPort(testbed.BridgeIPv4, testbed.NodePortOf(lsvc, "tcp"))
	e.setEndpoints(lsvc, remote(1), terminating(node, 2), local(3))
	expectExactly(t, "Local: NodePort from the client, a local ready endpoint", tcp2, client, np, podIPs(3), testbed.ClientIPv4)
	e.setEndpoints(lsvc, remote(1), terminating(node, 2), notServing(node, 4))
	expectExactly(t, "Local: NodePort from the client, no local ready endpoint: the local terminating one", tcp2, client, np, podIPs(2), testbed.ClientIPv4)
	expectExactly(t, "Local: NodePort from a pod (Cluster endpoints: the ready one)", tcp2, pod, npFromPod, podIPs(1))
	e.setEndpoints(lsvc, remote(1), notServing(node, 4))
	eventuallyDropped(t, "Local: NodePort from the client, only a local not-serving endpoint", tcp1, client, np)
	expectExactly(t, "Local: NodePort from a pod, only a local not-serving endpoint", tcp2, pod, npFromPod, podIPs(1))
}

// Topology hints: when every ready endpoint has hints.forZones, only those
// hinted for the node's zone (zone-a) are used; if any ready endpoint lacks
// hints, or none is hinted for zone-a, all are.
func TestTopologyZoneHints(t *testing.T) {
	e := setup(t)
	spec := testbed.Service(e.ns, "zoned", testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	spec.Spec.TrafficDistribution = ptr.To(corev1.ServiceTrafficDistributionPreferClose)
	svc := e.create(spec)
	addr := testbed.ClusterAddr(svc, 80)
	pod := tb.Pod(clientPod).NS
	zoned := func(zone string, hints []string, pods ...int) []testbed.Endpoint {
		eps := remote(pods...)
		for i := range eps {
			eps[i].Zone, eps[i].HintZones = zone, hints
		}
		return eps
	}
	a, b := []string{"zone-a"}, []string{"zone-b"}

	e.setEndpoints(svc, zoned("zone-a", a, 1, 2), zoned("zone-b", b, 3, 4))
	expectExactly(t, "all hinted: zone-a's endpoints only (from a pod)", tcp2, pod, addr, podIPs(1, 2))
	expectExactly(t, "all hinted: zone-a's endpoints only (from the node)", tcp2, tb.NodeNS, addr, podIPs(1, 2))

	e.setEndpoints(svc, zoned("zone-a", a, 1, 2), zoned("zone-b", b, 3), zoned("zone-b", nil, 4))
	expectExactly(t, "one ready endpoint without hints: all endpoints", tcp2, pod, addr, podIPs(1, 2, 3, 4))

	e.setEndpoints(svc, zoned("zone-b", b, 3, 4), zoned("zone-c", []string{"zone-c"}, 5))
	expectExactly(t, "all hinted, none for zone-a: all endpoints", tcp2, pod, addr, podIPs(3, 4, 5))

	// A not-ready endpoint without hints does not count.
	unready := zoned("zone-b", nil, 6)
	unready[0].Ready, unready[0].Serving = false, false
	e.setEndpoints(svc, zoned("zone-a", a, 1), zoned("zone-b", b, 3), unready)
	expectExactly(t, "ready endpoints all hinted (a not-ready one is not)", tcp2, pod, addr, podIPs(1))
	if h, err := sample(tcp2, pod, addr, 40); err != nil || h.exactly(podIPs(1)) != nil {
		t.Fatalf("zone-a's single endpoint: %v %v", h, err)
	}
}
