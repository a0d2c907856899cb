// Package netfilter is the only code in kpipe that talks to the kernel: it runs
// iptables-restore and iptables-save, ensures the jump rules from the built-in
// chains, deletes conntrack flows and reads local addresses and sysctls.
package netfilter

import (
	"crypto/sha256"
	"encoding/base32"
	"net/netip"
	"strings"

	"github.com/kpipe/kpipe/bus"
)

// Tables kpipe writes.
const (
	TableNAT    = "nat"
	TableFilter = "filter"
	TableMangle = "mangle"
)

// The chains kpipe owns. They carry kube-proxy's names so that kpipe takes over a
// node that kube-proxy programmed (and kube-proxy one that kpipe programmed)
// without leaving two sets of rules behind.
const (
	ChainServices         = "KUBE-SERVICES"
	ChainExternalServices = "KUBE-EXTERNAL-SERVICES"
	ChainNodePorts        = "KUBE-NODEPORTS"
	ChainPostrouting      = "KUBE-POSTROUTING"
	ChainMarkMasq         = "KUBE-MARK-MASQ"
	ChainForward          = "KUBE-FORWARD"
	ChainProxyFirewall    = "KUBE-PROXY-FIREWALL"
	ChainLocalnetFirewall = "KUBE-FIREWALL"
	ChainCanary           = "KUBE-PROXY-CANARY"
)

// Prefixes of the per-service-port chains. kpipe writes a KUBE-SEP- chain only for
// endpoints that may be pods on this node (their nodeName is this node or unset,
// or their address is in this node's pod CIDRs); other endpoints are inline DNAT
// rules, and the chains kube-proxy left for them are deleted by the first full sync.
const (
	PrefixService      = "KUBE-SVC-"
	PrefixServiceLocal = "KUBE-SVL-"
	PrefixExternal     = "KUBE-EXT-"
	PrefixFirewall     = "KUBE-FW-"
	PrefixEndpoint     = "KUBE-SEP-"
	// PrefixBucket names the chains KUBE-SERVICES dispatches to by destination
	// (one per IPv4 /24 or IPv6 /120 that holds service addresses), so adding a
	// service rewrites a few hundred rules instead of all of KUBE-SERVICES, and a
	// new connection walks two short lists instead of one long one.
	PrefixBucket        = "KUBE-SVCS-"
	prefixLegacyXLB     = "KUBE-XLB-"
	serviceChainHashLen = 16
)

// OwnedPrefixes are the chain prefixes whose unused chains a full sync deletes.
var OwnedPrefixes = []string{PrefixService, PrefixServiceLocal, PrefixExternal, PrefixFirewall, PrefixEndpoint, PrefixBucket, prefixLegacyXLB}

// ServiceChain names the chain of one service port: prefix plus a hash of the
// port's name and protocol, exactly as kube-proxy names its KUBE-SVC- chains, so a
// node switched between the two keeps the same chains.
func ServiceChain(prefix string, port bus.ServicePortName) string {
	return prefix + hash16(port.String()+strings.ToLower(string(port.Protocol)))
}

// EndpointName names an endpoint of a service port: its KUBE-SEP- chain when it has
// one, and the xt_recent list that implements session affinity (as kube-proxy
// names them).
func EndpointName(port bus.ServicePortName, endpoint string) string {
	return PrefixEndpoint + hash16(port.String()+strings.ToLower(string(port.Protocol))+endpoint)
}

// BucketChain names the KUBE-SERVICES bucket of a destination prefix.
func BucketChain(p netip.Prefix) string {
	return PrefixBucket + hash16(p.String())
}

// Bucket is the destination prefix whose bucket chain holds the rules for addr.
func Bucket(addr netip.Addr) netip.Prefix {
	bits := 24
	if addr.Is6() && !addr.Is4In6() {
		bits = 120
	}
	p, _ := addr.Prefix(bits)
	return p
}

func hash16(s string) string {
	sum := sha256.Sum256([]byte(s))
	return base32.StdEncoding.EncodeToString(sum[:])[:serviceChainHashLen]
}
