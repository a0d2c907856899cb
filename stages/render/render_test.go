package render

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
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
	za.HintZones, zb.HintZones = []string{"zone-a"}, []string{"zone-b"}
	zonedEPs := slice(zoned, "zoned-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, za, zb)

	all := svc("demo", "all", "10.96.0.90", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30090}, bus.Port{Name: "dns", Protocol: bus.UDP, Port: 53, NodePort: 30053})
	all.ExternalIPs = []netip.Addr{ip("203.0.113.9")}
	all.LoadBalancerIPs = []netip.Addr{ip("198.51.100.90")}
	all.LoadBalancerSourceRanges = []netip.Prefix{prefix("203.0.113.0/24")}
	all.ExternalPolicyLocal, all.HealthCheckNodePort, all.InternalPolicyLocal, all.AffinitySeconds = true, 32090, true, 600
	allA, allB, allT := ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"), bus.Endpoint{Addr: ip("10.244.1.8"), Serving: true, Terminating: true, NodeName: testNode}
	allA.HintZones, allB.HintZones = []string{"zone-a"}, []string{"zone-b"}
	allEPs := slice(all, "all-1", []bus.EndpointPort{eport("http", bus.TCP, 8080), eport("dns", bus.UDP, 5353)}, allA, allB, allT)

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

func declared(p *bus.Plan, name string) []string {
	var out []string
	for _, c := range tableOf(p, name).Chains {
		out = append(out, c.Name)
	}
	return out
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
	if p.NoLocalEndpoints["external"] != 1 || p.NoLocalEndpoints["internal"] != 0 {
		t.Errorf("no-local counts = %v, want external 1, internal 0", p.NoLocalEndpoints)
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

// TestBuckets: KUBE-SERVICES sends each /24 of service addresses to its own
// bucket chain; a service in a new /24 adds a bucket (and a KUBE-SERVICES rule),
// and the bucket goes when its last service does.
func TestBuckets(t *testing.T) {
	a := svc("ns", "a", "10.96.1.1", port("http", bus.TCP, 80))
	b := svc("ns", "b", "10.96.2.1", port("http", bus.TCP, 80))
	aEPs := slice(a, "a-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.5", "node-b"))
	bEPs := slice(b, "b-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.6", "node-b"))
	first := Render(baseConfig(), full(state(node(), a, aEPs)))
	second := Render(baseConfig(), full(state(node(), a, b, aEPs, bEPs)))
	bBucket := nf.BucketChain(nf.Bucket(b.ClusterIPs[0]))
	if got := declared(second, "nat"); !slices.Contains(got, bBucket) || !slices.Contains(got, nf.ChainServices) {
		t.Errorf("a service in a new /24 rewrote %v; want its bucket %s and KUBE-SERVICES", got, bBucket)
	}
	if !strings.Contains(payload(second), "-A KUBE-SERVICES -m comment --comment \"services in 10.96.2.0/24\" -d 10.96.2.0/24 -j "+bBucket) {
		t.Errorf("no dispatch to the new bucket:\n%s", payload(second))
	}
	if got := declared(first, "nat"); slices.Contains(got, bBucket) {
		t.Errorf("bucket %s exists without a service in it: %v", bBucket, got)
	}
}
