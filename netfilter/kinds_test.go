package netfilter

import (
	"net/netip"
	"regexp"
	"strings"
	"testing"
)

// TestRankOrdersJumpTargetsFirst: every chain ranks below the chains that jump to
// it: KUBE-MARK-MASQ, endpoint, service, external, firewall chains, then the
// dispatch chains deepest first (the /24 bucket, its /20, its /16; IPv6 the same
// at /120, /116, /112), then the top-level chains.
func TestRankOrdersJumpTargetsFirst(t *testing.T) {
	bucket := func(p string) string { return BucketChain(netip.MustParsePrefix(p)) }
	for _, order := range [][]string{
		{ChainMarkMasq, PrefixEndpoint + "X", PrefixService + "X", PrefixExternal + "X", PrefixFirewall + "X",
			bucket("10.96.1.0/24"), bucket("10.96.0.0/20"), bucket("10.96.0.0/16")},
		{PrefixFirewall + "X", bucket("fd00:10:96::100/120"), bucket("fd00:10:96::/116"), bucket("fd00:10:96::/112")},
		{PrefixServiceLocal + "X", PrefixExternal + "X"},
	} {
		for i := 1; i < len(order); i++ {
			if a, b := Rank(order[i-1]), Rank(order[i]); a >= b {
				t.Errorf("Rank(%s) = %d, not below Rank(%s) = %d", order[i-1], a, order[i], b)
			}
		}
	}
	for _, top := range []string{ChainServices, ChainNodePorts, ChainPostrouting, ChainForward, "KUBE-SVCS"} {
		if r := Rank(top); r <= Rank(bucket("10.96.0.0/16")) {
			t.Errorf("Rank(%s) = %d, want it above every dispatch chain (top level)", top, r)
		}
	}
	// A bucket of an older kpipe (one level, no prefix length in its name) is still
	// a bucket, never a top-level chain.
	if r := Rank(prefixOldBucket + "W6N74VVXF7X37KSH"); r <= Rank(PrefixFirewall+"X") || r >= Rank(ChainServices) {
		t.Errorf("old-style bucket ranks %d", r)
	}
}

// TestBucketChainNames: bucket chain names fit iptables' 28 characters, carry the
// prefix length, and differ between prefixes. They start with kube-proxy's
// KUBE-SVC-, so that kube-proxy taking the node over deletes them as its own
// stale chains, yet can never equal a service chain (KUBE-SVC- and 16 base32
// characters, which have no '-').
func TestBucketChainNames(t *testing.T) {
	seen := map[string]string{}
	serviceChain := regexp.MustCompile(`^KUBE-SVC-[A-Z2-7]{16}$`)
	for _, p := range []string{"10.96.0.0/16", "10.96.0.0/20", "10.96.0.0/24", "10.96.1.0/24", "fd00:10:96::/112", "fd00:10:96::/116", "fd00:10:96::ff00/120"} {
		name := BucketChain(netip.MustParsePrefix(p))
		if len(name) > 28 {
			t.Errorf("chain of %s is %q, %d characters", p, name, len(name))
		}
		if bits, ok := bucketBits(name); !ok || bits != netip.MustParsePrefix(p).Bits() {
			t.Errorf("chain of %s is %q: prefix length %d, %v", p, name, bits, ok)
		}
		if !strings.HasPrefix(name, PrefixService) || serviceChain.MatchString(name) {
			t.Errorf("chain of %s is %q: want kube-proxy's KUBE-SVC- prefix, and no service chain's name", p, name)
		}
		if KindOf(name) != KindDispatch {
			t.Errorf("chain of %s is %q, of kind %d; want a dispatch chain", p, name, KindOf(name))
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

// TestKinds: what each chain is to kpipe. A full sync deletes disposable chains it
// does not write: the fixed chains, built-in chains and anybody else's must never
// be disposable.
func TestKinds(t *testing.T) {
	bucket := BucketChain(netip.MustParsePrefix("10.96.1.0/24"))
	for _, c := range []struct {
		chain                           string
		kind                            Kind
		perService, disposable, checked bool
	}{
		{"KUBE-SVC-AAAAAAAAAAAAAAAA", KindService, true, true, false},
		{"KUBE-SVL-AAAAAAAAAAAAAAAA", KindService, true, true, false},
		{"KUBE-EXT-AAAAAAAAAAAAAAAA", KindExternal, true, true, false},
		{"KUBE-FW-AAAAAAAAAAAAAAAA", KindFirewall, true, true, false},
		{"KUBE-SEP-AAAAAAAAAAAAAAAA", KindEndpoint, true, true, false},
		{"KUBE-XLB-AAAAAAAAAAAAAAAA", kindLegacy, true, true, false},
		{bucket, KindDispatch, false, true, true},
		// A service chain whose hash starts like a dispatch chain is a service chain.
		{"KUBE-SVC-B24AAAAAAAAAAAAA", KindService, true, true, false},
		{"KUBE-SVC-BAAAAAAAAAAAAAAA", KindService, true, true, false},
		// An older kpipe's dispatch chains: deleted by an upgraded kpipe.
		{"KUBE-SVCS-24-AAAAAAAAAAAAAA", KindDispatch, false, true, true},
		{"KUBE-SVCS-W6N74VVXF7X37KSH", KindDispatch, false, true, true},
		{ChainServices, KindTop, false, false, true},
		{ChainExternalServices, KindTop, false, false, true},
		{ChainNodePorts, KindTop, false, false, true},
		{ChainPostrouting, KindTop, false, false, true},
		{ChainForward, KindTop, false, false, true},
		{ChainProxyFirewall, KindTop, false, false, true},
		{ChainLocalnetFirewall, KindTop, false, false, true},
		{ChainMarkMasq, KindMarkMasq, false, false, true},
	} {
		k := KindOf(c.chain)
		if k != c.kind || k.PerService() != c.perService || k.Disposable() != c.disposable || k.Checked() != c.checked {
			t.Errorf("%s: kind %d per-service %v disposable %v checked %v; want %d %v %v %v", c.chain,
				k, k.PerService(), k.Disposable(), k.Checked(), c.kind, c.perService, c.disposable, c.checked)
		}
	}
	for _, c := range []string{ChainCanary, "KUBE-MARK-DROP", "KUBE-KUBELET-CANARY", "INPUT", "PREROUTING",
		"CNI-HOSTPORT-DNAT", "KUBE-SVC", "kube-svc-aaaaaaaaaaaaaaaa", ""} {
		if k := KindOf(c); k != KindOther || k.Disposable() || k.Checked() {
			t.Errorf("%q: kind %d; want someone else's chain, never deleted or checked", c, k)
		}
	}
}
