package nftables

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Prefixes of the per-service-port chains and sets (kube-proxy's).
const (
	prefixService  = "service-"  // the Cluster policy chain
	prefixLocal    = "local-"    // the Local policy chain
	prefixExternal = "external-" // external traffic: NodePorts, external and LB IPs
	prefixFirewall = "firewall-" // loadBalancerSourceRanges
	prefixEndpoint = "endpoint-"
	prefixAffinity = "affinity-"
)

const (
	nameHashLen = 8
	// nameBaseMax leaves room for the longest prefix in nft's 256-byte names
	// (knftables.NameLengthMax 256 less kube-proxy's 16 for a prefix).
	nameBaseMax = 256 - 16
)

// nameBase is kube-proxy's hashAndTruncate: an 8-character hash of s, "-", and
// s itself, cut to nameBaseMax with "..." (only long IPv6 endpoints get there).
func nameBase(s string) string {
	name := nf.NameHash(s, nameHashLen) + "-" + s
	if len(name) > nameBaseMax {
		name = name[:nameBaseMax-3] + "..."
	}
	return name
}

// portBase is the base of a service port's chains: HASH-ns/name/proto/port.
func portBase(p bus.ServicePortName) string {
	return nameBase(portPath(p))
}

func portPath(p bus.ServicePortName) string {
	return p.Namespace + "/" + p.Name + "/" + strings.ToLower(string(p.Protocol)) + "/" + p.Port
}

// endpointBase is the base of an endpoint's chain and affinity set:
// HASH-ns/name/proto/port__IP/PORT, an IPv6 address with '.' for ':' (nft
// names cannot hold a colon).
func endpointBase(p bus.ServicePortName, ep netip.AddrPort) string {
	ip := strings.ReplaceAll(ep.Addr().String(), ":", ".")
	return nameBase(portPath(p) + "__" + ip + "/" + strconv.Itoa(int(ep.Port())))
}
