package render

import (
	"cmp"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// assembly is one table of the last plan, kept between snapshots so that a
// snapshot that changes a few services rebuilds only the chains they touch.
//
// A plan lists its chains by rank (nf.Rank), equal ranks in the order they were
// first written: the fixed chains, then each service's in key order, then the
// dispatch chains. Per-service chains (nf.Kind.PerService) are taken whole from
// the cache at each plan. A shared chain (every other kind) is its fixed section,
// then every contributing service's rules in key order, then its dispatch and
// tail sections; it is rebuilt only when one of those changed.
type assembly struct {
	shared map[string]*sharedChain
	dirty  map[*sharedChain]bool
	// order is the shared chains in plan order, worked out again only when a
	// chain comes or goes or another service becomes the first to write one.
	order      []*sharedChain
	orderDirty bool
	// declared are the chains each section declares, in the order it declares them.
	declared [numSections][]string
	// byRank is payload's room for the per-service chains, which rank 1 to 4.
	byRank [4][]bus.Chain
	// owners counts the services that have each per-service chain; gone are
	// the chains that lost their last owner or were deleted since the last
	// plan (the plan's Dropped, once checked).
	owners map[string]int
	gone   []string
}

// section is a part of the shared chains that no service writes: each is
// written by one ruleWriter for the whole snapshot, and kept until it changes.
type section int

const (
	sectionFixed    section = iota // the fixed rules (writeFixedChains), before the services'
	sectionDispatch                // the dispatch rules (writeBuckets), after the services'
	sectionTail                    // the NodePorts tail (writeNodePortsTail), last
	numSections
)

// sharedChain is a chain many services write into (a top-level or dispatch chain).
type sharedChain struct {
	name string
	rank int
	// sections are the rules of each section in the chain.
	sections [numSections]chainPart
	// by maps each service writing into the chain to its part's index among
	// that service's parts of the table.
	by map[bus.ServiceKey]int
	// first is the first of them in key order, which declared the chain first
	// when no fixed rule did; firstAt its part's index.
	first   bus.ServiceKey
	firstAt int
	out     bus.Chain
	count   int
}

// chainPart is some rules of a chain, as a table wrote them.
type chainPart struct {
	rules    string
	count    int32 // int32, as part's: three in each of thousands of shared chains
	declared bool  // the table declared the chain (it may hold no rules)
}

// declared says whether a section declares the chain.
func (c *sharedChain) declared() bool {
	for _, p := range c.sections {
		if p.declared {
			return true
		}
	}
	return false
}

func newAssembly() *assembly {
	return &assembly{shared: map[string]*sharedChain{}, dirty: map[*sharedChain]bool{}, orderDirty: true, owners: map[string]int{}}
}

func (a *assembly) chain(name string) *sharedChain {
	c := a.shared[name]
	if c == nil {
		c = &sharedChain{name: name, rank: nf.Rank(name), by: map[bus.ServiceKey]int{}}
		a.shared[name] = c
		a.orderDirty = true
	}
	return c
}

// contribute records that service key writes (or, with parts nil, no longer
// writes) into the shared chains of parts.
func (a *assembly) contribute(key bus.ServiceKey, parts []part, add bool) {
	for i, p := range parts {
		if p.perService {
			if add {
				a.owners[p.name]++
			} else if a.owners[p.name]--; a.owners[p.name] == 0 {
				delete(a.owners, p.name)
				a.gone = append(a.gone, p.name)
			}
			continue
		}
		c := a.chain(p.name)
		if add {
			c.by[key] = i
		} else {
			delete(c.by, key)
		}
		a.dirty[c] = true
	}
}

// setSection records the rules t writes into each chain it declares as
// section s of those shared chains, and marks what changed.
func (a *assembly) setSection(s section, t *table) {
	if !slices.Equal(t.order, a.declared[s]) {
		for _, name := range a.declared[s] {
			c := a.chain(name)
			c.sections[s] = chainPart{}
			a.dirty[c] = true
		}
		a.declared[s] = slices.Clone(t.order)
		a.orderDirty = true
	}
	for _, name := range t.order {
		c := a.chain(name)
		ct := t.chains[name]
		if now := (chainPart{ct.String(), int32(ct.count), true}); c.sections[s] != now {
			c.sections[s] = now
			a.dirty[c] = true
		}
	}
}

// rebuild works out the text of every dirty shared chain.
func (a *assembly) rebuild(cache map[bus.ServiceKey]*cachedService, partsOf func(*cachedService) []part) {
	var keys []bus.ServiceKey
	for c := range a.dirty {
		keys = keys[:0]
		for k := range c.by {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, bus.ServiceKey.Compare)
		if !c.declared() && len(keys) == 0 {
			delete(a.shared, c.name)
			a.gone = append(a.gone, c.name)
			a.orderDirty = true
			continue
		}
		// The fixed section, the services' rules in key order, then the
		// dispatch and tail sections.
		var b strings.Builder
		fixed, dispatch, tail := c.sections[sectionFixed], c.sections[sectionDispatch], c.sections[sectionTail]
		b.WriteString(fixed.rules)
		count := int(fixed.count)
		for _, k := range keys {
			p := partsOf(cache[k])[c.by[k]]
			b.WriteString(p.rules)
			count += int(p.count)
		}
		b.WriteString(dispatch.rules)
		b.WriteString(tail.rules)
		count += int(dispatch.count) + int(tail.count)
		text := b.String()
		c.out, c.count = bus.Chain{Name: c.name, Rules: text, Hash: fnv64a(text)}, count
		if len(keys) > 0 && (keys[0] != c.first || c.by[keys[0]] != c.firstAt) {
			c.first, c.firstAt = keys[0], c.by[keys[0]]
			a.orderDirty = true
		}
	}
	clear(a.dirty)
	if a.orderDirty {
		a.sortShared()
		a.orderDirty = false
	}
}

// sortShared puts the shared chains in plan order: by rank, then in the order
// a single pass would have declared them (fixed section, services in key
// order, dispatch and tail sections).
func (a *assembly) sortShared() {
	a.order = a.order[:0]
	placed := make(map[*sharedChain]bool, len(a.shared))
	place := func(c *sharedChain) {
		if c != nil && !placed[c] {
			placed[c] = true
			a.order = append(a.order, c)
		}
	}
	for _, name := range a.declared[sectionFixed] {
		place(a.shared[name])
	}
	var byService []*sharedChain
	for _, c := range a.shared {
		if !c.sections[sectionFixed].declared && len(c.by) > 0 {
			byService = append(byService, c)
		}
	}
	slices.SortFunc(byService, func(x, y *sharedChain) int {
		return cmp.Or(x.first.Compare(y.first), x.firstAt-y.firstAt)
	})
	for _, c := range byService {
		place(c)
	}
	for _, name := range a.declared[sectionDispatch] {
		place(a.shared[name])
	}
	for _, name := range a.declared[sectionTail] {
		place(a.shared[name])
	}
	slices.SortStableFunc(a.order, func(x, y *sharedChain) int { return x.rank - y.rank })
}

// rankOf is chain's nf.Rank, capped to keep with each part (every rank above
// 255 is a shared chain's, which payload does not order by).
func rankOf(chain string) uint8 { return uint8(min(nf.Rank(chain), 255)) }

// payload lists the table's chains in plan order: the shared chains ranked
// below the per-service ones, every service's chains rank by rank in key
// order (services: the cache's, in key order), then the other shared chains. It returns the rules
// the table holds too.
func (a *assembly) payload(name string, services []*cachedService, partsOf func(*cachedService) []part, size int) bus.TablePayload {
	tp := bus.TablePayload{Table: name, Chains: make([]bus.Chain, 0, size)}
	add := func(c *sharedChain) {
		tp.Chains = append(tp.Chains, c.out)
		tp.RuleCount += c.count
	}
	i := 0
	for ; i < len(a.order) && a.order[i].rank < 1; i++ {
		add(a.order[i])
	}
	// One pass over the services (not one a rank): into a list a rank, then
	// appended in rank order.
	for r := range a.byRank {
		a.byRank[r] = a.byRank[r][:0]
	}
	for _, c := range services {
		for _, p := range partsOf(c) {
			if p.perService {
				a.byRank[p.rank-1] = append(a.byRank[p.rank-1], bus.Chain{Name: p.name, Rules: p.rules, Hash: p.hash})
				tp.RuleCount += int(p.count)
			}
		}
	}
	for _, chains := range a.byRank {
		tp.Chains = append(tp.Chains, chains...)
	}
	tp.Dropped = a.dropped()
	for ; i < len(a.order); i++ {
		add(a.order[i])
	}
	return tp
}

// dropped are the chains gone since the last plan that this one does not
// have (a chain can go and come back within one snapshot), each once.
func (a *assembly) dropped() []string {
	slices.Sort(a.gone)
	out := slices.DeleteFunc(slices.Compact(a.gone), func(name string) bool {
		return a.owners[name] > 0 || a.shared[name] != nil
	})
	a.gone = nil
	return out
}

// bucketsChanged counts the services in each leaf bucket, from old's buckets
// to new's, and says whether a bucket came or went.
func bucketsChanged(count map[netip.Prefix]int, old, new *cachedService) bool {
	changed := false
	if old != nil {
		for _, p := range old.r.buckets {
			if count[p]--; count[p] == 0 {
				delete(count, p)
				changed = true
			}
		}
	}
	if new != nil {
		for _, p := range new.r.buckets {
			if count[p]++; count[p] == 1 {
				changed = true
			}
		}
	}
	return changed
}

// planMaps are the plan's UDP front-ends, health checks and counts of
// services without local endpoints, kept up to date as services change. A
// plan's maps are never written once it is sent, so a plan shares them with
// the last plan when no service changed them.
type planMaps struct {
	udp     map[netip.AddrPort]udpSlot
	checks  map[bus.ServiceKey]bus.HealthCheck
	noLocal bus.NoLocal
	// unserved are the labels of the service ports without endpoints and,
	// local, without local endpoints; outUnserved names them for the last
	// plan, nil when they changed since.
	unserved    map[bool]map[string]bool
	outUnserved *bus.Unserved
	// rescan: a front-end two services had lost the one that set it; the
	// UDP map is worked out again from every service.
	rescan bool
	// out are the maps the last plan got, nil when they changed since.
	outUDP    map[netip.AddrPort][]netip.AddrPort
	outChecks map[bus.ServiceKey]bus.HealthCheck
}

// udpSlot is one UDP front-end: its endpoints as set by the last service in
// key order that has it, and how many services have it.
type udpSlot struct {
	to     []netip.AddrPort
	owner  bus.ServiceKey
	owners int
}

func newPlanMaps() planMaps {
	return planMaps{udp: map[netip.AddrPort]udpSlot{}, checks: map[bus.ServiceKey]bus.HealthCheck{},
		unserved: map[bool]map[string]bool{false: {}, true: {}}}
}

// replace takes old's entries (nil: none) out and new's (nil: none) in, for
// service key.
func (m *planMaps) replace(key bus.ServiceKey, old, new *cachedService) {
	if old != nil {
		for _, u := range old.r.udp {
			s := m.udp[u.front]
			if s.owners--; s.owners == 0 {
				delete(m.udp, u.front)
			} else {
				m.rescan = m.rescan || s.owner == key
				m.udp[u.front] = s
			}
		}
		for _, c := range old.r.checks {
			delete(m.checks, c.key)
		}
		m.noLocal = m.noLocal.Minus(old.r.noLocal)
		for _, u := range old.r.unserved {
			delete(m.unserved[u.local], u.label)
		}
	}
	if new != nil {
		m.addUDP(key, new.r.udp)
		for _, c := range new.r.checks {
			m.checks[c.key] = c.hc
		}
		m.noLocal = m.noLocal.Plus(new.r.noLocal)
		for _, u := range new.r.unserved {
			m.unserved[u.local][u.label] = true
		}
	}
	if old != nil && len(old.r.unserved) > 0 || new != nil && len(new.r.unserved) > 0 {
		m.outUnserved = nil
	}
	if old != nil && (len(old.r.udp) > 0 || len(old.r.checks) > 0) || new != nil && (len(new.r.udp) > 0 || len(new.r.checks) > 0) {
		m.outUDP, m.outChecks = nil, nil
	}
}

func (m *planMaps) addUDP(key bus.ServiceKey, fronts []udpFrontEnd) {
	for _, u := range fronts {
		s := m.udp[u.front]
		if s.owners == 0 || key.Compare(s.owner) >= 0 {
			s.to, s.owner = u.to, key
		}
		s.owners++
		m.udp[u.front] = s
	}
}

// fill sets the plan's maps; services are the cache's in key order.
func (m *planMaps) fill(p *bus.Plan, services []*cachedService, keys []bus.ServiceKey) {
	if m.rescan {
		clear(m.udp)
		for i, c := range services {
			m.addUDP(keys[i], c.r.udp)
		}
		m.rescan, m.outUDP = false, nil
	}
	if m.outUDP == nil {
		m.outUDP = make(map[netip.AddrPort][]netip.AddrPort, len(m.udp))
		for front, s := range m.udp {
			m.outUDP[front] = s.to
		}
		m.outChecks = maps.Clone(m.checks)
	}
	p.UDP, p.HealthChecks.Services = m.outUDP, m.outChecks
	p.NoLocalEndpoints = m.noLocal
	if m.outUnserved == nil {
		m.outUnserved = &bus.Unserved{NoEndpoints: bus.NamesOf(m.unserved[false]), NoLocalEndpoints: bus.NamesOf(m.unserved[true])}
	}
	p.Unserved = m.outUnserved
}
