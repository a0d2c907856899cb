package netfilter

import "strings"

// WriteRank orders the chains of one write: a chain with a lower rank is written
// first, so that every chain is written after the chains it jumps to
// (KUBE-MARK-MASQ, which a fresh node does not have yet, then endpoint chains, then
// service and local-policy chains, then external, then firewall, then the
// KUBE-SERVICES dispatch chains, deepest first: the buckets, then the chains that
// jump to them, and so on up). Top-level chains, which make everything else
// reachable, rank -1: they are written last.
func WriteRank(chain string) int {
	switch {
	case chain == ChainMarkMasq:
		return 0
	case strings.HasPrefix(chain, PrefixEndpoint):
		return 1
	case strings.HasPrefix(chain, PrefixService), strings.HasPrefix(chain, PrefixServiceLocal):
		return 2
	case strings.HasPrefix(chain, PrefixExternal):
		return 3
	case strings.HasPrefix(chain, PrefixFirewall):
		return 4
	case strings.HasPrefix(chain, PrefixBucket):
		// The longer the prefix, the deeper the chain, the earlier it is written.
		if bits, ok := bucketBits(chain); ok && bits >= 0 && bits <= 128 {
			return 5 + 128 - bits
		}
		return 5
	}
	return -1
}

// IsBucket says whether a chain is one of the KUBE-SERVICES dispatch chains.
func IsBucket(chain string) bool { return strings.HasPrefix(chain, PrefixBucket) }
