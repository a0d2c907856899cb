package nftables

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render"
)

// Config is what the nftables renderer needs besides the state: the iptables
// renderer's Config (family, node name, masquerade, local-traffic detection,
// NodePort addresses), plus what only nftables mode has.
type Config struct {
	render.Config
	// ServiceCIDRs of this family: traffic to an address in them that no
	// Service holds is dropped. None: no such rule.
	ServiceCIDRs []netip.Prefix
	// Mark overrides the masquerade mark as written ("0x4000"); empty: from
	// MasqueradeBit, as kube-proxy formats it ("0x00004000" for bit 14).
	Mark string
}

// mark is the masquerade mark as kube-proxy writes it.
func (c Config) mark() string {
	if c.Mark != "" {
		return c.Mark
	}
	return fmt.Sprintf("%#08x", uint32(1)<<uint(c.MasqueradeBit))
}

// Render computes the table kube-proxy would write for st at a full sync.
func Render(cfg Config, st bus.State) *Table {
	w := newWriter(cfg, st)
	w.writeFixed()
	for _, key := range slices.SortedFunc(maps.Keys(st.Services), bus.ServiceKey.Compare) {
		svc := st.Services[key]
		if _, ok := svc.ClusterIPOf(cfg.Family); !ok {
			continue // not a service of this family
		}
		for _, port := range svc.Ports {
			w.writeServicePort(svc, port)
		}
	}
	return w.t
}

// writer builds one table.
type writer struct {
	cfg  Config
	st   bus.State
	t    *Table
	ip   string // "ip" or "ip6", as rules match addresses
	addr string // "ipv4_addr" or "ipv6_addr"
	// nodePortIPs are the addresses NodePorts answer on; nil: every local one.
	nodePortIPs []netip.Addr
	// isLocal and isNotLocal match traffic from (not from) a local pod; ""
	// when the detect-local mode cannot tell.
	isLocal, isNotLocal string
	chains              map[string]*Chain
	sets                map[string]*Set
}

func newWriter(cfg Config, st bus.State) *writer {
	w := &writer{cfg: cfg, st: st, t: &Table{Family: cfg.Family, Comment: "rules for kube-proxy"},
		ip: nf.NFTFamily(cfg.Family), addr: "ipv4_addr",
		chains: map[string]*Chain{}, sets: map[string]*Set{}}
	if cfg.Family == bus.IPv6 {
		w.addr = "ipv6_addr"
	}
	if ips := render.NodePortIPs(cfg.Config, st); ips != nil {
		// kube-proxy's nftables mode has no localhost NodePorts.
		w.nodePortIPs = slices.DeleteFunc(slices.Clone(ips), netip.Addr.IsLoopback)
	}
	w.isLocal, w.isNotLocal = w.localDetector()
	return w
}

// localDetector returns the matches for "from a local pod" and its negation, as
// kube-proxy's detect-local modes write them, or "" when the mode cannot tell.
func (w *writer) localDetector() (isLocal, isNotLocal string) {
	switch w.cfg.DetectLocal {
	case render.DetectClusterCIDR, "":
		if cidrs := bus.PrefixesOf(w.cfg.Family, w.cfg.ClusterCIDRs); len(cidrs) > 0 {
			return w.fromCIDR(cidrs[0])
		}
	case render.DetectNodeCIDR:
		if w.st.Node != nil {
			if cidrs := bus.PrefixesOf(w.cfg.Family, w.st.Node.PodCIDRs); len(cidrs) > 0 {
				return w.fromCIDR(cidrs[0])
			}
		}
	case render.DetectBridgeInterface:
		return "iifname " + w.cfg.BridgeInterface, "iifname != " + w.cfg.BridgeInterface
	case render.DetectInterfacePrefix:
		return "iifname " + w.cfg.InterfacePrefix + "*", "iifname != " + w.cfg.InterfacePrefix + "*"
	}
	return "", ""
}

func (w *writer) fromCIDR(p netip.Prefix) (isLocal, isNotLocal string) {
	return w.ip + " saddr " + p.Masked().String(), w.ip + " saddr != " + p.Masked().String()
}

// chain creates a chain (once) and returns it.
func (w *writer) chain(name string) *Chain {
	c := w.chains[name]
	if c == nil {
		c = &Chain{Name: name}
		w.chains[name] = c
		w.t.Chains = append(w.t.Chains, c)
	}
	return c
}

// rule appends a rule to the chain name.
func (w *writer) rule(chain, text string) { w.commented(chain, text, "") }

func (w *writer) commented(chain, text, comment string) {
	c := w.chain(chain)
	c.Rules = append(c.Rules, Rule{Chain: chain, Text: text, Comment: comment})
}

// element adds an element to the set or map name.
func (w *writer) element(name string, e Element) {
	s := w.sets[name]
	s.Elements = append(s.Elements, e)
}

// set creates a set or map.
func (w *writer) set(s *Set) {
	w.sets[s.Name] = s
	w.t.Sets = append(w.t.Sets, s)
}
