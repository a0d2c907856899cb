package bus

import "net/netip"

// HealthChecks is what the health stage serves on healthCheckNodePorts: for every
// service with externalTrafficPolicy: Local and a healthCheckNodePort, how many of
// its endpoints are ready on this node. Render computes it; commit forwards it once
// the plan that matches it is in the kernel.
type HealthChecks struct {
	Family   Family
	Services map[ServiceKey]HealthCheck
	// Addrs are the addresses healthCheckNodePort servers listen on, as
	// --nodeport-addresses selects them; nil: every address.
	Addrs []netip.Addr
}

// HealthCheck is one service's health-check port and local endpoint count.
type HealthCheck struct {
	NodePort       int32
	LocalEndpoints int
}

// HealthCheckUpdates carries the newest HealthChecks of each family that committed
// since health last looked; it travels in a merging mailbox shared by the families.
type HealthCheckUpdates map[Family]HealthChecks

// MergeHealthCheckUpdates keeps, for each family, the newer of the two.
func MergeHealthCheckUpdates(prev, next HealthCheckUpdates) HealthCheckUpdates {
	out := make(HealthCheckUpdates, len(prev)+len(next))
	for f, v := range prev {
		out[f] = v
	}
	for f, v := range next {
		out[f] = v
	}
	return out
}
