// Package render turns a snapshot of desired state into a plan: the
// iptables-restore payloads of one IP family. Render is a pure function of the
// snapshot and of what the last successful commit left in the kernel; the stage
// around it only moves messages.
package render

import (
	"net/netip"
	"slices"
	"strings"

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
	NodePortAddresses  []netip.Prefix
	NodePortPrimary    bool
	LocalhostNodePorts bool // IPv4 only: NodePorts answer on 127.0.0.1 (route_localnet)
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

// LocalhostNodePortsActive says whether NodePorts on 127.0.0.1 are programmed.
func (c Config) LocalhostNodePortsActive() bool {
	return c.Family == bus.IPv4 && c.LocalhostNodePorts
}

// Render computes the plan for snap. Chains whose rules are unchanged since
// snap.Committed are left out unless the snapshot asks for a full sync.
func Render(cfg Config, snap *bus.Snapshot) *bus.Plan {
	return NewRenderer(cfg).Render(snap)
}

// Renderer renders the snapshots of one family, keeping each service's rules from
// one snapshot to the next: a service whose Service and EndpointSlices are the same
// values as before (coalesce replaces a value when it changes) is not rendered
// again. Its plans are exactly Render's.
type Renderer struct {
	cfg   Config
	node  *bus.Node
	cache map[bus.ServiceKey]*cachedService
}

// cachedService is one service rendered on its own.
type cachedService struct {
	svc    *bus.Service
	slices []*bus.EndpointSlice
	r      rendering
}

// NewRenderer makes a renderer with an empty cache.
func NewRenderer(cfg Config) *Renderer {
	return &Renderer{cfg: cfg, cache: map[bus.ServiceKey]*cachedService{}}
}

// Render computes the plan for snap.
func (rr *Renderer) Render(snap *bus.Snapshot) *bus.Plan {
	if !sameNode(snap.State.Node, rr.node) {
		// Zone, pod CIDRs and node IPs shape every service's rules.
		rr.cache = map[bus.ServiceKey]*cachedService{}
	}
	rr.node = snap.State.Node
	r := newRenderer(rr.cfg, snap)
	r.writeFixedChains()
	seen := make(map[bus.ServiceKey]bool, len(snap.State.Services))
	for _, key := range sortedServiceKeys(snap.State.Services) {
		seen[key] = true
		svc := snap.State.Services[key]
		slices := sliceList(snap.State.Slices[key])
		c := rr.cache[key]
		if c == nil || c.svc != svc || !samePointers(c.slices, slices) {
			one := newRenderer(rr.cfg, snap)
			for _, port := range svc.Ports {
				one.writeServicePort(svc, port)
			}
			c = &cachedService{svc: svc, slices: slices, r: one.compact()}
			rr.cache[key] = c
		}
		r.merge(c.r)
	}
	for key := range rr.cache {
		if !seen[key] {
			delete(rr.cache, key)
		}
	}
	r.writeBuckets()
	r.writeNodePortsTail()
	return r.plan()
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

func samePointers(a, b []*bus.EndpointSlice) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// rendering is one service's rendering as the cache keeps it: at 10,000
// services a whole renderer each (builders with room to grow, maps for one or
// two entries) held as much again as the rules' text.
type rendering struct {
	nat, filter []part
	udp         []udpFrontEnd
	checks      []healthCheck
	noLocal     [2]int // "internal", "external"
	buckets     []netip.Prefix
}

// part is one chain's rules from one service: the whole of a per-service
// chain (with its hash), or the service's rules in a shared one.
type part struct {
	name, rules string
	count       int
	hash        uint64
}

type udpFrontEnd struct {
	front netip.AddrPort
	to    []netip.AddrPort
}

type healthCheck struct {
	key bus.ServiceKey
	hc  bus.HealthCheck
}

// compact is what the cache keeps of one service's renderer.
func (r *renderer) compact() rendering {
	out := rendering{nat: r.nat.parts(), filter: r.filter.parts(),
		noLocal: [2]int{r.noLocal["internal"], r.noLocal["external"]}}
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

// merge adds one service's rendering to r.
func (r *renderer) merge(one rendering) {
	r.nat.merge(one.nat)
	r.filter.merge(one.filter)
	for _, u := range one.udp {
		r.udp[u.front] = u.to
	}
	for _, c := range one.checks {
		r.checks[c.key] = c.hc
	}
	r.noLocal["internal"] += one.noLocal[0]
	r.noLocal["external"] += one.noLocal[1]
	for _, p := range one.buckets {
		r.buckets[p] = true
	}
}

func sortedServiceKeys(m map[bus.ServiceKey]*bus.Service) []bus.ServiceKey {
	keys := make([]bus.ServiceKey, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b bus.ServiceKey) int {
		if c := strings.Compare(a.Namespace, b.Namespace); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return keys
}

// plan lists every chain with its hash, in dependency order (nf.Rank): a chain
// after the chains it jumps to, so commit can write them in that order.
func (r *renderer) plan() *bus.Plan {
	p := &bus.Plan{
		Family: r.cfg.Family, Generation: r.snap.Generation, QueuedAt: r.snap.QueuedAt,
		Full: r.snap.Full, Refresh: r.snap.Refresh, UDP: r.udp,
		HealthChecks:     bus.HealthChecks{Family: r.cfg.Family, Services: r.checks, Addrs: r.healthCheckAddrs()},
		NoLocalEndpoints: r.noLocal,
	}
	for _, t := range []*table{r.nat, r.filter} {
		tp := bus.TablePayload{Table: t.name, Chains: make([]bus.Chain, 0, len(t.order))}
		for _, name := range t.order {
			c := t.chains[name]
			tp.RuleCount += c.count
			tp.Chains = append(tp.Chains, bus.Chain{Name: name, Rules: c.String(), Hash: c.sum()})
		}
		tp.Chains = byRank(tp.Chains)
		p.Tables = append(p.Tables, tp)
	}
	return p
}

// byRank orders chains by nf.Rank, keeping the order of equal ranks, with each
// chain's rank worked out once (sorting 24,000 chains compared names' kinds
// hundreds of thousands of times: 15% of a render at 10,000 services).
func byRank(chains []bus.Chain) []bus.Chain {
	ranks := make([]int, len(chains))
	order := make([]int, len(chains))
	for i, c := range chains {
		ranks[i], order[i] = nf.Rank(c.Name), i
	}
	slices.SortStableFunc(order, func(a, b int) int { return ranks[a] - ranks[b] })
	out := make([]bus.Chain, len(chains))
	for i, j := range order {
		out[i] = chains[j]
	}
	return out
}
