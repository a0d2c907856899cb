package render

import (
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

func full(st bus.State) *bus.Snapshot { return &bus.Snapshot{Generation: 1, State: st, Full: true} }

// TestGolden renders one snapshot per Service feature and compares the
// iptables-restore payload with testdata/<name>.golden.
func TestGolden(t *testing.T) {
	web := svc("demo", "web", "10.96.0.10", port("http", bus.TCP, 80), port("dns", bus.UDP, 53), port("sig", bus.SCTP, 9))
	webEPs := slice(web, "web-1", []bus.EndpointPort{eport("http", bus.TCP, 8080), eport("dns", bus.UDP, 5353), eport("sig", bus.SCTP, 9090)},
		ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"), ep("10.244.3.7", "node-c"))

	nodePort := svc("demo", "np", "10.96.0.20", bus.Port{Name: "", Protocol: bus.TCP, Port: 80, NodePort: 30080})
	npEPs := slice(nodePort, "np-1", []bus.EndpointPort{eport("", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))

	lb := svc("demo", "lb", "10.96.0.30", bus.Port{Name: "https", Protocol: bus.TCP, Port: 443, NodePort: 30443})
	lb.ExternalIPs = []netip.Addr{ip("203.0.113.5")}
	lb.LoadBalancerIPs = []netip.Addr{ip("198.51.100.50")}
	lb.LoadBalancerSourceRanges = []netip.Prefix{prefix("192.168.1.0/24"), prefix("203.0.113.0/24")}
	lbEPs := slice(lb, "lb-1", []bus.EndpointPort{eport("https", bus.TCP, 8443)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))

	local := svc("demo", "local", "10.96.0.40", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30040})
	local.ExternalPolicyLocal, local.HealthCheckNodePort = true, 32040
	local.LoadBalancerIPs = []netip.Addr{ip("198.51.100.40")}
	localEPs := slice(local, "local-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	remoteOnlyEPs := slice(local, "local-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.6", "node-b"))

	internal := svc("demo", "internal", "10.96.0.50", port("http", bus.TCP, 80))
	internal.InternalPolicyLocal = true
	internalEPs := slice(internal, "internal-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	internalRemote := slice(internal, "internal-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.6", "node-b"))

	sticky := svc("demo", "sticky", "10.96.0.60", port("http", bus.TCP, 80))
	sticky.AffinitySeconds = 30
	stickyEPs := slice(sticky, "sticky-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))

	term := svc("demo", "term", "10.96.0.70", port("http", bus.TCP, 80))
	terminating := bus.Endpoint{Addr: ip("10.244.1.8"), Serving: true, Terminating: true, NodeName: testNode}
	notServing := bus.Endpoint{Addr: ip("10.244.1.9"), Terminating: true, NodeName: testNode}
	termEPs := slice(term, "term-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, terminating, notServing)

	zoned := svc("demo", "zoned", "10.96.0.80", port("http", bus.TCP, 80))
	za, zb := ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b")
	za.Hints, zb.Hints = &bus.Hints{Zones: []string{"zone-a"}}, &bus.Hints{Zones: []string{"zone-b"}}
	zonedEPs := slice(zoned, "zoned-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, za, zb)

	all := svc("demo", "all", "10.96.0.90", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30090}, bus.Port{Name: "dns", Protocol: bus.UDP, Port: 53, NodePort: 30053})
	all.ExternalIPs = []netip.Addr{ip("203.0.113.9")}
	all.LoadBalancerIPs = []netip.Addr{ip("198.51.100.90")}
	all.LoadBalancerSourceRanges = []netip.Prefix{prefix("203.0.113.0/24")}
	all.ExternalPolicyLocal, all.HealthCheckNodePort, all.InternalPolicyLocal, all.AffinitySeconds = true, 32090, true, 600
	allA, allB, allT := ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"), bus.Endpoint{Addr: ip("10.244.1.8"), Serving: true, Terminating: true, NodeName: testNode}
	allA.Hints, allB.Hints = &bus.Hints{Zones: []string{"zone-a"}}, &bus.Hints{Zones: []string{"zone-b"}}
	allEPs := slice(all, "all-1", []bus.EndpointPort{eport("http", bus.TCP, 8080), eport("dns", bus.UDP, 5353)}, allA, allB, allT)

	hairpin := svc("demo", "hairpin", "10.96.0.110", port("http", bus.TCP, 80))
	hairpinEPs := slice(hairpin, "hairpin-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)},
		ep("10.244.2.6", ""), ep("10.244.1.7", "node-b"), ep("10.244.3.8", "node-c"))

	v6 := &bus.Service{ServiceKey: bus.ServiceKey{Namespace: "demo", Name: "v6"}, ClusterIPs: []netip.Addr{ip("10.96.0.100"), ip("fd00:10:96::100")},
		Ports: []bus.Port{{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30100}}}
	v6EPs := slice(v6, "v6-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("fd00:10:244:1::5", testNode), ep("fd00:10:244:2::6", "node-b"))
	v6Node := node()
	v6Node.Addrs = append(v6Node.Addrs, ip("2001:db8::10"))

	cfg := baseConfig()
	with := func(change func(*Config)) Config { c := cfg; change(&c); return c }
	cases := []struct {
		name string
		cfg  Config
		st   bus.State
	}{
		{"clusterip", cfg, state(node(), web, webEPs)},
		{"no-endpoints", cfg, state(node(), web)},
		{"masquerade-all", with(func(c *Config) { c.MasqueradeAll = true }), state(node(), web, webEPs)},
		{"no-cluster-cidr", with(func(c *Config) { c.ClusterCIDRs = nil }), state(node(), web, webEPs)},
		{"nodeport", cfg, state(node(), nodePort, npEPs)},
		{"nodeport-no-endpoints", cfg, state(node(), nodePort)},
		{"loadbalancer-source-ranges", cfg, state(node(), lb, lbEPs)},
		{"external-policy-local", cfg, state(node(), local, localEPs)},
		{"external-policy-local-none-local", cfg, state(node(), local, remoteOnlyEPs)},
		{"internal-policy-local", cfg, state(node(), internal, internalEPs)},
		{"internal-policy-local-none-local", cfg, state(node(), internal, internalRemote)},
		{"session-affinity", cfg, state(node(), sticky, stickyEPs)},
		{"terminating", cfg, state(node(), term, termEPs)},
		{"topology-zone", cfg, state(node(), zoned, zonedEPs)},
		{"all-features", cfg, state(node(), all, allEPs)},
		{"hairpin-maybe-local", cfg, state(node(), hairpin, hairpinEPs)},
		{"ipv6", with(func(c *Config) {
			c.Family, c.ClusterCIDRs, c.LocalhostNodePorts = bus.IPv6, []netip.Prefix{prefix("fd00:10:244::/48")}, false
		}), state(v6Node, v6, v6EPs)},
		{"detect-node-cidr", with(func(c *Config) { c.DetectLocal = DetectNodeCIDR }), state(node(), nodePort, npEPs)},
		{"detect-bridge", with(func(c *Config) { c.DetectLocal, c.BridgeInterface = DetectBridgeInterface, "cbr0" }), state(node(), nodePort, npEPs)},
		{"detect-interface-prefix", with(func(c *Config) { c.DetectLocal, c.InterfacePrefix = DetectInterfacePrefix, "veth" }), state(node(), nodePort, npEPs)},
		{"nodeport-addresses-cidr", with(func(c *Config) { c.NodePortAddresses = []netip.Prefix{prefix("192.168.1.0/24"), prefix("127.0.0.0/8")} }),
			withAddrs(state(node(), nodePort, npEPs), "192.168.1.10", "10.0.0.1", "127.0.0.1", "fd00::1")},
		{"nodeport-addresses-primary", with(func(c *Config) { c.NodePortPrimary = true }), state(node(), nodePort, npEPs)},
		{"no-localhost-nodeports", with(func(c *Config) { c.LocalhostNodePorts = false }), state(node(), nodePort, npEPs)},
		{"conntrack-liberal", with(func(c *Config) { c.ConntrackLiberal = true }), state(node(), web, webEPs)},
		{"masquerade-bit", with(func(c *Config) { c.MasqueradeBit = 5 }), state(node(), web, webEPs)},
		{"no-nfacct", with(func(c *Config) { c.NFAcct = NFAcctObjects{} }), state(node(), nodePort, npEPs)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := Render(tc.cfg, full(tc.st))
			checkConsistent(t, p)
			golden(t, tc.name, payload(p))
		})
	}
}

func withAddrs(st bus.State, addrs ...string) bus.State {
	for _, a := range addrs {
		st.LocalAddrs = append(st.LocalAddrs, ip(a))
	}
	return st
}

func tableOf(p *bus.Plan, name string) bus.TablePayload {
	for _, tp := range p.Tables {
		if tp.Table == name {
			return tp
		}
	}
	return bus.TablePayload{}
}

// TestServiceOfOtherFamilyIgnored: an IPv4-only service writes nothing to IPv6.
func TestServiceOfOtherFamilyIgnored(t *testing.T) {
	a := svc("ns", "a", "10.96.0.1", port("http", bus.TCP, 80))
	aEPs := slice(a, "a-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode))
	cfg := baseConfig()
	cfg.Family = bus.IPv6
	p := Render(cfg, full(state(node(), a, aEPs)))
	if strings.Contains(payload(p), "ns/a") {
		t.Errorf("IPv4 service in IPv6 payload:\n%s", payload(p))
	}
}

// TestEndpointsOfWrongPortOrFamilyIgnored: slices of the other family, and slice
// ports that match no service port by name and protocol, are not used.
func TestEndpointsOfWrongPortOrFamilyIgnored(t *testing.T) {
	a := svc("ns", "a", "10.96.0.1", port("http", bus.TCP, 80))
	wrongName := slice(a, "a-1", []bus.EndpointPort{eport("other", bus.TCP, 8080)}, ep("10.244.1.5", testNode))
	wrongProto := slice(a, "a-2", []bus.EndpointPort{eport("http", bus.UDP, 8080)}, ep("10.244.1.6", testNode))
	v6 := slice(a, "a-3", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("fd00::7", testNode))
	p := Render(baseConfig(), full(state(node(), a, wrongName, wrongProto, v6)))
	out := payload(p)
	if strings.Contains(out, "-j DNAT") || !strings.Contains(out, "ns/a:http has no endpoints") {
		t.Errorf("want a REJECT and no DNAT:\n%s", out)
	}
}

// TestDuplicateEndpointsAcrossSlices: an address in two slices is used once.
func TestDuplicateEndpointsAcrossSlices(t *testing.T) {
	a := svc("ns", "a", "10.96.0.1", port("http", bus.TCP, 80))
	s1 := slice(a, "a-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode))
	s2 := slice(a, "a-2", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.1.6", testNode))
	out := payload(Render(baseConfig(), full(state(node(), a, s1, s2))))
	if n := strings.Count(out, "--to-destination 10.244.1.5:8080"); n != 1 {
		t.Errorf("10.244.1.5 DNATed by %d rules, want 1:\n%s", n, out)
	}
	if !strings.Contains(out, "--probability 0.5000000000") {
		t.Errorf("two endpoints want probability 0.5:\n%s", out)
	}
}

// TestHealthChecksAndNoLocalCounts: health-check answers and no-local-endpoint
// counts follow the endpoints.
func TestHealthChecksAndNoLocalCounts(t *testing.T) {
	s := svc("ns", "lb", "10.96.0.1", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30080})
	s.ExternalPolicyLocal, s.HealthCheckNodePort = true, 32000
	local := slice(s, "s-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.1.6", testNode), ep("10.244.2.7", "node-b"))
	p := Render(baseConfig(), full(state(node(), s, local)))
	if got := p.HealthChecks.Services[s.ServiceKey]; got != (bus.HealthCheck{NodePort: 32000, LocalEndpoints: 2}) {
		t.Errorf("health check = %+v, want port 32000 with 2 local endpoints", got)
	}
	remote := slice(s, "s-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.7", "node-b"))
	p = Render(baseConfig(), full(state(node(), s, remote)))
	if got := p.HealthChecks.Services[s.ServiceKey]; got.LocalEndpoints != 0 || got.NodePort != 32000 {
		t.Errorf("health check = %+v, want port 32000 with 0 local endpoints", got)
	}
	if p.NoLocalEndpoints != (bus.NoLocal{External: 1}) {
		t.Errorf("no-local counts = %v, want external 1, internal 0", p.NoLocalEndpoints)
	}
}

// TestUnservedPorts: the plan names the service ports without endpoints and,
// for a Local policy, without local endpoints; a port with endpoints is in
// neither, and one that gets an endpoint leaves the list.
func TestUnservedPorts(t *testing.T) {
	served := svc("ns", "served", "10.96.0.1", port("http", bus.TCP, 80))
	empty := svc("ns", "empty", "10.96.0.2", port("http", bus.TCP, 80), port("dns", bus.UDP, 53))
	remote := svc("ns", "remote", "10.96.0.3", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30080})
	remote.ExternalPolicyLocal = true
	eps := []bus.EndpointPort{eport("http", bus.TCP, 8080)}
	servedSlice := slice(served, "served-1", eps, ep("10.244.1.5", testNode))
	remoteSlice := slice(remote, "remote-1", eps, ep("10.244.2.7", "node-b"))
	rr := NewRenderer(baseConfig())
	p := rr.Render(full(state(node(), served, empty, remote, servedSlice, remoteSlice)))
	want := bus.Unserved{
		NoEndpoints:      bus.Names{First: []string{"ns/empty:dns", "ns/empty:http"}, Total: 2},
		NoLocalEndpoints: bus.Names{First: []string{"ns/remote:http"}, Total: 1},
	}
	if p.Unserved == nil || !reflect.DeepEqual(*p.Unserved, want) {
		t.Errorf("unserved = %+v, want %+v", p.Unserved, want)
	}
	emptySlice := slice(empty, "empty-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.6", testNode))
	p = rr.Render(full(state(node(), served, empty, remote, servedSlice, remoteSlice, emptySlice)))
	want.NoEndpoints = bus.Names{First: []string{"ns/empty:dns"}, Total: 1}
	if p.Unserved == nil || !reflect.DeepEqual(*p.Unserved, want) {
		t.Errorf("after ns/empty:http got an endpoint: unserved = %+v, want %+v", p.Unserved, want)
	}
}

// TestUDPFrontEnds: the UDP map conntrack uses lists every UDP front-end with the
// endpoints its policy reaches.
func TestUDPFrontEnds(t *testing.T) {
	s := svc("ns", "dns", "10.96.0.10", bus.Port{Name: "dns", Protocol: bus.UDP, Port: 53, NodePort: 30053})
	s.ExternalIPs = []netip.Addr{ip("203.0.113.1")}
	eps := slice(s, "dns-1", []bus.EndpointPort{eport("dns", bus.UDP, 5353)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	p := Render(baseConfig(), full(state(node(), s, eps)))
	want := []netip.AddrPort{netip.MustParseAddrPort("10.244.1.5:5353"), netip.MustParseAddrPort("10.244.2.6:5353")}
	for _, fe := range []string{"10.96.0.10:53", "203.0.113.1:53", "0.0.0.0:30053"} {
		if got := p.UDP[netip.MustParseAddrPort(fe)]; !slices.Equal(got, want) {
			t.Errorf("UDP front-end %s -> %v, want %v", fe, got, want)
		}
	}
	if len(p.UDP) != 3 {
		t.Errorf("UDP front-ends = %v, want 3", p.UDP)
	}
}

// TestUDPFrontEndSharedByTwoServices: two services with the same external IP
// and UDP port: the front-end goes to the later one's endpoints (in key order),
// and back to the other's once the later one goes, in a Renderer that kept the
// first plan as in a fresh one.
func TestUDPFrontEndSharedByTwoServices(t *testing.T) {
	var states []bus.State
	var objs []any
	for i, name := range []string{"a", "b"} {
		s := svc("ns", name, fmt.Sprintf("10.96.0.%d", 10+i), bus.Port{Name: "dns", Protocol: bus.UDP, Port: 53})
		s.ExternalIPs = []netip.Addr{ip("203.0.113.1")}
		objs = append(objs, s, slice(s, name+"-1", []bus.EndpointPort{eport("dns", bus.UDP, 5353)}, ep(fmt.Sprintf("10.244.1.%d", 5+i), testNode)))
	}
	states = append(states, state(node(), objs...), state(node(), objs[:2]...))
	front := netip.MustParseAddrPort("203.0.113.1:53")
	rr := NewRenderer(baseConfig())
	for i, want := range []string{"10.244.1.6:5353", "10.244.1.5:5353"} {
		got := rr.Render(&bus.Snapshot{Generation: uint64(i), State: states[i]}).UDP[front]
		if fresh := Render(baseConfig(), full(states[i])).UDP[front]; !slices.Equal(got, fresh) {
			t.Errorf("plan %d: %s -> %v, a fresh render's %v", i, front, got, fresh)
		}
		if !slices.Equal(got, []netip.AddrPort{netip.MustParseAddrPort(want)}) {
			t.Errorf("plan %d: %s -> %v, want %s", i, front, got, want)
		}
	}
}

// TestBuckets: KUBE-SERVICES dispatches by /16, then /20, to a bucket chain per
// /24 that holds the service rules. A service in a new /24 adds its bucket and a
// jump in its /20's chain, and leaves KUBE-SERVICES alone; one in a new /16 adds
// a chain on every level; a chain goes when its last service does.
func TestBuckets(t *testing.T) {
	a := svc("ns", "a", "10.96.1.1", port("http", bus.TCP, 80))
	b := svc("ns", "b", "10.96.2.1", port("http", bus.TCP, 80))
	c := svc("ns", "c", "10.100.7.1", port("http", bus.TCP, 80))
	aEPs := slice(a, "a-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.5", "node-b"))
	bEPs := slice(b, "b-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.6", "node-b"))
	cEPs := slice(c, "c-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.7", "node-b"))
	chain := func(p string) string { return nf.BucketChain(prefix(p)) }
	jump := func(from, to string) string {
		return "-A " + from + " -m comment --comment \"services in " + to + "\" -d " + to + " -j " + chain(to) + "\n"
	}
	first := Render(baseConfig(), full(state(node(), a, aEPs)))
	for _, want := range []string{jump(nf.ChainServices, "10.96.0.0/16"), jump(chain("10.96.0.0/16"), "10.96.0.0/20"), jump(chain("10.96.0.0/20"), "10.96.1.0/24")} {
		if !strings.Contains(payload(first), want) {
			t.Errorf("no dispatch %q:\n%s", want, payload(first))
		}
	}

	second := Render(baseConfig(), full(state(node(), a, b, aEPs, bEPs)))
	bBucket := nf.BucketChain(nf.Bucket(b.ClusterIPs[0]))
	if bBucket != chain("10.96.2.0/24") {
		t.Fatalf("bucket of %s = %s, want the chain of 10.96.2.0/24", b.ClusterIPs[0], bBucket)
	}
	wantRewritten := []string{bBucket, chain("10.96.0.0/20"), nf.ServiceChain(nf.PrefixService, b.PortName(b.Ports[0]))}
	if got := changedChains(first, second, "nat"); !sameSet(got, wantRewritten) {
		t.Errorf("a service in a new /24 rewrote %v; want only %v (its bucket, its /20 and its service chain)", got, wantRewritten)
	}
	if want := jump(chain("10.96.0.0/20"), "10.96.2.0/24"); !strings.Contains(payload(second), want) {
		t.Errorf("no dispatch to the new bucket %q:\n%s", want, payload(second))
	}

	third := Render(baseConfig(), full(state(node(), a, b, c, aEPs, bEPs, cEPs)))
	newChains := []string{chain("10.100.0.0/16"), chain("10.100.0.0/20"), chain("10.100.7.0/24")}
	for _, want := range []string{jump(nf.ChainServices, "10.100.0.0/16"), jump(newChains[0], "10.100.0.0/20"), jump(newChains[1], "10.100.7.0/24")} {
		if !strings.Contains(payload(third), want) {
			t.Errorf("a service in a new /16: no dispatch %q:\n%s", want, payload(third))
		}
	}

	fourth := Render(baseConfig(), full(state(node(), a, aEPs)))
	deleted := goneChains(third, fourth, "nat")
	for _, gone := range append(newChains, bBucket) {
		if !slices.Contains(deleted, gone) {
			t.Errorf("empty chain %s not deleted: %v", gone, deleted)
		}
	}
	if slices.Contains(deleted, chain("10.96.0.0/20")) || slices.Contains(deleted, chain("10.96.0.0/16")) {
		t.Errorf("a dispatch chain that still leads to a service was deleted: %v", deleted)
	}
}

// changedChains lists the chains of table that next has and prev has not, or has
// with other rules: what commit rewrites when next follows prev.
func changedChains(prev, next *bus.Plan, table string) []string {
	old := map[string]uint64{}
	for _, c := range tableOf(prev, table).Chains {
		old[c.Name] = c.Hash
	}
	var out []string
	for _, c := range tableOf(next, table).Chains {
		if h, ok := old[c.Name]; !ok || h != c.Hash {
			out = append(out, c.Name)
		}
	}
	return out
}

// goneChains lists the chains of table that prev has and next has not.
func goneChains(prev, next *bus.Plan, table string) []string {
	now := map[string]bool{}
	for _, c := range tableOf(next, table).Chains {
		now[c.Name] = true
	}
	var out []string
	for _, c := range tableOf(prev, table).Chains {
		if !now[c.Name] {
			out = append(out, c.Name)
		}
	}
	return out
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// TestHairpinEndpointsGetMasqueradeChain: an endpoint that may be a pod on this
// node (on this node, with no nodeName, or inside this node's pod CIDR) gets a
// KUBE-SEP- chain that masquerades traffic it sends to itself; a pod known to be
// elsewhere stays an inline DNAT. Which endpoints count as local for the
// traffic policies does not change: only nodeName says that.
func TestHairpinEndpointsGetMasqueradeChain(t *testing.T) {
	s := svc("ns", "hp", "10.96.0.1", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30080})
	s.ExternalPolicyLocal, s.HealthCheckNodePort = true, 32000
	noNode := ep("10.244.2.6", "")       // no nodeName, outside this node's pod CIDR
	inCIDR := ep("10.244.1.7", "node-b") // says another node, but in this node's pod CIDR
	eps := slice(s, "hp-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)},
		ep("10.244.1.5", testNode), noNode, inCIDR, ep("10.244.3.8", "node-c"))
	p := Render(baseConfig(), full(state(node(), s, eps)))
	checkConsistent(t, p)
	out := payload(p)
	name := s.PortName(s.Ports[0])
	for _, addr := range []string{"10.244.1.5", "10.244.2.6", "10.244.1.7"} {
		sep := nf.EndpointName(name, addr+":8080")
		want := "-A " + sep + " -m comment --comment \"ns/hp:http\" -s " + addr + "/32 -j KUBE-MARK-MASQ\n"
		if !strings.Contains(out, want) {
			t.Errorf("endpoint %s has no hairpin masquerade %q:\n%s", addr, want, out)
		}
		if !strings.Contains(out, "-j "+sep+"\n") {
			t.Errorf("the cluster policy chain does not jump to %s for %s:\n%s", sep, addr, out)
		}
	}
	remote := nf.EndpointName(name, "10.244.3.8:8080")
	if strings.Contains(out, remote) {
		t.Errorf("endpoint 10.244.3.8 on node-c got a KUBE-SEP- chain:\n%s", out)
	}
	if !strings.Contains(out, "-j DNAT --to-destination 10.244.3.8:8080") {
		t.Errorf("endpoint 10.244.3.8 on node-c is not an inline DNAT:\n%s", out)
	}
	// The Local policy still only uses the endpoint whose nodeName is this node.
	svl := nf.ServiceChain(nf.PrefixServiceLocal, name)
	var svlRules []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "-A "+svl+" ") {
			svlRules = append(svlRules, line)
		}
	}
	if len(svlRules) != 1 || !strings.Contains(svlRules[0], nf.EndpointName(name, "10.244.1.5:8080")) {
		t.Errorf("local policy chain %s = %q, want only 10.244.1.5", svl, svlRules)
	}
	if got := p.HealthChecks.Services[s.ServiceKey].LocalEndpoints; got != 1 {
		t.Errorf("health check counts %d local endpoints, want 1", got)
	}
}

// TestFirewallNodeExceptionOnlyPrimaryIP: the firewall chain lets the node's own
// looped-back requests (source: the VIP) through only when a source range holds
// the node's primary IP of the family, as kube-proxy does; a range that holds
// only another node address does not.
func TestFirewallNodeExceptionOnlyPrimaryIP(t *testing.T) {
	lb := func(family bus.Family, sourceRange string) (Config, bus.State, string) {
		cfg := baseConfig()
		n := node()
		n.Addrs = []netip.Addr{ip("192.168.1.10"), ip("2001:db8::10"), ip("172.16.0.5"), ip("2001:db8:1::20")}
		s := svc("ns", "lb", "10.96.0.30", bus.Port{Name: "https", Protocol: bus.TCP, Port: 443, NodePort: 30443})
		vip, epAddr := "198.51.100.50", "10.244.2.6"
		if family == bus.IPv6 {
			cfg.Family, cfg.ClusterCIDRs, cfg.LocalhostNodePorts = bus.IPv6, []netip.Prefix{prefix("fd00:10:244::/48")}, false
			s.ClusterIPs = []netip.Addr{ip("fd00:10:96::30")}
			vip, epAddr = "2001:db8:ff::50", "fd00:10:244:2::6"
		}
		s.LoadBalancerIPs = []netip.Addr{ip(vip)}
		s.LoadBalancerSourceRanges = []netip.Prefix{prefix(sourceRange)}
		eps := slice(s, "lb-1", []bus.EndpointPort{eport("https", bus.TCP, 8443)}, ep(epAddr, "node-b"))
		return cfg, state(n, s, eps), hostCIDR(ip(vip))
	}
	for _, tc := range []struct {
		family      bus.Family
		sourceRange string
		allowNode   bool
	}{
		{bus.IPv4, "192.168.1.0/24", true},
		{bus.IPv4, "172.16.0.0/16", false},
		{bus.IPv6, "2001:db8::/64", true},
		{bus.IPv6, "2001:db8:1::/48", false},
	} {
		cfg, st, vip := lb(tc.family, tc.sourceRange)
		out := payload(Render(cfg, full(st)))
		fw := nf.ServiceChain(nf.PrefixFirewall, bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: "ns", Name: "lb"}, Port: "https", Protocol: bus.TCP})
		if !strings.Contains(out, "-A "+fw+" ") {
			t.Fatalf("%v %s: no firewall chain:\n%s", tc.family, tc.sourceRange, out)
		}
		got := strings.Contains(out, "-s "+vip+" -j KUBE-EXT-")
		if got != tc.allowNode {
			t.Errorf("%v source range %s: node exception (-s %s) written = %v, want %v:\n%s", tc.family, tc.sourceRange, vip, got, tc.allowNode, out)
		}
	}
}

// TestHealthCheckAddrs: healthCheckNodePort servers listen where --nodeport-addresses
// says, as kube-proxy's do: every address when it is unset, else the local
// addresses of this family it selects, loopback included (kube-proxy's health
// check servers listen on whatever the flag matches), and nowhere when it matches
// nothing.
func TestHealthCheckAddrs(t *testing.T) {
	st := withAddrs(state(node()), "192.168.1.10", "10.0.0.1", "127.0.0.1", "fd00::1", "::1")
	v6Node := node()
	v6Node.Addrs = []netip.Addr{ip("192.168.1.10"), ip("2001:db8::10")}
	v6 := func(c *Config) { c.Family, c.ClusterCIDRs, c.LocalhostNodePorts = bus.IPv6, nil, false }
	for _, tc := range []struct {
		name   string
		change func(*Config)
		st     bus.State
		want   []netip.Addr
	}{
		{"unset: every address", func(*Config) {}, st, nil},
		{"cidrs", func(c *Config) {
			c.NodePortAddresses = []netip.Prefix{prefix("192.168.1.0/24"), prefix("127.0.0.0/8")}
		}, st, []netip.Addr{ip("127.0.0.1"), ip("192.168.1.10")}},
		{"cidrs without localhost nodeports", func(c *Config) {
			c.NodePortAddresses, c.LocalhostNodePorts = []netip.Prefix{prefix("192.168.1.0/24"), prefix("127.0.0.0/8")}, false
		}, st, []netip.Addr{ip("127.0.0.1"), ip("192.168.1.10")}},
		{"cidrs matching nothing", func(c *Config) { c.NodePortAddresses = []netip.Prefix{prefix("172.16.0.0/12")} }, st, []netip.Addr{}},
		{"ipv6 cidrs", func(c *Config) { v6(c); c.NodePortAddresses = []netip.Prefix{prefix("fd00::/8"), prefix("::1/128")} }, st, []netip.Addr{ip("::1"), ip("fd00::1")}},
		{"zero cidr: every address", func(c *Config) { c.NodePortAddresses = []netip.Prefix{prefix("192.168.1.0/24"), prefix("0.0.0.0/0")} }, st, nil},
		{"primary", func(c *Config) { c.NodePortPrimary = true }, st, []netip.Addr{ip("192.168.1.10")}},
		{"ipv6 primary", func(c *Config) { v6(c); c.NodePortPrimary = true }, state(v6Node), []netip.Addr{ip("2001:db8::10")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := baseConfig()
			tc.change(&cfg)
			got := newRuleWriter(cfg, full(tc.st)).healthCheckAddrs()
			if (got == nil) != (tc.want == nil) || !slices.Equal(got, tc.want) {
				t.Errorf("health check addresses = %v (nil: %v), want %v (nil: %v)", got, got == nil, tc.want, tc.want == nil)
			}
		})
	}
}

// maxDispatch is the most dispatch rules (jumps to bucket chains) one chain may
// hold when service addresses fill a /12 (IPv6: a /108): a new connection walks
// at most this many rules at each level before it reaches its bucket.
const maxDispatch = 16

// TestDispatchWalkIsShort: with 10k ClusterIPs at random over the service CIDR,
// as the apiserver allocates them, every list of bucket jumps a new connection
// walks is short, and so is its whole walk to its service's rule.
func TestDispatchWalkIsShort(t *testing.T) {
	for _, family := range []bus.Family{bus.IPv4, bus.IPv6} {
		t.Run(family.String(), func(t *testing.T) {
			cfg := baseConfig()
			if family == bus.IPv6 {
				cfg.Family, cfg.ClusterCIDRs, cfg.LocalhostNodePorts = bus.IPv6, []netip.Prefix{prefix("fd00:10:244::/48")}, false
			}
			st := rendertest.SyntheticStateOf(family, 10000, 1)
			p := Render(cfg, full(st))
			checkConsistent(t, p)
			rules := natRules(p)
			longestBucket := 0
			for chain, lines := range rules {
				dispatch := 0
				for _, line := range lines {
					if strings.Contains(line, " -j "+nf.PrefixBucket) {
						dispatch++
					}
				}
				if dispatch > maxDispatch {
					t.Errorf("%s holds %d bucket jumps; want at most %d", chain, dispatch, maxDispatch)
				}
				if dispatch == 0 && strings.HasPrefix(chain, nf.PrefixBucket) {
					longestBucket = max(longestBucket, len(lines))
				}
			}
			worst, total := 0, 0
			for _, s := range st.Services {
				n, ok := walk(rules, netip.AddrPortFrom(s.ClusterIPs[0], 80))
				if !ok {
					t.Fatalf("a connection to %s:80 (%s) reaches no service chain", s.ClusterIPs[0], s.ServiceKey)
				}
				worst, total = max(worst, n), total+n
			}
			if limit := 3*maxDispatch + longestBucket; worst > limit {
				t.Errorf("a new connection walks up to %d rules; want at most %d (three dispatch levels and a bucket of %d)", worst, limit, longestBucket)
			}
			t.Logf("walk: longest %d rules, mean %.1f; longest bucket %d rules", worst, float64(total)/float64(len(st.Services)), longestBucket)
		})
	}
}
