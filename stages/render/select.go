package render

import (
	"net/netip"
	"slices"

	"github.com/kpipe/kpipe/bus"
)

// This file is render's endpoint selection and address choices, exported for the
// other renderers of the same snapshot (stages/render/nftables).

// Policies is what a service port's traffic policies ask of its endpoints.
type Policies struct {
	// Externally: the port is reachable from outside the cluster (a NodePort,
	// or external or load-balancer IPs of the family).
	Externally    bool
	ExternalLocal bool // externalTrafficPolicy: Local, and Externally
	InternalLocal bool // internalTrafficPolicy: Local
}

// PoliciesOf works out the policies of one port of svc in family f.
func PoliciesOf(svc *bus.Service, port bus.Port, f bus.Family) Policies {
	ofFamily := func(a netip.Addr) bool { return bus.FamilyOf(a) == f }
	externally := port.NodePort != 0 || slices.ContainsFunc(svc.ExternalIPs, ofFamily) ||
		slices.ContainsFunc(svc.LoadBalancerIPs, ofFamily)
	return Policies{
		Externally:    externally,
		ExternalLocal: svc.ExternalPolicyLocal && externally,
		InternalLocal: svc.InternalPolicyLocal,
	}
}

// UsesCluster says the port's traffic may go to any endpoint (kube-proxy's
// UsesClusterEndpoints).
func (p Policies) UsesCluster() bool { return !p.InternalLocal || p.Externally }

// UsesLocal says some of the port's traffic may go only to this node's
// endpoints (kube-proxy's UsesLocalEndpoints).
func (p Policies) UsesLocal() bool { return p.InternalLocal || p.ExternalLocal }

// PortEndpoints is what kube-proxy's CategorizeEndpoints makes of one service
// port's endpoints: those Cluster and Local traffic use, the union of both
// (each gets an endpoint chain), and whether usable endpoints exist anywhere.
type PortEndpoints struct {
	Cluster, Local, Reachable []netip.AddrPort
	Any                       bool
}

// SelectEndpoints picks the endpoints of one port of svc in family f from st,
// as render's own rules use them (ready, serving-terminating fallback,
// topology hints, traffic policies).
func SelectEndpoints(st bus.State, f bus.Family, nodeName string, svc *bus.Service, port bus.Port) PortEndpoints {
	_, c := selectEndpoints(st, f, nodeName, svc, port, PoliciesOf(svc, port, f))
	return PortEndpoints{Cluster: addrPorts(c.cluster), Local: addrPorts(c.local), Reachable: addrPorts(c.reachable), Any: c.hasAny}
}

// selectEndpoints is SelectEndpoints' work, and every endpoint of the port
// in the family, which kube-proxy counts.
func selectEndpoints(st bus.State, f bus.Family, nodeName string, svc *bus.Service, port bus.Port, p Policies) ([]endpoint, categorized) {
	var zone string
	var podCIDRs []netip.Prefix
	if st.Node != nil {
		zone, podCIDRs = st.Node.Zone, st.Node.PodCIDRs
	}
	eps := endpointsFor(st.Slices[svc.ServiceKey], f, port, nodeName, podCIDRs)
	return eps, categorize(eps, p.UsesCluster(), p.UsesLocal(), nodeName, zone)
}

// NodePortIPs lists the addresses NodePorts answer on, or nil for "every local
// address", from --nodeport-addresses (or the node's primary IP) and the host's
// addresses.
func NodePortIPs(cfg Config, st bus.State) []netip.Addr {
	switch {
	case cfg.NodePortPrimary:
		out := []netip.Addr{}
		if st.Node != nil {
			if ips := bus.AddrsOf(cfg.Family, st.Node.Addrs); len(ips) > 0 {
				out = append(out, ips[0])
			}
		}
		return out
	case len(cfg.NodePortAddresses) > 0:
		if slices.ContainsFunc(cfg.NodePortAddresses, func(p netip.Prefix) bool { return p.Bits() == 0 }) {
			return nil // 0.0.0.0/0 or ::/0: kube-proxy matches every address
		}
		out := []netip.Addr{}
		for _, a := range bus.AddrsOf(cfg.Family, st.LocalAddrs) {
			for _, p := range cfg.NodePortAddresses {
				if p.Contains(a) {
					out = append(out, a)
					break
				}
			}
		}
		slices.SortFunc(out, netip.Addr.Compare)
		return slices.Compact(out)
	}
	return nil
}
