package netfilter

import "strings"

// Kind says what a chain is to kpipe. It is the one place that decides when a
// chain is written (Rank), whether a periodic sync compares it with the kernel
// (Checked), whether it belongs to one service port (PerService) and whether a
// full sync deletes it when no plan has it (Disposable).
type Kind int

const (
	// KindOther: not kpipe's (built-in chains, other agents' chains, the canary).
	KindOther Kind = iota
	// KindTop: kpipe's fixed chains (KUBE-SERVICES, KUBE-NODEPORTS, KUBE-FORWARD, …).
	KindTop
	// KindMarkMasq: KUBE-MARK-MASQ, a fixed chain that per-service chains jump to.
	KindMarkMasq
	// KindEndpoint: KUBE-SEP-, one endpoint of one service port.
	KindEndpoint
	// KindService: KUBE-SVC- and KUBE-SVL-, a service port's load balancing.
	KindService
	// KindExternal: KUBE-EXT-, a service port's traffic from outside.
	KindExternal
	// KindFirewall: KUBE-FW-, a load balancer's source ranges.
	KindFirewall
	// KindDispatch: KUBE-SVC-B<bits>- (an older kpipe's KUBE-SVCS-), the chains
	// between KUBE-SERVICES and the service rules, by destination prefix.
	KindDispatch
	// kindLegacy: kube-proxy's old KUBE-XLB- chains, deleted where found.
	kindLegacy
)

var topChains = map[string]bool{
	ChainServices: true, ChainExternalServices: true, ChainNodePorts: true, ChainPostrouting: true,
	ChainForward: true, ChainProxyFirewall: true, ChainLocalnetFirewall: true,
}

// KindOf says what chain is.
func KindOf(chain string) Kind {
	switch {
	case chain == ChainMarkMasq:
		return KindMarkMasq
	case topChains[chain]:
		return KindTop
	case isDispatchChain(chain):
		// Before KUBE-SVC-: dispatch chains carry that prefix too (see PrefixBucket).
		return KindDispatch
	case strings.HasPrefix(chain, PrefixEndpoint):
		return KindEndpoint
	case strings.HasPrefix(chain, PrefixService), strings.HasPrefix(chain, PrefixServiceLocal):
		return KindService
	case strings.HasPrefix(chain, PrefixExternal):
		return KindExternal
	case strings.HasPrefix(chain, PrefixFirewall):
		return KindFirewall
	case strings.HasPrefix(chain, prefixLegacyXLB):
		return kindLegacy
	}
	return KindOther
}

// PerService says whether a chain belongs to one service port (render keeps it
// whole from one service's rendering; dispatch and top-level chains collect rules
// of many services).
func (k Kind) PerService() bool { return k >= KindEndpoint && k <= KindFirewall || k == kindLegacy }

// Disposable says whether kpipe deletes such a chain when no plan has it.
func (k Kind) Disposable() bool { return k.PerService() || k == KindDispatch }

// Checked says whether a periodic sync compares such a chain with the kernel:
// the chains kube-proxy rewrites on every sync. Per-service chains are only
// rewritten by the hourly full sync, as in kube-proxy.
func (k Kind) Checked() bool { return k == KindTop || k == KindMarkMasq || k == KindDispatch }

// Rank orders the chains of one write: a chain ranks above every chain it jumps
// to, so writing in rising rank never jumps to a chain not written yet:
// KUBE-MARK-MASQ (a fresh node does not have it), endpoint chains, service and
// local-policy chains, external, firewall, then the dispatch chains deepest first
// (the buckets, then the chains that jump to them, up to /16), and the top-level
// chains, which make everything else reachable, last.
func Rank(chain string) int {
	switch k := KindOf(chain); k {
	case KindMarkMasq:
		return 0
	case KindEndpoint:
		return 1
	case KindService, kindLegacy:
		return 2
	case KindExternal:
		return 3
	case KindFirewall:
		return 4
	case KindDispatch:
		// The longer the prefix, the deeper the chain, the earlier it is written.
		if bits, ok := bucketBits(chain); ok && bits >= 0 && bits <= 128 {
			return 5 + 128 - bits
		}
		return 5
	}
	return topRank
}

// topRank is the rank of top-level chains (and of chains kpipe does not know).
const topRank = 5 + 128 + 1
