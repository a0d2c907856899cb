package nftables

import (
	"testing"
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

	requireGolden(t, "overall.golden", Render(upstreamConfig(), st).Dump())
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
