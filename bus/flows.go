package bus

import "net/netip"

// StaleFlows tells the conntrack stage which UDP front-ends exist now and which went
// away, after a commit changed them. Values merge (see MergeStaleFlows), so a
// burst of commits is never lost while conntrack is busy or restarting.
type StaleFlows struct {
	Family Family
	Now    map[netip.AddrPort][]netip.AddrPort
	Gone   map[netip.AddrPort]bool
	// Forgotten counts the gone front-ends merges dropped to keep Gone within
	// MaxGone: their flows are left to the kernel's timeouts.
	Forgotten int
	// goneOrder is Gone's front-ends, the longest gone first, once a merge has
	// mixed commits; one commit's value has none (all went away together).
	goneOrder []netip.AddrPort
}

// MaxGone bounds the gone front-ends a value remembers while conntrack cannot take
// them (it cannot connect, for as long as that lasts), keeping the most recently
// gone. An idle flow expires on its own (UDP: 30 s, 120 s once a stream), so the
// oldest gone are the least worth keeping. At about 100 bytes an entry (its Gone
// map slot and its place in the order), 10000 is about 1 MB: ten thousand UDP
// front-ends (ClusterIP, external or NodePort) gone during one outage.
const MaxGone = 10000

// MergeStaleFlows folds next into prev: the newest front-ends win, and every
// front-end that went away in either and is not back in next stays gone, as new
// as its latest going; beyond MaxGone, the longest gone are forgotten (counted).
func MergeStaleFlows(prev, next StaleFlows) StaleFlows {
	order := make([]netip.AddrPort, 0, len(prev.Gone)+len(next.Gone))
	for _, k := range prev.goneInOrder() {
		if !next.Gone[k] { // gone again in next: next's place, below
			order = appendUnlessBack(order, k, next.Now)
		}
	}
	for _, k := range next.goneInOrder() {
		order = appendUnlessBack(order, k, next.Now)
	}
	forgotten := prev.Forgotten + next.Forgotten
	if over := len(order) - MaxGone; over > 0 {
		order, forgotten = order[over:], forgotten+over
	}
	gone := make(map[netip.AddrPort]bool, len(order))
	for _, k := range order {
		gone[k] = true
	}
	return StaleFlows{Family: next.Family, Now: next.Now, Gone: gone, Forgotten: forgotten, goneOrder: order}
}

func appendUnlessBack(order []netip.AddrPort, k netip.AddrPort, now map[netip.AddrPort][]netip.AddrPort) []netip.AddrPort {
	if _, back := now[k]; back {
		return order
	}
	return append(order, k)
}

// goneInOrder is Gone's front-ends, the longest gone first: goneOrder when it
// lists Gone (a merged value), else Gone's keys (one commit's, all as old).
func (s StaleFlows) goneInOrder() []netip.AddrPort {
	if len(s.goneOrder) == len(s.Gone) {
		return s.goneOrder
	}
	keys := make([]netip.AddrPort, 0, len(s.Gone))
	for k := range s.Gone {
		keys = append(keys, k)
	}
	return keys
}
