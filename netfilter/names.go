// Package netfilter is the only code in kpipe that talks to the kernel: it runs
// iptables-restore and iptables-save, ensures the jump rules from the built-in
// chains, deletes conntrack flows and reads local addresses and sysctls.
package netfilter

import (
	"crypto/sha256"
	"encoding/base32"
	"net/netip"
	"slices"
	"strconv"
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
	// PrefixBucket names the chains between KUBE-SERVICES and the service rules,
	// which dispatch by destination: a chain per /16 that holds service
	// addresses, in it one per /20, in that one per /24, the bucket that holds
	// the rules of the services in it (IPv6: /112, /116, /120). Adding a service
	// rewrites its bucket, not all of KUBE-SERVICES, and with a /12 of services a
	// new connection walks at most 16 jumps per level before its bucket's rules.
	//
	// The names start with kube-proxy's KUBE-SVC- so that kube-proxy, taking the
	// node over, deletes them as stale chains of its own (it deletes only chains
	// with its per-service prefixes); otherwise they would keep referencing
	// service chains it wants to delete, and its restores would fail. They cannot
	// be mistaken for a service chain: after "KUBE-SVC-B" and the digits comes a
	// '-', at a place where a service chain's base32 hash has a letter or digit.
	PrefixBucket = PrefixService + "B"
	// prefixOldBucket named the dispatch chains of kpipe before v-next; they are
	// still dispatch chains, so that an upgraded kpipe deletes them.
	prefixOldBucket     = "KUBE-SVCS-"
	prefixLegacyXLB     = "KUBE-XLB-"
	serviceChainHashLen = 16
	// bucketHashLen fits "KUBE-SVC-B120-" and the hash in iptables' 28 characters.
	bucketHashLen = 28 - len(PrefixBucket+"120-")
)

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

// BucketChain names the chain of a destination prefix: "KUBE-SVC-B<bits>-" and a
// hash of the prefix, so that chains sort by level (see Rank).
func BucketChain(p netip.Prefix) string {
	return PrefixBucket + strconv.Itoa(p.Bits()) + "-" + NameHash(p.String(), bucketHashLen)
}

// bucketLevels are the prefix lengths of the dispatch levels, top first; the last
// is the bucket's.
var (
	bucketLevels4 = []int{16, 20, 24}
	bucketLevels6 = []int{112, 116, 120}
)

func bucketLevels(addr netip.Addr) []int {
	if addr.Is4() {
		return bucketLevels4
	}
	return bucketLevels6
}

// Bucket is the destination prefix whose bucket chain holds the rules for addr.
func Bucket(addr netip.Addr) netip.Prefix {
	addr = addr.Unmap()
	levels := bucketLevels(addr)
	p, _ := addr.Prefix(levels[len(levels)-1])
	return p
}

// BucketParent is the prefix of the dispatch chain that jumps to p's chain; ok is
// false when that is KUBE-SERVICES (p is on the top level).
func BucketParent(p netip.Prefix) (parent netip.Prefix, ok bool) {
	levels := bucketLevels(p.Addr())
	i := slices.Index(levels, p.Bits())
	if i <= 0 {
		return netip.Prefix{}, false
	}
	parent, _ = p.Addr().Prefix(levels[i-1])
	return parent, true
}

// bucketBits reads the prefix length out of a dispatch chain's name, of this
// kpipe ("KUBE-SVC-B<bits>-<hash>") or an older one ("KUBE-SVCS-<bits>-<hash>");
// ok is false for a name of another shape (a service chain, or an older kpipe's
// single-level buckets).
func bucketBits(chain string) (bits int, ok bool) {
	for _, prefix := range []string{PrefixBucket, prefixOldBucket} {
		if rest, found := strings.CutPrefix(chain, prefix); found {
			return leadingBits(rest)
		}
	}
	return 0, false
}

// leadingBits reads "<digits>-…" (a dispatch chain's name after its prefix).
func leadingBits(rest string) (bits int, ok bool) {
	num, _, found := strings.Cut(rest, "-")
	if !found || num == "" || strings.Trim(num, "0123456789") != "" {
		return 0, false
	}
	bits, err := strconv.Atoi(num)
	return bits, err == nil
}

// isDispatchChain says whether chain is a dispatch chain of this kpipe or of an
// older one (KUBE-SVCS-, with or without a prefix length).
func isDispatchChain(chain string) bool {
	if strings.HasPrefix(chain, prefixOldBucket) {
		return true
	}
	_, ok := bucketBits(chain)
	return ok
}

func hash16(s string) string { return NameHash(s, serviceChainHashLen) }

// NameHash is the first n characters of the base32 of s's SHA-256: the hash
// kube-proxy puts in its chain names (16 in iptables mode, 8 in nftables mode).
func NameHash(s string, n int) string {
	sum := sha256.Sum256([]byte(s))
	return base32.StdEncoding.EncodeToString(sum[:])[:n]
}
