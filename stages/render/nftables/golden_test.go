package nftables

import (
	"net/netip"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

// The goldens in testdata are upstream's expected output (see testdata/README.md):
// each test builds the same objects as the upstream test it is named after and
// requires Dump to be that output, byte for byte.

// TestEmptyClusterIsUpstreamBaseRules: no services, only what every full
// sync writes (upstream's baseRules).
func TestEmptyClusterIsUpstreamBaseRules(t *testing.T) {
	requireGolden(t, "base.golden", Render(upstreamConfig(), upstreamState()).Dump())
}

// TestOverallNFTablesRules: upstream's test of the same name, six services.
func TestOverallNFTablesRules(t *testing.T) {
	requireGolden(t, "overall.golden", overallTable().Dump())
}

// overallTable renders upstream's TestOverallNFTablesRules' six services.
func overallTable() *Table {
	st := upstreamState()
	// ClusterIP, one endpoint.
	svc1 := service(st, "ns1", "svc1", "172.30.0.41", 80, 0)
	endpoints(st, svc1, "10.180.0.1")
	// LoadBalancer, eTP Local, its only endpoint on another node.
	svc2 := service(st, "ns2", "svc2", "172.30.0.42", 80, 3001)
	svc2.LoadBalancerIPs, svc2.ExternalIPs = addrs("1.2.3.4"), addrs("192.168.99.22")
	svc2.ExternalPolicyLocal, svc2.HealthCheckNodePort = true, 30000
	endpoints(st, svc2, "10.180.0.2")
	// NodePort.
	svc3 := service(st, "ns3", "svc3", "172.30.0.43", 80, 3003)
	endpoints(st, svc3, "10.180.0.3")
	// External IP, two endpoints, one on this node.
	svc4 := service(st, "ns4", "svc4", "172.30.0.44", 80, 0)
	svc4.ExternalIPs = addrs("192.168.99.33")
	endpoints(st, svc4, "10.180.0.4", "10.180.0.5@test-node")
	// LoadBalancer, eTP Cluster, source ranges, ClientIP affinity.
	svc5 := service(st, "ns5", "svc5", "172.30.0.45", 80, 3002)
	svc5.LoadBalancerIPs, svc5.HealthCheckNodePort = addrs("5.6.7.8"), 30000
	svc5.LoadBalancerSourceRanges = prefixes("203.0.113.0/25")
	svc5.AffinitySeconds = 10800
	endpoints(st, svc5, "10.180.0.3")
	// ClusterIP without endpoints.
	service(st, "ns6", "svc6", "172.30.0.46", 80, 0)
	return Render(upstreamConfig(), st)
}

// TestSyncProxyRulesStartup: the state upstream's test ends in, which is what
// a full sync on a fresh node writes for its three ClusterIP services (two
// endpoints, one, none).
func TestSyncProxyRulesStartup(t *testing.T) {
	st := upstreamState()
	endpoints(st, service(st, "ns1", "svc1", "172.30.0.41", 80, 0), "10.0.1.1", "10.0.1.2")
	endpoints(st, service(st, "ns2", "svc2", "172.30.0.42", 8080, 0), "10.0.2.1")
	service(st, "ns3", "svc3", "172.30.0.43", 80, 0)

	requireGolden(t, "startup.golden", Render(upstreamConfig(), st).Dump())
}

// TestBadIPs: upstream's LoadBalancer with source ranges, eTP Cluster, its
// addresses written with leading zeros; kube-proxy parses them sloppily, kpipe's
// watch hands render parsed addresses, so the state holds them normalised.
func TestBadIPs(t *testing.T) {
	st := upstreamState()
	svc := service(st, "ns1", "svc1", "172.30.0.41", 80, 3001)
	svc.LoadBalancerIPs, svc.ExternalIPs = addrs("1.2.3.4"), addrs("192.168.99.22")
	svc.LoadBalancerSourceRanges = prefixes("203.0.113.0/25")
	endpoints(st, svc, "10.180.0.1")

	requireGolden(t, "badips.golden", Render(upstreamConfig(), st).Dump())
}

// TestSyncProxyRulesRepeated: the first and the fifth state of upstream's test
// of that name, the two with no stale (flushed, not yet deleted) chains: two
// ClusterIP services; then one of them gone, another with an endpoint and one
// without endpoints (reject).
func TestSyncProxyRulesRepeated(t *testing.T) {
	st := upstreamState()
	endpoints(st, service(st, "ns1", "svc1", "172.30.0.41", 80, 0), "10.0.1.1")
	svc2 := service(st, "ns2", "svc2", "172.30.0.42", 8080, 0)
	endpoints(st, svc2, "10.0.2.1")
	requireGolden(t, "repeated-initial.golden", Render(upstreamConfig(), st).Dump())

	delete(st.Services, svc2.ServiceKey)
	delete(st.Slices, svc2.ServiceKey)
	endpoints(st, service(st, "ns3", "svc3", "172.30.0.43", 80, 0), "10.0.3.1")
	service(st, "ns4", "svc4", "172.30.0.44", 80, 0)
	requireGolden(t, "repeated-no-endpoints.golden", Render(upstreamConfig(), st).Dump())
}

// The goldens below are upstream's proxier's own output for the objects each
// test builds (testdata/README.md says how it was run).

// TestExternalTrafficPolicyLocal: upstream's test of that name's LoadBalancer,
// eTP Local, with a local and a remote endpoint: the external chain ends in
// the local- chain, which has only the local endpoint.
func TestExternalTrafficPolicyLocal(t *testing.T) {
	st := upstreamState()
	svc := service(st, "ns1", "svc1", "172.30.0.41", 80, 3001)
	svc.ExternalIPs, svc.LoadBalancerIPs = addrs("192.168.99.11"), addrs("1.2.3.4")
	svc.ExternalPolicyLocal, svc.HealthCheckNodePort = true, 30000
	endpoints(st, svc, "10.180.0.1", "10.180.2.1@test-node")

	requireGolden(t, "etp-local.golden", Render(upstreamConfig(), st).Dump())
}

// TestInternalTrafficPolicyLocalAndTerminating: iTP Local with a local
// endpoint (the ClusterIP goes to local-) and without (drop); a service whose
// endpoints are all terminating uses the serving ones, ordered as text
// (10.180.0.10 before 10.180.0.9).
func TestInternalTrafficPolicyLocalAndTerminating(t *testing.T) {
	st := upstreamState()
	svc1 := service(st, "ns1", "svc1", "172.30.0.41", 80, 0)
	svc1.InternalPolicyLocal = true
	endpoints(st, svc1, "10.180.0.1@test-node", "10.180.1.1@other-node")
	svc2 := service(st, "ns2", "svc2", "172.30.0.42", 80, 0)
	svc2.InternalPolicyLocal = true
	endpoints(st, svc2, "10.180.1.2@other-node")
	svc3 := service(st, "ns3", "svc3", "172.30.0.43", 80, 0)
	endpoints(st, svc3, "10.180.0.10@!", "10.180.0.9@!")
	// Terminating and no longer serving: never used.
	sl := st.Slices[svc3.ServiceKey][svc3.Name+"-1"]
	sl.Items = append(sl.Items, bus.Endpoint{Addr: netip.MustParseAddr("10.180.0.8"), Terminating: true})

	requireGolden(t, "itp-local-terminating.golden", Render(upstreamConfig(), st).Dump())
}

// TestNodePortsOnEveryAddress: nodePortAddresses unset matches every local
// address (no nodeport-ips set; fib daddr type local), no ServiceCIDR known
// (no drop rule), masqueradeAll (ClusterIP traffic always marked).
func TestNodePortsOnEveryAddress(t *testing.T) {
	cfg := upstreamConfig()
	cfg.NodePortAddresses, cfg.ServiceCIDRs, cfg.MasqueradeAll = nil, nil, true
	st := upstreamState()
	endpoints(st, service(st, "ns1", "svc1", "172.30.0.41", 80, 3001), "10.180.0.1")

	requireGolden(t, "match-all.golden", Render(cfg, st).Dump())
}

// TestIPv6: NewFakeProxier(IPv6)'s settings; a LoadBalancer with external IP,
// source range and ClientIP affinity, endpoints on another target port (one
// local), and a ClusterIP without endpoints.
func TestIPv6(t *testing.T) {
	requireGolden(t, "ipv6.golden", ipv6Table().Dump())
}

// ipv6Table renders TestIPv6's services.
func ipv6Table() *Table {
	cfg := upstreamConfig()
	cfg.Family, cfg.ClusterCIDRs, cfg.ServiceCIDRs = bus.IPv6, prefixes("fd00:10::/64"), prefixes("fd00:10:96::/112")
	st := upstreamState()
	st.Node.Addrs = addrs("2001:db8::1")
	svc := service(st, "ns1", "svc1", "fd00:10:96::41", 80, 3001)
	svc.ExternalIPs, svc.LoadBalancerIPs = addrs("2001:db8:99::22"), addrs("2001:db8:5::8")
	svc.LoadBalancerSourceRanges, svc.AffinitySeconds = prefixes("2001:db8:203::/64"), 300
	endpointsOn(st, svc, 8080, "fd00:10:180::2", "fd00:10:180::1@test-node")
	service(st, "ns2", "svc2", "fd00:10:96::42", 80, 0)
	return Render(cfg, st)
}
