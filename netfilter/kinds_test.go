package netfilter

import (
	"net/netip"
	"testing"
)

// TestWriteRankOrdersJumpTargetsFirst: every chain ranks below the chains that
// jump to it: KUBE-MARK-MASQ, endpoint, service, external, firewall chains, then
// the dispatch chains deepest first (the /24 bucket, its /20, its /16; IPv6 the
// same at /120, /116, /112); the top-level chains rank -1, written last.
func TestWriteRankOrdersJumpTargetsFirst(t *testing.T) {
	bucket := func(p string) string { return BucketChain(netip.MustParsePrefix(p)) }
	for _, order := range [][]string{
		{ChainMarkMasq, PrefixEndpoint + "X", PrefixService + "X", PrefixExternal + "X", PrefixFirewall + "X",
			bucket("10.96.1.0/24"), bucket("10.96.0.0/20"), bucket("10.96.0.0/16")},
		{PrefixFirewall + "X", bucket("fd00:10:96::100/120"), bucket("fd00:10:96::/116"), bucket("fd00:10:96::/112")},
		{PrefixServiceLocal + "X", PrefixExternal + "X"},
	} {
		for i := 1; i < len(order); i++ {
			if a, b := WriteRank(order[i-1]), WriteRank(order[i]); a >= b {
				t.Errorf("WriteRank(%s) = %d, not below WriteRank(%s) = %d", order[i-1], a, order[i], b)
			}
		}
	}
	for _, top := range []string{ChainServices, ChainNodePorts, ChainPostrouting, ChainForward, "KUBE-SVCS"} {
		if r := WriteRank(top); r != -1 {
			t.Errorf("WriteRank(%s) = %d, want -1 (top level)", top, r)
		}
	}
	// A bucket of an older kpipe (one level, no prefix length in its name) is still
	// a bucket, never a top-level chain.
	if r := WriteRank(PrefixBucket + "W6N74VVXF7X37KSH"); r <= WriteRank(PrefixFirewall+"X") {
		t.Errorf("old-style bucket ranks %d", r)
	}
}

// TestBucketChainNames: bucket chain names fit iptables' 28 characters, carry the
// prefix length, and differ between prefixes.
func TestBucketChainNames(t *testing.T) {
	seen := map[string]string{}
	for _, p := range []string{"10.96.0.0/16", "10.96.0.0/20", "10.96.0.0/24", "10.96.1.0/24", "fd00:10:96::/112", "fd00:10:96::/116", "fd00:10:96::ff00/120"} {
		name := BucketChain(netip.MustParsePrefix(p))
		if len(name) > 28 {
			t.Errorf("chain of %s is %q, %d characters", p, name, len(name))
		}
		if bits, ok := bucketBits(name); !ok || bits != netip.MustParsePrefix(p).Bits() {
			t.Errorf("chain of %s is %q: prefix length %d, %v", p, name, bits, ok)
		}
		if other, dup := seen[name]; dup {
			t.Errorf("%s and %s share the chain %s", p, other, name)
		}
		seen[name] = p
	}
	if p, ok := BucketParent(Bucket(netip.MustParseAddr("10.96.1.7"))); !ok || p != netip.MustParsePrefix("10.96.0.0/20") {
		t.Errorf("parent of 10.96.1.0/24 = %v %v", p, ok)
	}
	if p, ok := BucketParent(netip.MustParsePrefix("fd00:10:96::/116")); !ok || p != netip.MustParsePrefix("fd00:10:96::/112") {
		t.Errorf("parent of fd00:10:96::/116 = %v %v", p, ok)
	}
	if _, ok := BucketParent(netip.MustParsePrefix("10.96.0.0/16")); ok {
		t.Error("a /16 has a dispatch parent; want KUBE-SERVICES")
	}
}
