// Package render turns a snapshot of desired state into a plan: the
// iptables-restore payloads of one IP family. Render is a pure function of the
// snapshot and of what the last successful commit left in the kernel; the stage
// around it only moves messages.
package render

import (
	"net/netip"
	"slices"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Local-traffic detection modes (--detect-local-mode).
const (
	DetectClusterCIDR     = "ClusterCIDR"
	DetectNodeCIDR        = "NodeCIDR"
	DetectBridgeInterface = "BridgeInterface"
	DetectInterfacePrefix = "InterfaceNamePrefix"
)

// Config is what render needs to know besides the snapshot. It is fixed for the
// life of the stage.
type Config struct {
	Family        bus.Family
	NodeName      string
	MasqueradeAll bool
	MasqueradeBit int // --iptables-masquerade-bit, 0..31
	// DetectLocal is the --detect-local-mode; ClusterCIDRs (of this family),
	// BridgeInterface and InterfacePrefix are its parameters.
	DetectLocal     string
	ClusterCIDRs    []netip.Prefix
	BridgeInterface string
	InterfacePrefix string
	// NodePortAddresses restricts NodePorts to local addresses in these CIDRs (of
	// this family); NodePortPrimary to the node's primary IP. Neither: every local address.
	NodePortAddresses []netip.Prefix
	NodePortPrimary   bool
	// LocalhostNodePorts: NodePorts answer on 127.0.0.1 (route_localnet). The
	// caller decides it for the family (cmd/kpipe: IPv4 only); render reads it.
	LocalhostNodePorts bool
	ConntrackLiberal   bool // nf_conntrack_tcp_be_liberal is set: do not drop INVALID
	// NoRandomFully: the host's iptables cannot do MASQUERADE --random-fully
	// (older than 1.6.2), so it is left out, as kube-proxy leaves it out.
	NoRandomFully bool
	// NFAcct says which of kube-proxy's nfacct objects exist: the rules count
	// packets in those (-m nfacct), as kube-proxy's do, and leave the others out.
	NFAcct NFAcctObjects
}

// NFAcctObjects says which nfacct objects (netfilter.NFAcct…) exist on the host.
type NFAcctObjects struct {
	InvalidDropped     bool // netfilter.NFAcctInvalidDropped
	LocalhostNodePorts bool // netfilter.NFAcctLocalhostNodePorts
}

// Render computes the plan for snap: every chain of the family's ruleset.
func Render(cfg Config, snap *bus.Snapshot) *bus.Plan {
	return NewRenderer(cfg).Render(snap)
}

// Renderer renders the snapshots of one family, keeping each service's rules from
// one snapshot to the next: a service whose Service and EndpointSlices are the same
// values as before (coalesce replaces a value when it changes) is not rendered
// again, and the plan is assembled from what changed (see assembly). Its plans
// are exactly Render's.
type Renderer struct {
	cfg   Config
	node  *bus.Node
	cache map[bus.ServiceKey]*cachedService
	// keys are the cache's keys, sorted, and services its values in that order.
	keys     []bus.ServiceKey
	services []*cachedService
	// nat and filter are the last plan's tables; buckets counts the services
	// in each leaf dispatch bucket.
	nat, filter *assembly
	buckets     map[netip.Prefix]int
	rebucket    bool // the set of buckets changed: the dispatch chains follow
	maps        planMaps
	// natChains and filterChains count the cached services' parts: about the
	// plan's chains, to size its lists.
	natChains, filterChains int
	// endpoints counts the cached services' endpoints as kube-proxy counts
	// them for its large-cluster mode (see followClusterSize).
	endpoints    int
	largeCluster bool // see largeClusterEndpoints
}

// cachedService is one service rendered on its own.
type cachedService struct {
	svc    *bus.Service
	slices []*bus.EndpointSlice
	r      rendering
}

// NewRenderer makes a renderer with an empty cache.
func NewRenderer(cfg Config) *Renderer {
	rr := &Renderer{cfg: cfg}
	rr.reset()
	return rr
}

func (rr *Renderer) reset() {
	rr.cache, rr.keys, rr.services = map[bus.ServiceKey]*cachedService{}, nil, nil
	rr.nat, rr.filter = newAssembly(), newAssembly()
	rr.buckets, rr.rebucket = map[netip.Prefix]int{}, true
	rr.maps, rr.natChains, rr.filterChains, rr.endpoints = newPlanMaps(), 0, 0, 0
}

func natParts(c *cachedService) []part    { return c.r.nat }
func filterParts(c *cachedService) []part { return c.r.filter }

// Render computes the plan for snap.
func (rr *Renderer) Render(snap *bus.Snapshot) *bus.Plan {
	if !sameNode(snap.State.Node, rr.node) {
		// Zone, pod CIDRs and node IPs shape every service's rules.
		rr.reset()
	}
	rr.node = snap.State.Node
	if len(rr.cache) == 0 {
		rr.largeCluster = endpointsAtMost(snap.State, rr.cfg.Family) > largeClusterEndpoints
	}
	// The cached services first, in order (a map lookup each, not an
	// iteration of the snapshot's map), then the snapshot's new ones.
	var stale []bus.ServiceKey
	for i, c := range rr.services {
		key := rr.keys[i]
		if svc := snap.State.Services[key]; svc != c.svc || !sameSlices(c.slices, snap.State.Slices[key]) {
			stale = append(stale, key)
		}
	}
	for _, key := range stale {
		rr.replace(key, rr.cache[key], rr.rendered(snap, key))
	}
	if len(rr.cache) < len(snap.State.Services) {
		var added []bus.ServiceKey
		for key := range snap.State.Services {
			if rr.cache[key] == nil {
				if c := rr.rendered(snap, key); c != nil {
					rr.account(key, nil, c)
					rr.cache[key] = c
					added = append(added, key)
				}
			}
		}
		rr.addKeys(added)
	}
	rr.followClusterSize(snap)

	// The sections of the shared chains, which no one service writes.
	fixed := newRuleWriter(rr.cfg, snap)
	fixed.writeFixedChains()
	rr.nat.setSection(sectionFixed, fixed.nat)
	rr.filter.setSection(sectionFixed, fixed.filter)
	if rr.rebucket {
		dispatch := newRuleWriter(rr.cfg, snap)
		for p := range rr.buckets {
			dispatch.buckets[p] = true
		}
		dispatch.writeBuckets()
		rr.nat.setSection(sectionDispatch, dispatch.nat)
		rr.rebucket = false
	}
	tail := newRuleWriter(rr.cfg, snap)
	tail.writeNodePortsTail()
	rr.nat.setSection(sectionTail, tail.nat)
	rr.nat.rebuild(rr.cache, natParts)
	rr.filter.rebuild(rr.cache, filterParts)

	p := &bus.Plan{
		Family: rr.cfg.Family, Generation: snap.Generation, QueuedAt: snap.QueuedAt, Full: snap.Full, Refresh: snap.Refresh,
		HealthChecks: bus.HealthChecks{Family: rr.cfg.Family, Addrs: fixed.healthCheckAddrs()},
	}
	rr.maps.fill(p, rr.services, rr.keys)
	p.Tables = []bus.TablePayload{
		rr.nat.payload(nf.TableNAT, rr.services, natParts, rr.natChains),
		rr.filter.payload(nf.TableFilter, rr.services, filterParts, rr.filterChains),
	}
	return p
}

// rendered is service key of snap rendered on its own (nil: it has none).
func (rr *Renderer) rendered(snap *bus.Snapshot, key bus.ServiceKey) *cachedService {
	svc := snap.State.Services[key]
	if svc == nil {
		return nil
	}
	one := newRuleWriter(rr.cfg, snap)
	one.largeCluster = rr.largeCluster
	for _, port := range svc.Ports {
		one.writeServicePort(svc, port)
	}
	return &cachedService{svc: svc, slices: sliceList(snap.State.Slices[key]), r: one.compact()}
}

// replace puts new (nil: none) in the cache in place of old (nil: none) for
// key, and tells the assemblies which shared chains change.
func (rr *Renderer) replace(key bus.ServiceKey, old, new *cachedService) {
	rr.account(key, old, new)
	i, found := slices.BinarySearchFunc(rr.keys, key, bus.ServiceKey.Compare)
	switch {
	case new == nil:
		delete(rr.cache, key)
		if found {
			rr.keys, rr.services = slices.Delete(rr.keys, i, i+1), slices.Delete(rr.services, i, i+1)
		}
	case found:
		rr.cache[key], rr.services[i] = new, new
	default:
		rr.cache[key] = new
		rr.keys, rr.services = slices.Insert(rr.keys, i, key), slices.Insert(rr.services, i, new)
	}
}

// addKeys puts keys (new to the cache, which has them) in key order: sorted
// and merged in one pass, as inserting 10^4 of them one by one into the sorted
// slices is quadratic (a tenth of a first render at 10k services).
func (rr *Renderer) addKeys(added []bus.ServiceKey) {
	slices.SortFunc(added, bus.ServiceKey.Compare)
	keys := make([]bus.ServiceKey, 0, len(rr.keys)+len(added))
	services := make([]*cachedService, 0, cap(keys))
	i := 0
	for _, key := range added {
		for ; i < len(rr.keys) && rr.keys[i].Compare(key) < 0; i++ {
			keys, services = append(keys, rr.keys[i]), append(services, rr.services[i])
		}
		keys, services = append(keys, key), append(services, rr.cache[key])
	}
	rr.keys, rr.services = append(keys, rr.keys[i:]...), append(services, rr.services[i:]...)
}

// account tells the assemblies, the plan's maps and counts and the buckets
// that key's rendering goes from old to new (either nil: none).
func (rr *Renderer) account(key bus.ServiceKey, old, new *cachedService) {
	if old != nil {
		rr.nat.contribute(key, old.r.nat, false)
		rr.filter.contribute(key, old.r.filter, false)
	}
	if new != nil {
		rr.nat.contribute(key, new.r.nat, true)
		rr.filter.contribute(key, new.r.filter, true)
	}
	rr.maps.replace(key, old, new)
	if old != nil {
		rr.natChains -= len(old.r.nat)
		rr.filterChains -= len(old.r.filter)
		rr.endpoints -= int(old.r.endpoints)
	}
	if new != nil {
		rr.natChains += len(new.r.nat)
		rr.filterChains += len(new.r.filter)
		rr.endpoints += int(new.r.endpoints)
	}
	if bucketsChanged(rr.buckets, old, new) {
		rr.rebucket = true
	}
}

// sameNode says whether two Node values shape service rules alike: watch sends
// a new value on every status update, and most change nothing kpipe uses.
func sameNode(a, b *bus.Node) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Zone == b.Zone && slices.Equal(a.Addrs, b.Addrs) && slices.Equal(a.PodCIDRs, b.PodCIDRs)
}

func sliceList(m map[string]*bus.EndpointSlice) []*bus.EndpointSlice {
	out := make([]*bus.EndpointSlice, 0, len(m))
	for _, name := range sortedKeys(m) {
		out = append(out, m[name])
	}
	return out
}

// sameSlices says whether m holds exactly the slices of list (by value
// identity), without sorting m.
func sameSlices(list []*bus.EndpointSlice, m map[string]*bus.EndpointSlice) bool {
	if len(list) != len(m) {
		return false
	}
	for _, sl := range list {
		if m[sl.Name] != sl {
			return false
		}
	}
	return true
}

// rendering is one service's rendering as the cache keeps it: at 10,000
// services a whole ruleWriter each (builders with room to grow, maps for one or
// two entries) held as much again as the rules' text.
type rendering struct {
	nat, filter []part
	udp         []udpFrontEnd
	checks      []healthCheck
	noLocal     bus.NoLocal
	unserved    []unservedPort
	buckets     []netip.Prefix
	endpoints   int32 // as kube-proxy counts them (largeClusterEndpoints)
}

// part is one chain's rules from one service: the whole of a per-service
// chain (with its hash and rank), or the service's rules in a shared one.
type part struct {
	name, rules string
	hash        uint64
	count       int32
	// perService: the chain is the service's alone (nf.Kind.PerService), and
	// rank its nf.Rank.
	perService bool
	rank       uint8
}

// unservedPort is a service port without endpoints (local: without local
// endpoints for its Local policy), by its label.
type unservedPort struct {
	label string
	local bool
}

type udpFrontEnd struct {
	front netip.AddrPort
	to    []netip.AddrPort
}

type healthCheck struct {
	key bus.ServiceKey
	hc  bus.HealthCheck
}

// compact is what the cache keeps of one service's ruleWriter.
func (r *ruleWriter) compact() rendering {
	out := rendering{nat: r.nat.parts(), filter: r.filter.parts(), noLocal: r.noLocal, unserved: r.unserved, endpoints: int32(r.endpoints)}
	r.nat.release()
	r.filter.release()
	for k, v := range r.udp {
		out.udp = append(out.udp, udpFrontEnd{k, v})
	}
	for k, v := range r.checks {
		out.checks = append(out.checks, healthCheck{k, v})
	}
	for p := range r.buckets {
		out.buckets = append(out.buckets, p)
	}
	return out
}
