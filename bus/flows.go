package bus

import "net/netip"

// StaleFlows tells the conntrack stage which UDP front-ends exist now and which went
// away, after a commit changed them. Values merge (see MergeStaleFlows), so a
// burst of commits is never lost while conntrack is busy or restarting.
type StaleFlows struct {
	Family Family
	Now    map[netip.AddrPort][]netip.AddrPort
	Gone   map[netip.AddrPort]bool
}

// MergeStaleFlows folds next into prev: the newest front-ends win, and every
// front-end that went away in either and is not back in next stays gone.
func MergeStaleFlows(prev, next StaleFlows) StaleFlows {
	gone := make(map[netip.AddrPort]bool, len(prev.Gone)+len(next.Gone))
	for _, g := range []map[netip.AddrPort]bool{prev.Gone, next.Gone} {
		for k := range g {
			if _, back := next.Now[k]; !back {
				gone[k] = true
			}
		}
	}
	return StaleFlows{Family: next.Family, Now: next.Now, Gone: gone}
}
