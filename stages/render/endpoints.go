package render

import (
	"cmp"
	"net/netip"
	"slices"

	"github.com/kpipe/kpipe/bus"
)

// endpoint is one address:port of a service port, with what render needs to know.
type endpoint struct {
	addr        netip.AddrPort
	ready       bool
	serving     bool
	terminating bool
	local       bool // on this node: what the Local traffic policies use
	// hairpin: may be a pod on this node (local, no nodeName, or inside this
	// node's pod CIDRs), so it may send traffic to itself through the service
	// and gets a KUBE-SEP- chain that masquerades that.
	hairpin bool
	zones   []string
	nodes   []string
}

// endpointsFor collects the endpoints of one service port from the service's slices
// of this family, matching the slice port by name and protocol, first seen wins for
// a duplicate address:port (as kube-proxy does), sorted for stable output.
func endpointsFor(slices map[string]*bus.EndpointSlice, family bus.Family, port bus.Port, nodeName string, podCIDRs []netip.Prefix) []endpoint {
	seen := map[netip.AddrPort]bool{}
	var eps []endpoint
	for _, name := range sortedKeys(slices) {
		sl := slices[name]
		if sl.Family != family {
			continue
		}
		var target int32
		for _, p := range sl.Ports {
			if p.Name == port.Name && p.Protocol == port.Protocol {
				target = p.Port
				break
			}
		}
		if target == 0 {
			continue
		}
		for _, e := range sl.Items {
			ap := netip.AddrPortFrom(e.Addr, uint16(target))
			if seen[ap] {
				continue
			}
			seen[ap] = true
			local := e.NodeName != "" && e.NodeName == nodeName
			eps = append(eps, endpoint{
				addr: ap, ready: e.Ready, serving: e.Serving, terminating: e.Terminating,
				local: local, hairpin: local || e.NodeName == "" || inAny(podCIDRs, e.Addr),
				zones: e.HintZones(), nodes: e.HintNodes(),
			})
		}
	}
	slicesSortEndpoints(eps)
	return eps
}

func inAny(prefixes []netip.Prefix, a netip.Addr) bool {
	for _, p := range prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

func slicesSortEndpoints(eps []endpoint) {
	slices.SortFunc(eps, func(a, b endpoint) int { return a.addr.Compare(b.addr) })
}

func sortedKeys[K cmp.Ordered, V any](m map[K]V) []K {
	keys := make([]K, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// categorized is kube-proxy's CategorizeEndpoints result.
type categorized struct {
	cluster, local, reachable []endpoint
	hasAny                    bool // usable endpoints exist somewhere in the cluster
}

// categorize picks the endpoints each traffic policy uses: Ready ones (narrowed by
// topology hints for Cluster policy), falling back to serving-terminating ones,
// independently for Cluster and Local.
func categorize(eps []endpoint, usesCluster, usesLocal bool, nodeName, zone string) categorized {
	var c categorized
	if len(eps) == 0 {
		return c
	}
	topology := ""
	if usesCluster {
		topology = topologyMode(eps, nodeName, zone)
		c.cluster = filter(eps, func(e endpoint) bool { return e.ready && availableForTopology(e, topology, nodeName, zone) })
		if len(c.cluster) == 0 {
			c.cluster = filter(eps, func(e endpoint) bool { return e.serving && e.terminating })
		}
		c.hasAny = len(c.cluster) > 0
	}
	if !usesLocal {
		c.reachable = c.cluster
		return c
	}
	var localReady, localTerminating bool
	for _, e := range eps {
		switch {
		case e.ready:
			c.hasAny = true
			localReady = localReady || e.local
		case e.serving && e.terminating:
			c.hasAny = true
			localTerminating = localTerminating || e.local
		}
	}
	switch {
	case localReady:
		c.local = filter(eps, func(e endpoint) bool { return e.local && e.ready })
	case localTerminating:
		c.local = filter(eps, func(e endpoint) bool { return e.local && e.serving && e.terminating })
	}
	if !usesCluster {
		c.reachable = c.local
		return c
	}
	union := map[netip.AddrPort]endpoint{}
	for _, e := range append(append([]endpoint{}, c.cluster...), c.local...) {
		union[e.addr] = e
	}
	for _, e := range union {
		c.reachable = append(c.reachable, e)
	}
	slicesSortEndpoints(c.reachable)
	return c
}

const (
	topologySameZone = "PreferSameZone"
	topologySameNode = "PreferSameNode"
)

// topologyMode follows kube-proxy: same-node when every ready endpoint has node hints
// and one names this node; else same-zone when every ready endpoint has zone hints
// and one names this zone; else none.
func topologyMode(eps []endpoint, nodeName, zone string) string {
	anyReady, allNodeHints, forNode, allZoneHints, forZone := false, true, false, true, false
	for _, e := range eps {
		if !e.ready {
			continue
		}
		anyReady = true
		if len(e.nodes) == 0 {
			allNodeHints = false
		} else if slices.Contains(e.nodes, nodeName) {
			forNode = true
		}
		if len(e.zones) == 0 {
			allZoneHints = false
		} else if zone != "" && slices.Contains(e.zones, zone) {
			forZone = true
		}
	}
	switch {
	case !anyReady:
		return ""
	case allNodeHints && forNode:
		return topologySameNode
	case allZoneHints && forZone:
		return topologySameZone
	}
	return ""
}

func availableForTopology(e endpoint, mode, nodeName, zone string) bool {
	switch mode {
	case topologySameNode:
		return slices.Contains(e.nodes, nodeName)
	case topologySameZone:
		return slices.Contains(e.zones, zone)
	}
	return true
}

func filter(eps []endpoint, keep func(endpoint) bool) []endpoint {
	var out []endpoint
	for _, e := range eps {
		if keep(e) {
			out = append(out, e)
		}
	}
	return out
}
