package render

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// remoteEndpoints are n ready endpoints on another node, the from-th first.
func remoteEndpoints(from, n int) []bus.Endpoint {
	eps := make([]bus.Endpoint, n)
	for i := range eps {
		k := from + i
		eps[i] = ep(fmt.Sprintf("10.250.%d.%d", k/250, 1+k%250), "node-b")
	}
	return eps
}

// filler is a service with n endpoints on another node, which brings a
// cluster to the size largeClusterEndpoints counts.
func filler(n int) (*bus.Service, *bus.EndpointSlice) {
	s := svc("demo", "filler", "10.96.9.9", port("http", bus.TCP, 80))
	return s, slice(s, "filler-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, remoteEndpoints(0, n)...)
}

// withoutFiller is a payload without the lines of filler's chain and rules.
func withoutFiller(payload string) string {
	chain := nf.ServiceChain(nf.PrefixService, bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: "demo", Name: "filler"}, Port: "http", Protocol: bus.TCP})
	var keep []string
	for _, l := range strings.SplitAfter(payload, "\n") {
		if !strings.Contains(l, chain) && !strings.Contains(l, "demo/filler:") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "")
}

// endpointComments counts the nat rules that send to an endpoint (a DNAT, a
// jump to a KUBE-SEP- chain, session affinity's check, a KUBE-SEP- chain's
// rules), and those of them with a comment.
func endpointComments(p *bus.Plan) (commented, toEndpoint int) {
	for _, c := range p.Table(nf.TableNAT).Chains {
		sep := nf.KindOf(c.Name) == nf.KindEndpoint
		for _, l := range strings.Split(strings.TrimSuffix(c.Rules, "\n"), "\n") {
			if sep || strings.Contains(l, "-j DNAT") || strings.Contains(l, "-j "+nf.PrefixEndpoint) {
				toEndpoint++
				if strings.Contains(l, "--comment") {
					commented++
				}
			}
		}
	}
	return commented, toEndpoint
}

// TestGoldenLargeCluster: over 1,000 endpoints the rules that send to an
// endpoint (inline DNATs, jumps to KUBE-SEP- chains, session affinity's
// checks, the KUBE-SEP- chains' own rules) carry no comment, as kube-proxy's
// in its large cluster mode, and no "-m tcp" before their "-p tcp"; every
// other rule is as before. The golden holds the feature services' rules, the
// filler's left out.
func TestGoldenLargeCluster(t *testing.T) {
	sticky := svc("demo", "sticky", "10.96.0.60", port("http", bus.TCP, 80))
	sticky.AffinitySeconds = 30
	stickyEPs := slice(sticky, "sticky-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	local := svc("demo", "local", "10.96.0.40", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30040})
	local.ExternalPolicyLocal, local.HealthCheckNodePort = true, 32040
	local.LoadBalancerIPs = []netip.Addr{ip("198.51.100.40")}
	localEPs := slice(local, "local-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	hairpin := svc("demo", "hairpin", "10.96.0.110", port("http", bus.TCP, 80))
	hairpinEPs := slice(hairpin, "hairpin-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)},
		ep("10.244.2.6", ""), ep("10.244.1.7", "node-b"), ep("10.244.3.8", "node-c"))
	big, bigEPs := filler(1000)

	p := Render(baseConfig(), full(state(node(), sticky, stickyEPs, local, localEPs, hairpin, hairpinEPs, big, bigEPs)))
	checkConsistent(t, p)
	if commented, _ := endpointComments(p); commented != 0 {
		t.Errorf("%d endpoint rules keep their comment over 1,000 endpoints", commented)
	}
	golden(t, "large-cluster", withoutFiller(payload(p)))
}

// TestLargeClusterCountsAsKubeProxy: the endpoints are counted as kube-proxy
// counts them for largeClusterEndpointsThreshold: per service port of the
// family, one per address:port, ready or not, and only more than 1,000 is a
// large cluster.
func TestLargeClusterCountsAsKubeProxy(t *testing.T) {
	range4 := remoteEndpoints
	one := svc("demo", "one", "10.96.1.1", port("http", bus.TCP, 80))
	two := svc("demo", "two", "10.96.1.2", port("http", bus.TCP, 80), port("dns", bus.UDP, 53))
	bothPorts := []bus.EndpointPort{eport("http", bus.TCP, 8080), eport("dns", bus.UDP, 5353)}
	http := []bus.EndpointPort{eport("http", bus.TCP, 8080)}
	notReady := range4(1000, 1)
	notReady[0].Ready, notReady[0].Serving = false, false
	v6 := []bus.Endpoint{ep("fd00::1", "node-b"), ep("fd00::2", "node-b")}

	cases := []struct {
		name  string
		st    bus.State
		large bool
	}{
		{"1000 endpoints", state(node(), one, slice(one, "a", http, range4(0, 1000)...)), false},
		{"1001 endpoints", state(node(), one, slice(one, "a", http, range4(0, 1001)...)), true},
		{"1000 ready and 1 not", state(node(), one, slice(one, "a", http, range4(0, 1000)...), slice(one, "b", http, notReady...)), true},
		{"500 on each of two ports", state(node(), two, slice(two, "a", bothPorts, range4(0, 500)...)), false},
		{"501 on each of two ports", state(node(), two, slice(two, "a", bothPorts, range4(0, 501)...)), true},
		{"1000 and the same 10 again in another slice", state(node(), one, slice(one, "a", http, range4(0, 1000)...), slice(one, "b", http, range4(0, 10)...)), false},
		{"1000 and 2 of the other family", state(node(), one, slice(one, "a", http, range4(0, 1000)...), slice(one, "b", http, v6...)), false},
		{"600 on a port the service has, 600 on one it has not", state(node(), one, slice(one, "a", bothPorts, range4(0, 600)...)), false},
		{"600 on each of two services", state(node(), one, two, slice(one, "a", http, range4(0, 600)...), slice(two, "b", http, range4(600, 600)...)), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := Render(baseConfig(), full(tc.st))
			commented, toEndpoint := endpointComments(p)
			if toEndpoint == 0 {
				t.Fatal("no endpoint rules")
			}
			if large := commented == 0; large != tc.large {
				t.Errorf("%d of %d endpoint rules commented; want a large cluster: %v", commented, toEndpoint, tc.large)
			}
			if !tc.large && commented != toEndpoint {
				t.Errorf("%d of %d endpoint rules commented; want all", commented, toEndpoint)
			}
		})
	}
}

// TestLargeClusterTransition: when the cluster crosses 1,000 endpoints, either
// way, the cached renderer writes every chain holding endpoint rules again,
// once (the next render of the same state changes nothing), and nothing else;
// each plan is a fresh render's, and coming back gives the first plan again.
func TestLargeClusterTransition(t *testing.T) {
	web, webEPs := webService() // a local endpoint (a KUBE-SEP- chain) and remote ones
	st := func(fill int) bus.State {
		big, bigEPs := filler(fill)
		return state(node(), web, webEPs, big, bigEPs)
	}
	_, webCount := endpointComments(Render(baseConfig(), full(state(node(), web, webEPs))))
	if webCount == 0 {
		t.Fatal("web has no endpoint rules")
	}
	small, large := st(1000-len(webEPs.Items)*len(webEPs.Ports)), st(1001-len(webEPs.Items)*len(webEPs.Ports))
	rr := NewRenderer(baseConfig())
	render := func(gen uint64, s bus.State) *bus.Plan {
		t.Helper()
		snap := &bus.Snapshot{Generation: gen, State: s}
		got := rr.Render(snap)
		if g, w := payload(got), payload(Render(baseConfig(), snap)); g != w {
			t.Fatalf("generation %d: cached render differs from a fresh one:\n%s", gen, diff(w, g))
		}
		return got
	}
	a := render(1, small)
	if commented, n := endpointComments(a); commented != n {
		t.Fatalf("at 1,000 endpoints %d of %d endpoint rules commented; want all", commented, n)
	}
	holding := chainsWithEndpointRules(a)
	b := render(2, large)
	if commented, _ := endpointComments(b); commented != 0 {
		t.Fatalf("at 1,001 endpoints %d endpoint rules commented; want none", commented)
	}
	if nat, filter := rewritten(a, b); !slices.Equal(nat, holding) || len(filter) > 0 {
		t.Errorf("going large rewrote nat %v, filter %v; want the nat chains holding endpoint rules %v", nat, filter, holding)
	}
	if nat, filter := rewritten(b, render(3, large)); len(nat)+len(filter) > 0 {
		t.Errorf("the same large state rendered again rewrote nat %v, filter %v", nat, filter)
	}
	c := render(4, small)
	if nat, filter := rewritten(b, c); !slices.Equal(nat, holding) || len(filter) > 0 {
		t.Errorf("going small rewrote nat %v, filter %v; want the nat chains holding endpoint rules %v", nat, filter, holding)
	}
	if !maps.Equal(chainHashes(a), chainHashes(c)) {
		t.Error("back at 1,000 endpoints the plan is not the first one")
	}
}

// chainsWithEndpointRules are the nat chains of p with a rule that sends to an
// endpoint, or a KUBE-SEP- chain, sorted.
func chainsWithEndpointRules(p *bus.Plan) []string {
	var out []string
	for _, c := range p.Table(nf.TableNAT).Chains {
		if strings.Contains(c.Rules, "-j DNAT") || nf.KindOf(c.Name) == nf.KindEndpoint {
			out = append(out, c.Name)
		}
	}
	slices.Sort(out)
	return out
}

// rewritten are the chains commit writes or deletes when next follows prev:
// nat's, sorted, and filter's.
func rewritten(prev, next *bus.Plan) (nat, filter []string) {
	nat = append(changedChains(prev, next, nf.TableNAT), goneChains(prev, next, nf.TableNAT)...)
	slices.Sort(nat)
	filter = append(changedChains(prev, next, nf.TableFilter), goneChains(prev, next, nf.TableFilter)...)
	return nat, filter
}

// TestFlowLargeCluster: the packet tracer follows endpoint rules without
// comments as any others: over 1,000 endpoints a ClusterIP still reaches
// every endpoint (a KUBE-SEP- chain's included), masqueraded as before.
func TestFlowLargeCluster(t *testing.T) {
	web, eps := webService()
	big, bigEPs := filler(1000)
	p := renderFlows(t, baseConfig(), state(node(), web, eps, big, bigEPs))
	if commented, _ := endpointComments(p); commented != 0 {
		t.Fatalf("%d endpoint rules commented; want a large cluster", commented)
	}
	checkFlows(t, p, nil, []flow{
		{pod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
		{pod.udp("10.96.0.10", 53), dnat(false, webDNS...)},
		{pod.sctp("10.96.0.10", 9), dnat(false, webSig...)},
		{hostProc.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
		{outside.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
		{pod.tcp("10.96.0.10", 81), passes},
	})
}
