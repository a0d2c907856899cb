package render

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render/tracer"
)

// The flow tests render a snapshot and follow packets through the plan with
// stages/render/tracer: they fail when a rule sends traffic to the wrong place,
// not when its text changes.

// client is where a packet comes from.
type client struct {
	src  netip.Addr
	from string // tracer.FromPrerouting or tracer.FromOutput
	in   string // input interface
}

var (
	pod       = client{ip("10.244.1.20"), tracer.FromPrerouting, "veth1234"}  // a pod on this node
	remotePod = client{ip("10.244.2.30"), tracer.FromPrerouting, "flannel.1"} // a pod on node-b, routed here
	hostProc  = client{ip("192.168.1.10"), tracer.FromOutput, ""}             // a process on the node
	localhost = client{ip("127.0.0.1"), tracer.FromOutput, ""}                // a process on the node, via loopback
	outside   = client{ip("172.30.0.7"), tracer.FromPrerouting, "eth0"}       // a host outside the cluster
)

// at is the same client with another source address.
func (c client) at(src string) client { c.src = ip(src); return c }

// via is the same client arriving on another interface.
func (c client) via(in string) client { c.in = in; return c }

func (c client) tcp(dst string, port int) tracer.Packet  { return c.packet("tcp", dst, port) }
func (c client) udp(dst string, port int) tracer.Packet  { return c.packet("udp", dst, port) }
func (c client) sctp(dst string, port int) tracer.Packet { return c.packet("sctp", dst, port) }

func (c client) packet(proto, dst string, port int) tracer.Packet {
	return tracer.Packet{Source: c.src, Dest: ip(dst), Proto: proto, DPort: port, From: c.from, InInterface: c.in}
}

// outcome is what must happen to a packet.
type outcome struct {
	verdict   string
	masq      bool
	endpoints []string // "addr:port", sorted; nil: not DNATed
}

// dnat: accepted and sent to exactly these endpoints (some path to each).
func dnat(masq bool, endpoints ...string) outcome {
	slices.SortFunc(endpoints, func(a, b string) int { return netip.MustParseAddrPort(a).Compare(netip.MustParseAddrPort(b)) })
	return outcome{verdict: tracer.Accept, masq: masq, endpoints: endpoints}
}

var (
	passes   = outcome{verdict: tracer.Accept} // not a service: untouched and accepted
	rejected = outcome{verdict: tracer.Reject}
	dropped  = outcome{verdict: tracer.Drop}
)

type flow struct {
	pkt  tracer.Packet
	want outcome
}

func describe(p tracer.Packet) string {
	in := ""
	if p.InInterface != "" {
		in = " in " + p.InInterface
	}
	return fmt.Sprintf("%s %s -> %s (%s%s)", p.Proto, p.Source, netip.AddrPortFrom(p.Dest, uint16(p.DPort)), p.From, in)
}

// Aspects of a flow that checkFlow compares.
const (
	wrongVerdict    = "verdict"
	wrongEndpoints  = "endpoints"
	wrongMasquerade = "masquerade"
)

// flowError is a flow that did not go as it should: the trace failed, or some
// aspects of its outcome differ.
type flowError struct {
	pkt      tracer.Packet
	traceErr error
	wrong    map[string]string // aspect -> what differs
	trace    []string
}

func (e *flowError) Error() string {
	if e.traceErr != nil {
		return fmt.Sprintf("%s: trace failed: %v", describe(e.pkt), e.traceErr)
	}
	var problems []string
	for _, aspect := range []string{wrongVerdict, wrongEndpoints, wrongMasquerade} {
		if w, ok := e.wrong[aspect]; ok {
			problems = append(problems, w)
		}
	}
	return fmt.Sprintf("%s: %s\n%s", describe(e.pkt), strings.Join(problems, "; "), strings.Join(e.trace, "\n"))
}

// checkFlow traces f through plan and returns a *flowError when the result
// differs from f.want; nodeIPs and localAddrs are the node's addresses.
func checkFlow(plan *bus.Plan, nodeIPs, localAddrs []netip.Addr, f flow) error {
	res := tracer.Trace(plan, nodeIPs, localAddrs, f.pkt)
	if res.Err != nil {
		return &flowError{pkt: f.pkt, traceErr: res.Err}
	}
	wrong := map[string]string{}
	if res.Verdict != f.want.verdict {
		wrong[wrongVerdict] = fmt.Sprintf("verdict %s, want %s", res.Verdict, f.want.verdict)
	}
	var got []string
	for _, e := range res.Endpoints {
		got = append(got, e.String())
	}
	if !slices.Equal(got, f.want.endpoints) {
		wrong[wrongEndpoints] = fmt.Sprintf("DNAT to %v, want %v", got, f.want.endpoints)
	}
	if res.Masqueraded != f.want.masq {
		wrong[wrongMasquerade] = fmt.Sprintf("masqueraded %v, want %v", res.Masqueraded, f.want.masq)
	}
	if len(wrong) == 0 {
		return nil
	}
	return &flowError{pkt: f.pkt, wrong: wrong, trace: res.Trace()}
}

// checkFlows asserts every flow through plan, for a node with node()'s
// addresses plus localAddrs.
func checkFlows(t *testing.T, plan *bus.Plan, localAddrs []string, flows []flow) {
	t.Helper()
	checkFlowsOn(t, plan, node().Addrs, localAddrs, flows)
}

func checkFlowsOn(t *testing.T, plan *bus.Plan, nodeIPs []netip.Addr, localAddrs []string, flows []flow) {
	t.Helper()
	var local []netip.Addr
	for _, a := range localAddrs {
		local = append(local, ip(a))
	}
	for _, f := range flows {
		if err := checkFlow(plan, nodeIPs, local, f); err != nil {
			t.Error(err)
		}
	}
}

// renderFlows renders a full snapshot with cfg.
func renderFlows(t *testing.T, cfg Config, st bus.State) *bus.Plan {
	t.Helper()
	p := Render(cfg, full(st))
	checkConsistent(t, p)
	return p
}

func withConfig(change func(*Config)) Config {
	c := baseConfig()
	change(&c)
	return c
}

// webService is a ClusterIP service with a TCP, a UDP and an SCTP port and three
// endpoints: one on this node, two elsewhere.
func webService() (*bus.Service, *bus.EndpointSlice) {
	web := svc("demo", "web", "10.96.0.10", port("http", bus.TCP, 80), port("dns", bus.UDP, 53), port("sig", bus.SCTP, 9))
	eps := slice(web, "web-1", []bus.EndpointPort{eport("http", bus.TCP, 8080), eport("dns", bus.UDP, 5353), eport("sig", bus.SCTP, 9090)},
		ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"), ep("10.244.3.7", "node-c"))
	return web, eps
}

var (
	webHTTP = []string{"10.244.1.5:8080", "10.244.2.6:8080", "10.244.3.7:8080"}
	webDNS  = []string{"10.244.1.5:5353", "10.244.2.6:5353", "10.244.3.7:5353"}
	webSig  = []string{"10.244.1.5:9090", "10.244.2.6:9090", "10.244.3.7:9090"}
)

// nodePortService has a NodePort and one endpoint here, one on node-b.
func nodePortService() (*bus.Service, *bus.EndpointSlice) {
	s := svc("demo", "np", "10.96.0.20", bus.Port{Protocol: bus.TCP, Port: 80, NodePort: 30080})
	return s, slice(s, "np-1", []bus.EndpointPort{eport("", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
}

var npEndpoints = []string{"10.244.1.5:8080", "10.244.2.6:8080"}

// TestFlowClusterIP: a ClusterIP reaches every endpoint over TCP, UDP and SCTP,
// only on its port and protocol; traffic that does not come from a pod is
// masqueraded, as each --detect-local-mode tells pods apart.
func TestFlowClusterIP(t *testing.T) {
	web, eps := webService()
	st := state(node(), web, eps)
	t.Run("ports and protocols", func(t *testing.T) {
		checkFlows(t, renderFlows(t, baseConfig(), st), nil, []flow{
			{pod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{pod.udp("10.96.0.10", 53), dnat(false, webDNS...)},
			{pod.sctp("10.96.0.10", 9), dnat(false, webSig...)},
			{pod.tcp("10.96.0.10", 81), passes},
			{pod.udp("10.96.0.10", 80), passes},
			{pod.tcp("10.96.0.10", 53), passes},
			{pod.tcp("10.96.0.11", 80), passes},
		})
	})
	for _, tc := range []struct {
		mode  string
		cfg   Config
		flows []flow
	}{
		{"ClusterCIDR", baseConfig(), []flow{
			{pod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{remotePod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{hostProc.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
			{hostProc.udp("10.96.0.10", 53), dnat(true, webDNS...)},
			{outside.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
		}},
		{"NodeCIDR", withConfig(func(c *Config) { c.DetectLocal = DetectNodeCIDR }), []flow{
			{pod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{remotePod.tcp("10.96.0.10", 80), dnat(true, webHTTP...)}, // not this node's pod CIDR
			{hostProc.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
			{outside.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
		}},
		{"BridgeInterface", withConfig(func(c *Config) { c.DetectLocal, c.BridgeInterface = DetectBridgeInterface, "cbr0" }), []flow{
			{pod.via("cbr0").tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{pod.via("veth1234").tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
			{hostProc.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
			{outside.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
		}},
		{"InterfaceNamePrefix", withConfig(func(c *Config) { c.DetectLocal, c.InterfacePrefix = DetectInterfacePrefix, "veth" }), []flow{
			{pod.via("veth1234").tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{pod.via("cbr0").tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
			{hostProc.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
			{outside.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
		}},
		{"ClusterCIDR unknown", withConfig(func(c *Config) { c.ClusterCIDRs = nil }), []flow{
			// kube-proxy cannot tell pods apart: it masquerades nothing.
			{pod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{hostProc.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
			{outside.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
		}},
	} {
		t.Run(tc.mode, func(t *testing.T) { checkFlows(t, renderFlows(t, tc.cfg, st), nil, tc.flows) })
	}
}

// TestFlowNoEndpoints: a service without endpoints REJECTs, wherever the
// packet comes from and whichever way it addresses the service.
func TestFlowNoEndpoints(t *testing.T) {
	web, _ := webService()
	np, _ := nodePortService()
	np.ExternalIPs = []netip.Addr{ip("203.0.113.20")}
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), web, np)), nil, []flow{
		{pod.tcp("10.96.0.10", 80), rejected},
		{pod.udp("10.96.0.10", 53), rejected},
		{hostProc.tcp("10.96.0.10", 80), rejected},
		{outside.tcp("10.96.0.10", 80), rejected},
		{outside.tcp("192.168.1.10", 30080), rejected},
		{hostProc.tcp("192.168.1.10", 30080), rejected},
		{localhost.tcp("127.0.0.1", 30080), rejected},
		{outside.tcp("203.0.113.20", 80), rejected},
		{pod.tcp("10.96.0.10", 81), passes},
	})
}

// TestFlowNodePort: a NodePort answers on every local address (127.0.0.1 too
// when localhost NodePorts are on), masquerades, and leaves other ports alone;
// --nodeport-addresses narrows the addresses.
func TestFlowNodePort(t *testing.T) {
	np, eps := nodePortService()
	st := withAddrs(state(node(), np, eps), "192.168.1.10", "10.0.0.1", "127.0.0.1")
	local := []string{"10.0.0.1"}
	t.Run("every address", func(t *testing.T) {
		checkFlows(t, renderFlows(t, baseConfig(), st), local, []flow{
			{outside.tcp("192.168.1.10", 30080), dnat(true, npEndpoints...)},
			{outside.tcp("10.0.0.1", 30080), dnat(true, npEndpoints...)},
			{pod.tcp("192.168.1.10", 30080), dnat(true, npEndpoints...)},
			{hostProc.tcp("192.168.1.10", 30080), dnat(true, npEndpoints...)},
			{localhost.tcp("127.0.0.1", 30080), dnat(true, npEndpoints...)},
			{outside.tcp("192.168.1.10", 30081), passes},
			{outside.udp("192.168.1.10", 30080), passes},
			{outside.tcp("10.96.0.20", 80), dnat(true, npEndpoints...)},
			// route_localnet is on: the localnet firewall keeps 127.0.0.1 closed to the outside.
			{outside.tcp("127.0.0.1", 22), dropped},
		})
	})
	t.Run("no localhost nodeports", func(t *testing.T) {
		checkFlows(t, renderFlows(t, withConfig(func(c *Config) { c.LocalhostNodePorts = false }), st), local, []flow{
			{localhost.tcp("127.0.0.1", 30080), passes},
			{outside.tcp("192.168.1.10", 30080), dnat(true, npEndpoints...)},
			{outside.tcp("127.0.0.1", 22), passes},
		})
	})
	t.Run("nodeport-addresses primary", func(t *testing.T) {
		checkFlows(t, renderFlows(t, withConfig(func(c *Config) { c.NodePortPrimary = true }), st), local, []flow{
			{outside.tcp("192.168.1.10", 30080), dnat(true, npEndpoints...)},
			{outside.tcp("10.0.0.1", 30080), passes},
			{localhost.tcp("127.0.0.1", 30080), passes},
		})
	})
	t.Run("nodeport-addresses cidr", func(t *testing.T) {
		cfg := withConfig(func(c *Config) { c.NodePortAddresses = []netip.Prefix{prefix("10.0.0.0/8"), prefix("127.0.0.0/8")} })
		checkFlows(t, renderFlows(t, cfg, st), local, []flow{
			{outside.tcp("10.0.0.1", 30080), dnat(true, npEndpoints...)},
			{localhost.tcp("127.0.0.1", 30080), dnat(true, npEndpoints...)},
			{outside.tcp("192.168.1.10", 30080), passes},
		})
	})
}

// TestFlowExternalIPs: an external IP reaches the endpoints from anywhere,
// masqueraded (Cluster policy), on its port only.
func TestFlowExternalIPs(t *testing.T) {
	s := svc("demo", "ext", "10.96.0.30", port("https", bus.TCP, 443))
	s.ExternalIPs = []netip.Addr{ip("203.0.113.5")}
	eps := slice(s, "ext-1", []bus.EndpointPort{eport("https", bus.TCP, 8443)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	want := []string{"10.244.1.5:8443", "10.244.2.6:8443"}
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, eps)), nil, []flow{
		{outside.tcp("203.0.113.5", 443), dnat(true, want...)},
		{pod.tcp("203.0.113.5", 443), dnat(true, want...)},
		{hostProc.tcp("203.0.113.5", 443), dnat(true, want...)},
		{outside.tcp("203.0.113.5", 80), passes},
		{outside.udp("203.0.113.5", 443), passes},
		{pod.tcp("10.96.0.30", 443), dnat(false, want...)},
	})
}

// lbService is a LoadBalancer service with endpoints here and on node-b.
func lbService() (*bus.Service, *bus.EndpointSlice) {
	s := svc("demo", "lb", "10.96.0.30", bus.Port{Name: "https", Protocol: bus.TCP, Port: 443, NodePort: 30443})
	s.LoadBalancerIPs = []netip.Addr{ip("198.51.100.50")}
	return s, slice(s, "lb-1", []bus.EndpointPort{eport("https", bus.TCP, 8443)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
}

var lbEndpoints = []string{"10.244.1.5:8443", "10.244.2.6:8443"}

// TestFlowLoadBalancerIP: a load-balancer IP reaches the endpoints from
// anywhere, masqueraded, whether or not the node holds the address.
func TestFlowLoadBalancerIP(t *testing.T) {
	s, eps := lbService()
	p := renderFlows(t, baseConfig(), state(node(), s, eps))
	flows := []flow{
		{outside.tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
		{pod.tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
		{hostProc.tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
		{outside.tcp("198.51.100.50", 80), passes},
		{outside.tcp("192.168.1.10", 30443), dnat(true, lbEndpoints...)},
	}
	checkFlows(t, p, nil, flows)
	checkFlows(t, p, []string{"198.51.100.50"}, flows) // the VIP bound on the node
}

// TestFlowLoadBalancerSourceRanges: only sources in loadBalancerSourceRanges
// reach the endpoints through the load-balancer IP; the rest are dropped. The
// node itself is let through when a range holds its primary IP. The ClusterIP
// and NodePort do not check sources.
func TestFlowLoadBalancerSourceRanges(t *testing.T) {
	s, eps := lbService()
	s.LoadBalancerSourceRanges = []netip.Prefix{prefix("192.168.1.0/24"), prefix("203.0.113.0/24")}
	p := renderFlows(t, baseConfig(), state(node(), s, eps))
	checkFlows(t, p, nil, []flow{
		{outside.at("203.0.113.77").tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
		{outside.at("192.168.1.99").tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
		{outside.tcp("198.51.100.50", 443), dropped},
		{outside.at("203.0.114.1").tcp("198.51.100.50", 443), dropped},
		{pod.tcp("198.51.100.50", 443), dropped},
		{hostProc.tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
		// a request from the node to a VIP it holds loops back with the VIP as source
		{outside.at("198.51.100.50").via("lo").tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
		{outside.tcp("10.96.0.30", 443), dnat(true, lbEndpoints...)},
		{outside.tcp("192.168.1.10", 30443), dnat(true, lbEndpoints...)},
	})
	t.Run("range without the node", func(t *testing.T) {
		s, eps := lbService()
		s.LoadBalancerSourceRanges = []netip.Prefix{prefix("203.0.113.0/24")}
		checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, eps)), nil, []flow{
			{outside.at("203.0.113.77").tcp("198.51.100.50", 443), dnat(true, lbEndpoints...)},
			{outside.at("198.51.100.50").via("lo").tcp("198.51.100.50", 443), dropped},
			{hostProc.tcp("198.51.100.50", 443), dropped},
		})
	})
}

// localService has externalTrafficPolicy: Local, a NodePort, a load-balancer IP
// and a health-check node port.
func localService() *bus.Service {
	s := svc("demo", "local", "10.96.0.40", bus.Port{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30040})
	s.ExternalPolicyLocal, s.HealthCheckNodePort = true, 32040
	s.LoadBalancerIPs = []netip.Addr{ip("198.51.100.40")}
	return s
}

// TestFlowExternalTrafficPolicyLocal: external traffic goes only to endpoints
// on this node, with its source kept; without any it is dropped. Pods and the
// node itself still reach every endpoint (the node masqueraded), and the
// ClusterIP is unaffected.
func TestFlowExternalTrafficPolicyLocal(t *testing.T) {
	s := localService()
	both := slice(s, "local-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	all := []string{"10.244.1.5:8080", "10.244.2.6:8080"}
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, both)), nil, []flow{
		{outside.tcp("192.168.1.10", 30040), dnat(false, "10.244.1.5:8080")},
		{outside.tcp("198.51.100.40", 80), dnat(false, "10.244.1.5:8080")},
		{pod.tcp("198.51.100.40", 80), dnat(false, all...)},
		{pod.tcp("192.168.1.10", 30040), dnat(false, all...)},
		{hostProc.tcp("192.168.1.10", 30040), dnat(true, all...)},
		{hostProc.tcp("198.51.100.40", 80), dnat(true, all...)},
		{localhost.tcp("127.0.0.1", 30040), dnat(true, all...)},
		{pod.tcp("10.96.0.40", 80), dnat(false, all...)},
		{outside.tcp("10.96.0.40", 80), dnat(true, all...)},
		{outside.tcp("192.168.1.10", 32040), passes}, // the health check node port is let in
	})
	t.Run("none local", func(t *testing.T) {
		remote := slice(s, "local-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.6", "node-b"))
		checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, remote)), nil, []flow{
			{outside.tcp("192.168.1.10", 30040), dropped},
			{outside.tcp("198.51.100.40", 80), dropped},
			{pod.tcp("198.51.100.40", 80), dnat(false, "10.244.2.6:8080")},
			{hostProc.tcp("192.168.1.10", 30040), dnat(true, "10.244.2.6:8080")},
			{pod.tcp("10.96.0.40", 80), dnat(false, "10.244.2.6:8080")},
		})
	})
}

// TestFlowInternalTrafficPolicyLocal: traffic to the ClusterIP goes only to
// endpoints on this node, and is dropped when there are none here.
func TestFlowInternalTrafficPolicyLocal(t *testing.T) {
	s := svc("demo", "internal", "10.96.0.50", port("http", bus.TCP, 80))
	s.InternalPolicyLocal = true
	both := slice(s, "internal-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, both)), nil, []flow{
		{pod.tcp("10.96.0.50", 80), dnat(false, "10.244.1.5:8080")},
		{remotePod.tcp("10.96.0.50", 80), dnat(false, "10.244.1.5:8080")},
		{hostProc.tcp("10.96.0.50", 80), dnat(true, "10.244.1.5:8080")},
	})
	t.Run("none local", func(t *testing.T) {
		remote := slice(s, "internal-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.2.6", "node-b"))
		checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, remote)), nil, []flow{
			{pod.tcp("10.96.0.50", 80), dropped},
			{hostProc.tcp("10.96.0.50", 80), dropped},
		})
	})
}

// TestFlowSessionAffinity: ClientIP affinity picks among the same endpoints as
// without it, and every path records the client in the affinity list of the
// endpoint it picked (the list the next connection's --rcheck/--update reads).
func TestFlowSessionAffinity(t *testing.T) {
	s := svc("demo", "sticky", "10.96.0.60", port("http", bus.TCP, 80))
	eps := slice(s, "sticky-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	want := []string{"10.244.1.5:8080", "10.244.2.6:8080"}
	plain := renderFlows(t, baseConfig(), state(node(), s, eps))
	checkFlows(t, plain, nil, []flow{{pod.tcp("10.96.0.60", 80), dnat(false, want...)}})

	sticky := *s
	sticky.AffinitySeconds = 30
	p := renderFlows(t, baseConfig(), state(node(), &sticky, eps))
	checkFlows(t, p, nil, []flow{
		{pod.tcp("10.96.0.60", 80), dnat(false, want...)},
		{outside.tcp("10.96.0.60", 80), dnat(true, want...)},
	})
	res := tracer.Trace(p, node().Addrs, nil, pod.tcp("10.96.0.60", 80))
	name := s.PortName(s.Ports[0])
	for _, path := range res.Paths {
		wantList := []string{nf.EndpointName(name, path.Endpoint.String())}
		if !slices.Equal(path.Affinity, wantList) {
			t.Errorf("path to %s records the client in %v, want %v\n%s", path.Endpoint, path.Affinity, wantList, strings.Join(path.Trace(), "\n"))
		}
	}
	if plainRes := tracer.Trace(plain, node().Addrs, nil, pod.tcp("10.96.0.60", 80)); len(plainRes.Paths) == 0 || len(plainRes.Paths[0].Affinity) != 0 {
		t.Errorf("without affinity, paths record the client: %+v", plainRes.Paths)
	}
}

// TestFlowTerminatingEndpoints: serving terminating endpoints take traffic only
// when no endpoint is ready; terminating endpoints that are not serving never do.
func TestFlowTerminatingEndpoints(t *testing.T) {
	s := svc("demo", "term", "10.96.0.70", port("http", bus.TCP, 80))
	terminating := bus.Endpoint{Addr: ip("10.244.1.8"), Serving: true, Terminating: true, NodeName: testNode}
	notServing := bus.Endpoint{Addr: ip("10.244.1.9"), Terminating: true, NodeName: testNode}
	onlyTerminating := slice(s, "term-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, terminating, notServing)
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, onlyTerminating)), nil, []flow{
		{pod.tcp("10.96.0.70", 80), dnat(false, "10.244.1.8:8080")},
	})
	withReady := slice(s, "term-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, terminating, notServing, ep("10.244.2.6", "node-b"))
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, withReady)), nil, []flow{
		{pod.tcp("10.96.0.70", 80), dnat(false, "10.244.2.6:8080")},
	})
	none := slice(s, "term-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, notServing)
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, none)), nil, []flow{
		{pod.tcp("10.96.0.70", 80), rejected},
	})
}

// TestFlowTopologyHints: with zone hints, traffic goes to the endpoints hinted
// for this node's zone; when none is, to every endpoint.
func TestFlowTopologyHints(t *testing.T) {
	s := svc("demo", "zoned", "10.96.0.80", port("http", bus.TCP, 80))
	za, zb, zb2 := ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"), ep("10.244.3.7", "node-c")
	za.Hints, zb.Hints, zb2.Hints = &bus.Hints{Zones: []string{"zone-a"}}, &bus.Hints{Zones: []string{"zone-b"}}, &bus.Hints{Zones: []string{"zone-b"}}
	eps := slice(s, "zoned-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, za, zb, zb2)
	checkFlows(t, renderFlows(t, baseConfig(), state(node(), s, eps)), nil, []flow{
		{pod.tcp("10.96.0.80", 80), dnat(false, "10.244.1.5:8080")},
		{outside.tcp("10.96.0.80", 80), dnat(true, "10.244.1.5:8080")},
	})
	other := node()
	other.Zone = "zone-b"
	checkFlows(t, renderFlows(t, baseConfig(), state(other, s, eps)), nil, []flow{
		{pod.tcp("10.96.0.80", 80), dnat(false, "10.244.2.6:8080", "10.244.3.7:8080")},
	})
	elsewhere := node()
	elsewhere.Zone = "zone-c"
	checkFlows(t, renderFlows(t, baseConfig(), state(elsewhere, s, eps)), nil, []flow{
		{pod.tcp("10.96.0.80", 80), dnat(false, "10.244.1.5:8080", "10.244.2.6:8080", "10.244.3.7:8080")},
	})
}

// TestFlowMasqueradeAll: --masquerade-all masquerades pod traffic to a ClusterIP too.
func TestFlowMasqueradeAll(t *testing.T) {
	web, eps := webService()
	checkFlows(t, renderFlows(t, withConfig(func(c *Config) { c.MasqueradeAll = true }), state(node(), web, eps)), nil, []flow{
		{pod.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
		{remotePod.udp("10.96.0.10", 53), dnat(true, webDNS...)},
		{hostProc.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
	})
}

// TestFlowHairpin: an endpoint that calls its own service and is sent back to
// itself is masqueraded (so the reply comes back through the node), whether its
// nodeName is this node or unset; its paths to the other endpoints are not.
func TestFlowHairpin(t *testing.T) {
	s := svc("demo", "hairpin", "10.96.0.110", port("http", bus.TCP, 80))
	eps := slice(s, "hairpin-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)},
		ep("10.244.1.5", testNode), ep("10.244.2.6", ""), ep("10.244.3.8", "node-c"))
	p := renderFlows(t, baseConfig(), state(node(), s, eps))
	for _, self := range []string{"10.244.1.5", "10.244.2.6"} {
		pkt := pod.at(self).tcp("10.96.0.110", 80)
		res := tracer.Trace(p, node().Addrs, nil, pkt)
		if res.Err != nil || len(res.Paths) != 3 {
			t.Fatalf("%s: %v over %d paths, want 3 paths", describe(pkt), res, len(res.Paths))
		}
		for _, path := range res.Paths {
			toSelf := path.Endpoint.Addr() == ip(self)
			if path.Masqueraded != toSelf || path.Verdict != tracer.Accept {
				t.Errorf("%s, path to %s: masqueraded %v, verdict %s; want masqueraded %v, ACCEPT\n%s",
					describe(pkt), path.Endpoint, path.Masqueraded, path.Verdict, toSelf, strings.Join(path.Trace(), "\n"))
			}
		}
	}
}

// TestFlowIPv6: an IPv6 plan (the IPv6 half of a dual-stack service) traces
// like an IPv4 one; the IPv4 plan of the same service reaches its IPv4
// endpoints, and neither holds the other family.
func TestFlowIPv6(t *testing.T) {
	s := &bus.Service{ServiceKey: bus.ServiceKey{Namespace: "demo", Name: "v6"}, ClusterIPs: []netip.Addr{ip("10.96.0.100"), ip("fd00:10:96::100")},
		Ports: []bus.Port{{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: 30100}}}
	v6EPs := slice(s, "v6-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("fd00:10:244:1::5", testNode), ep("fd00:10:244:2::6", "node-b"))
	v4EPs := slice(s, "v4-1", []bus.EndpointPort{eport("http", bus.TCP, 8080)}, ep("10.244.1.5", testNode), ep("10.244.2.6", "node-b"))
	n := node()
	n.Addrs = append(n.Addrs, ip("2001:db8::10"))
	n.PodCIDRs = append(n.PodCIDRs, prefix("fd00:10:244:1::/64"))
	st := state(n, s, v6EPs, v4EPs)
	cfg6 := withConfig(func(c *Config) {
		c.Family, c.ClusterCIDRs, c.LocalhostNodePorts = bus.IPv6, []netip.Prefix{prefix("fd00:10:244::/48")}, false
	})
	v6 := []string{"[fd00:10:244:1::5]:8080", "[fd00:10:244:2::6]:8080"}
	pod6 := pod.at("fd00:10:244:1::20")
	outside6 := outside.at("2001:db8:ff::7")
	checkFlowsOn(t, renderFlows(t, cfg6, st), n.Addrs, nil, []flow{
		{pod6.tcp("fd00:10:96::100", 80), dnat(false, v6...)},
		{outside6.tcp("fd00:10:96::100", 80), dnat(true, v6...)},
		{client{ip("2001:db8::10"), tracer.FromOutput, ""}.tcp("fd00:10:96::100", 80), dnat(true, v6...)},
		{outside6.tcp("2001:db8::10", 30100), dnat(true, v6...)},
		{client{ip("::1"), tracer.FromOutput, ""}.tcp("::1", 30100), passes}, // no localhost NodePorts in IPv6
		{pod6.tcp("fd00:10:96::100", 81), passes},
		{pod6.at("fd00:10:244:1::5").tcp("fd00:10:96::100", 80), dnat(true, v6...)}, // hairpin on one path
	})
	v4Plan := renderFlows(t, baseConfig(), st)
	checkFlows(t, v4Plan, nil, []flow{
		{pod.tcp("10.96.0.100", 80), dnat(false, "10.244.1.5:8080", "10.244.2.6:8080")},
	})
	if res := tracer.Trace(v4Plan, n.Addrs, nil, pod6.tcp("fd00:10:96::100", 80)); res.Err == nil {
		t.Errorf("an IPv6 packet traced through the IPv4 plan: %v", res)
	}
}

// TestFlowGoldensTrace: every golden payload (what render writes for each
// feature) is understood by the tracer, so no rule kpipe writes is one the
// flow tests cannot follow.
func TestFlowGoldensTrace(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "*.golden"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		p, err := planFromPayload(string(text))
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		src, dst := pod.at("10.244.1.20"), "10.96.0.10"
		if p.Family == bus.IPv6 {
			src, dst = pod.at("fd00:10:244:1::20"), "fd00:10:96::100"
		}
		for _, pkt := range []tracer.Packet{src.tcp(dst, 80), src.udp(dst, 53), outside.at(src.src.String()).tcp(dst, 30080)} {
			if res := tracer.Trace(p, node().Addrs, nil, pkt); res.Err != nil {
				t.Errorf("%s: %v", file, res.Err)
			}
		}
	}
}

// planFromPayload reads an iptables-restore payload back into a plan.
func planFromPayload(text string) (*bus.Plan, error) {
	p := &bus.Plan{Family: bus.IPv4, Full: true}
	var tp *bus.TablePayload
	index := map[string]int{}
	for _, line := range strings.Split(text, "\n") {
		switch {
		case line == "" || line == "COMMIT":
		case strings.HasPrefix(line, "*"):
			p.Tables = append(p.Tables, bus.TablePayload{Table: line[1:]})
			tp, index = &p.Tables[len(p.Tables)-1], map[string]int{}
		case strings.HasPrefix(line, ":"):
			name := strings.Fields(line[1:])[0]
			index[name] = len(tp.Chains)
			tp.Chains = append(tp.Chains, bus.Chain{Name: name})
		case strings.HasPrefix(line, "-A "):
			name := strings.Fields(line)[1]
			i, ok := index[name]
			if !ok {
				return nil, fmt.Errorf("rule for undeclared chain: %q", line)
			}
			tp.Chains[i].Rules += line + "\n"
			if strings.Contains(line, "-d fd") || strings.Contains(line, "::") {
				p.Family = bus.IPv6
			}
		default:
			return nil, fmt.Errorf("unexpected line %q", line)
		}
	}
	for _, table := range []string{nf.TableNAT, nf.TableFilter} {
		if !slices.ContainsFunc(p.Tables, func(tp bus.TablePayload) bool { return tp.Table == table }) {
			p.Tables = append(p.Tables, bus.TablePayload{Table: table})
		}
	}
	return p, nil
}

// breakRule returns a copy of plan in which the one rule of table that contains
// every string of where has old replaced by new.
func breakRule(t *testing.T, plan *bus.Plan, table string, where []string, old, new string) (*bus.Plan, string) {
	t.Helper()
	broken := *plan
	broken.Tables = slices.Clone(plan.Tables)
	found := ""
	for ti := range broken.Tables {
		if broken.Tables[ti].Table != table {
			continue
		}
		chains := slices.Clone(broken.Tables[ti].Chains)
		for ci, c := range chains {
			lines := strings.Split(c.Rules, "\n")
			for li, line := range lines {
				if !containsAll(line, where) {
					continue
				}
				if found != "" {
					t.Fatalf("two rules contain %q:\n%s\n%s", where, found, line)
				}
				if !strings.Contains(line, old) {
					t.Fatalf("rule %q has no %q", line, old)
				}
				found = line
				lines[li] = strings.Replace(line, old, new, 1)
			}
			chains[ci].Rules = strings.Join(lines, "\n")
		}
		broken.Tables[ti].Chains = chains
	}
	if found == "" {
		t.Fatalf("no %s rule contains %q", table, where)
	}
	return &broken, found
}

func containsAll(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}

// TestFlowCatchesBrokenRule: the flow checks fail on a wrong rule, not only on
// changed text. Each case breaks one rule of a correctly rendered plan; the
// flows that pass on the plan as rendered must then fail.
func TestFlowCatchesBrokenRule(t *testing.T) {
	web, eps := webService()
	plan := renderFlows(t, baseConfig(), state(node(), web, eps))
	for _, tc := range []struct {
		name     string
		table    string
		where    []string
		old, new string
		flows    []flow
		wrong    []string // per flow, the aspect the broken rule must get wrong
	}{
		{
			name:  "ClusterIP rule matches the target port instead of the service port",
			table: nf.TableNAT, where: []string{`"demo/web:http cluster IP"`, "-j KUBE-SVC-"}, old: "--dport 80 ", new: "--dport 8080 ",
			flows: []flow{{pod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)}},
			wrong: []string{wrongEndpoints},
		},
		{
			name:  "masquerade rule lost the ! of its source match",
			table: nf.TableNAT, where: []string{`"demo/web:http cluster IP"`, "-j KUBE-MARK-MASQ"}, old: "! -s 10.244.0.0/16", new: "-s 10.244.0.0/16",
			flows: []flow{
				{pod.tcp("10.96.0.10", 80), dnat(false, webHTTP...)},
				{outside.tcp("10.96.0.10", 80), dnat(true, webHTTP...)},
			},
			wrong: []string{wrongMasquerade, wrongMasquerade},
		},
		{
			name:  "UDP endpoint rule DNATs to the wrong port",
			table: nf.TableNAT, where: []string{`"demo/web:dns -> 10.244.3.7:5353"`}, old: "--to-destination 10.244.3.7:5353", new: "--to-destination 10.244.3.7:53",
			flows: []flow{{pod.udp("10.96.0.10", 53), dnat(false, webDNS...)}},
			wrong: []string{wrongEndpoints},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, f := range tc.flows {
				if err := checkFlow(plan, node().Addrs, nil, f); err != nil {
					t.Fatalf("the rendered plan fails its own flow: %v", err)
				}
			}
			broken, rule := breakRule(t, plan, tc.table, tc.where, tc.old, tc.new)
			t.Logf("broken rule: %s\n   now reads: %s", rule, strings.Replace(rule, tc.old, tc.new, 1))
			for i, f := range tc.flows {
				err := checkFlow(broken, node().Addrs, nil, f)
				var fe *flowError
				if !errors.As(err, &fe) {
					t.Errorf("%s: the flow check passes on the broken plan", describe(f.pkt))
					continue
				}
				t.Logf("tracer: %s", strings.SplitN(err.Error(), "\n", 2)[0])
				if _, ok := fe.wrong[tc.wrong[i]]; fe.traceErr != nil || !ok || len(fe.wrong) != 1 {
					t.Errorf("%s: the flow fails for another reason than its %s: %v", describe(f.pkt), tc.wrong[i], err)
				}
			}
		})
	}
}
