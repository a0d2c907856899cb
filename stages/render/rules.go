package render

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// ruleWriter writes the rules of one snapshot (or of one service, for the cache)
// into a nat and a filter table, and collects what the plan reports besides them.
type ruleWriter struct {
	cfg        Config
	snap       *bus.Snapshot
	nat        *table
	filter     *table
	mark       string // masquerade mark, as "0x4000/0x4000"
	isLocal    []string
	isNotLocal []string
	udp        map[netip.AddrPort][]netip.AddrPort
	checks     map[bus.ServiceKey]bus.HealthCheck
	noLocal    bus.NoLocal
	unserved   []unservedPort
	buckets    map[netip.Prefix]bool
	// largeCluster: the endpoint rules take their large-cluster shape (see
	// largeClusterEndpoints); endpoints counts the endpoints written for it.
	largeCluster bool
	endpoints    int
}

func newRuleWriter(cfg Config, snap *bus.Snapshot) *ruleWriter {
	r := &ruleWriter{
		cfg: cfg, snap: snap,
		nat: newTable(nf.TableNAT), filter: newTable(nf.TableFilter),
		udp: map[netip.AddrPort][]netip.AddrPort{}, checks: map[bus.ServiceKey]bus.HealthCheck{},
		buckets: map[netip.Prefix]bool{},
	}
	m := fmt.Sprintf("0x%x", uint32(1)<<uint(cfg.MasqueradeBit))
	r.mark = m + "/" + m
	r.isLocal, r.isNotLocal = r.localDetector()
	return r
}

// localDetector returns the match that says "this packet comes from a local pod"
// and its negation, or nils when the mode cannot tell (yet).
func (r *ruleWriter) localDetector() (isLocal, isNotLocal []string) {
	switch r.cfg.DetectLocal {
	case DetectClusterCIDR, "":
		if len(r.cfg.ClusterCIDRs) > 0 {
			c := r.cfg.ClusterCIDRs[0].String()
			return []string{"-s", c}, []string{"!", "-s", c}
		}
	case DetectNodeCIDR:
		if node := r.snap.State.Node; node != nil {
			for _, p := range node.PodCIDRs {
				if bus.FamilyOf(p.Addr()) == r.cfg.Family {
					return []string{"-s", p.String()}, []string{"!", "-s", p.String()}
				}
			}
		}
	case DetectBridgeInterface:
		return []string{"-i", r.cfg.BridgeInterface}, []string{"!", "-i", r.cfg.BridgeInterface}
	case DetectInterfacePrefix:
		return []string{"-i", r.cfg.InterfacePrefix + "+"}, []string{"!", "-i", r.cfg.InterfacePrefix + "+"}
	}
	return nil, nil
}

func comment(text string) []string { return []string{"-m", "comment", "--comment", `"` + text + `"`} }

// largeClusterEndpoints is kube-proxy's largeClusterEndpointsThreshold: with
// more endpoints than this, summed over the family's service ports as
// kube-proxy sums them (each port's endpoints of the family, one per
// address:port, ready or not), the rules that send to an endpoint (a policy
// chain's, a KUBE-SEP- chain's) go without comments, as kube-proxy's do, and
// without their empty port match (endpointProto). Each is an xt match the
// kernel's validation walk visits on every change: at 10,000 services the
// endpoint rules are most of the walk (docs/architecture.md, section 7).
const largeClusterEndpoints = 1000

// endpointsAtMost bounds from above, cheaply, the endpoints
// largeClusterEndpoints counts in st: every slice's endpoints times its ports.
func endpointsAtMost(st bus.State, family bus.Family) int {
	n := 0
	for _, slices := range st.Slices {
		for _, sl := range slices {
			if sl.Family == family {
				n += len(sl.Items) * len(sl.Ports)
			}
		}
	}
	return n
}

// followClusterSize renders every cached service again when the cluster's
// endpoints crossed largeClusterEndpoints (either way) since they were
// rendered: their endpoint rules gain or lose their comments, so each chain
// holding some is written once. A render with nothing cached starts from
// endpointsAtMost's guess, which is wrong only with at most 1,000 endpoints
// counted, where rendering again is cheap: a first sync at 10,000 services
// renders once.
func (rr *Renderer) followClusterSize(snap *bus.Snapshot) {
	if large := rr.endpoints > largeClusterEndpoints; large != rr.largeCluster {
		rr.largeCluster = large
		for _, key := range rr.keys {
			rr.replace(key, rr.cache[key], rr.rendered(snap, key))
		}
	}
}

// endpointComment is the comment of a rule that sends to an endpoint: none in
// a large cluster.
func (r *ruleWriter) endpointComment(text string) []string {
	if r.largeCluster {
		return nil
	}
	return comment(text)
}

// endpointProto is the protocol match of a rule that sends to an endpoint. It
// has no --dport, so its "-m tcp" (udp, sctp) matches every packet "-p"
// already matched: an xt match more for the walk, which a large cluster
// leaves out (kube-proxy writes it; nothing else changes).
func (r *ruleWriter) endpointProto(sp *servicePort) []string {
	if r.largeCluster {
		return sp.proto[2:] // "-p", p
	}
	return sp.proto
}

func join(parts ...[]string) []string {
	var out []string
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// countIn is the match that counts a rule's packets in the nfacct object name,
// when it exists.
func countIn(exists bool, name string) []string {
	if !exists {
		return nil
	}
	return []string{"-m", "nfacct", "--nfacct-name", name}
}

// writeFixedChains writes the chains every sync has, in kube-proxy's shape.
func (r *ruleWriter) writeFixedChains() {
	for _, c := range []string{nf.ChainServices, nf.ChainNodePorts, nf.ChainPostrouting, nf.ChainMarkMasq} {
		r.nat.declare(c)
	}
	for _, c := range []string{nf.ChainServices, nf.ChainExternalServices, nf.ChainForward, nf.ChainNodePorts, nf.ChainProxyFirewall} {
		r.filter.declare(c)
	}
	r.nat.add(nf.ChainPostrouting, "-m", "mark", "!", "--mark", r.mark, "-j", "RETURN")
	r.nat.add(nf.ChainPostrouting, "-j", "MARK", "--xor-mark", strings.Split(r.mark, "/")[0])
	masq := []string{"-j", "MASQUERADE", "--random-fully"}
	if r.cfg.NoRandomFully {
		masq = masq[:2]
	}
	r.nat.rule(nf.ChainPostrouting, comment("kubernetes service traffic requiring SNAT"), masq)
	r.nat.add(nf.ChainMarkMasq, "-j", "MARK", "--or-mark", strings.Split(r.mark, "/")[0])

	if !r.cfg.ConntrackLiberal {
		r.filter.rule(nf.ChainForward, []string{"-m", "conntrack", "--ctstate", "INVALID"},
			countIn(r.cfg.NFAcct.InvalidDropped, nf.NFAcctInvalidDropped), []string{"-j", "DROP"})
	}
	r.filter.rule(nf.ChainForward, comment("kubernetes forwarding rules"), []string{"-m", "mark", "--mark", r.mark, "-j", "ACCEPT"})
	r.filter.rule(nf.ChainForward, comment("kubernetes forwarding conntrack rule"), []string{"-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"})
	if r.cfg.LocalhostNodePorts {
		r.filter.rule(nf.ChainLocalnetFirewall, comment("block incoming localnet connections"),
			[]string{"-d", "127.0.0.0/8", "!", "-s", "127.0.0.0/8", "-m", "conntrack", "!", "--ctstate", "RELATED,ESTABLISHED,DNAT", "-j", "DROP"})
	}
}

// servicePort is everything render derives for one port of one service.
type servicePort struct {
	svc        *bus.Service
	port       bus.Port
	name       bus.ServicePortName
	label      string // "ns/name:port", the comment kube-proxy puts on its rules
	proto      []string
	clusterIP  netip.Addr
	externals  []netip.Addr
	lbIPs      []netip.Addr
	sources    []netip.Prefix
	extLocal   bool
	intLocal   bool
	svcChain   string
	svlChain   string
	extChain   string
	fwChain    string
	endpoints  categorized
	externally bool
}

func (r *ruleWriter) writeServicePort(svc *bus.Service, port bus.Port) {
	clusterIP, ok := svc.ClusterIPOf(r.cfg.Family)
	if !ok {
		return // not a service of this family
	}
	name := svc.PortName(port)
	sp := &servicePort{
		svc: svc, port: port, name: name, label: name.String(),
		clusterIP: clusterIP, externals: bus.AddrsOf(r.cfg.Family, svc.ExternalIPs), lbIPs: bus.AddrsOf(r.cfg.Family, svc.LoadBalancerIPs),
		intLocal: svc.InternalPolicyLocal,
		svcChain: nf.ServiceChain(nf.PrefixService, name), svlChain: nf.ServiceChain(nf.PrefixServiceLocal, name),
		extChain: nf.ServiceChain(nf.PrefixExternal, name), fwChain: nf.ServiceChain(nf.PrefixFirewall, name),
	}
	p := strings.ToLower(string(port.Protocol))
	sp.proto = []string{"-m", p, "-p", p}
	sp.sources = bus.PrefixesOf(r.cfg.Family, svc.LoadBalancerSourceRanges)
	policies := PoliciesOf(svc, port, r.cfg.Family)
	sp.externally, sp.extLocal = policies.Externally, policies.ExternalLocal
	var eps []endpoint
	eps, sp.endpoints = selectEndpoints(r.snap.State, r.cfg.Family, r.cfg.NodeName, svc, port, policies)
	r.endpoints += len(eps)
	r.writeRules(sp)
}

// decision is what the endpoints and traffic policies of one service port make of
// its rules: which chains it uses, and what traffic without endpoints meets.
type decision struct {
	hasEndpoints, hasInternal, hasExternal bool
	usesClusterChain, usesLocalChain       bool
	usesExtChain, usesFW                   bool
	internalChain, externalPolicyChain     string // KUBE-SVC- or KUBE-SVL-
	lbChain                                string // where LB IP traffic goes: KUBE-FW- or KUBE-EXT-
	intTarget, intComment                  string // REJECT or DROP, for traffic from inside
	extTarget, extComment                  string // the same, from outside
	dport                                  []string
}

func (r *ruleWriter) decide(sp *servicePort) decision {
	eps := sp.endpoints
	d := decision{
		hasEndpoints:     eps.hasAny,
		hasInternal:      eps.hasAny,
		hasExternal:      eps.hasAny,
		usesClusterChain: len(eps.cluster) > 0 && (!sp.intLocal || sp.externally),
		usesLocalChain:   len(eps.local) > 0 && (sp.intLocal || sp.extLocal),
		internalChain:    sp.svcChain, externalPolicyChain: sp.svcChain, lbChain: sp.extChain,
		intTarget: "REJECT", intComment: sp.label + " has no endpoints",
		dport: []string{"--dport", strconv.Itoa(int(sp.port.Port))},
	}
	if sp.intLocal {
		d.internalChain, d.hasInternal = sp.svlChain, len(eps.local) > 0
	}
	if sp.extLocal {
		d.externalPolicyChain, d.hasExternal = sp.svlChain, len(eps.local) > 0
	}
	d.usesExtChain = d.hasEndpoints && sp.externally
	d.usesFW = d.hasEndpoints && len(sp.sources) > 0 && len(sp.lbIPs) > 0
	if d.usesFW {
		d.lbChain = sp.fwChain
	}
	d.extTarget, d.extComment = d.intTarget, d.intComment
	if !d.hasEndpoints {
		r.unserved = append(r.unserved, unservedPort{label: sp.label})
	} else if !d.hasInternal || !d.hasExternal {
		r.unserved = append(r.unserved, unservedPort{label: sp.label, local: true})
	}
	if d.hasEndpoints {
		if !d.hasInternal {
			d.intTarget, d.intComment = "DROP", sp.label+" has no local endpoints"
			r.noLocal.Internal++
		}
		if !d.hasExternal {
			d.extTarget, d.extComment = "DROP", sp.label+" has no local endpoints"
			r.noLocal.External++
		}
	}
	return d
}

func (r *ruleWriter) writeRules(sp *servicePort) {
	d := r.decide(sp)
	r.writeClusterIP(sp, d)
	// The policy chains: after the cluster IP's masquerade rule, so it runs before any DNAT.
	if d.usesClusterChain {
		r.writeEndpoints(sp, sp.svcChain, sp.endpoints.cluster)
	}
	if d.usesLocalChain {
		r.writeEndpoints(sp, sp.svlChain, sp.endpoints.local)
	}
	r.writeExternalIPs(sp, d)
	r.writeLoadBalancerIPs(sp, d)
	r.writeNodePort(sp, d)
	r.writeHealthCheck(sp)
	if d.usesExtChain {
		r.writeExternalChain(sp, d)
	}
	if d.usesFW {
		r.writeFirewallChain(sp)
	}
	if sp.port.Protocol == bus.UDP {
		r.recordUDP(sp, d.hasInternal, d.hasExternal)
	}
}

func (r *ruleWriter) writeClusterIP(sp *servicePort, d decision) {
	cip := join(sp.proto, []string{"-d", hostCIDR(sp.clusterIP)}, d.dport)
	if !d.hasInternal {
		r.filter.rule(nf.ChainServices, comment(d.intComment), cip, []string{"-j", d.intTarget})
		return
	}
	args := join(comment(sp.label+" cluster IP"), cip)
	if r.cfg.MasqueradeAll {
		r.nat.rule(d.internalChain, args, []string{"-j", nf.ChainMarkMasq})
	} else if r.isNotLocal != nil {
		// Off-cluster traffic to a ClusterIP (a static route to the service range)
		// may leave the node again, so it is masqueraded.
		r.nat.rule(d.internalChain, args, r.isNotLocal, []string{"-j", nf.ChainMarkMasq})
	}
	r.nat.rule(r.bucket(sp.clusterIP), args, []string{"-j", d.internalChain})
}

func (r *ruleWriter) writeExternalIPs(sp *servicePort, d decision) {
	for _, ip := range sp.externals {
		dst := join(sp.proto, []string{"-d", hostCIDR(ip)}, d.dport)
		if d.hasEndpoints {
			r.nat.rule(r.bucket(ip), comment(sp.label+" external IP"), dst, []string{"-j", sp.extChain})
		}
		if !d.hasExternal {
			r.filter.rule(nf.ChainExternalServices, comment(d.extComment), dst, []string{"-j", d.extTarget})
		}
	}
}

func (r *ruleWriter) writeLoadBalancerIPs(sp *servicePort, d decision) {
	for _, ip := range sp.lbIPs {
		dst := join(sp.proto, []string{"-d", hostCIDR(ip)}, d.dport)
		if d.hasEndpoints {
			r.nat.rule(r.bucket(ip), comment(sp.label+" loadbalancer IP"), dst, []string{"-j", d.lbChain})
		}
		if d.usesFW {
			r.filter.rule(nf.ChainProxyFirewall, comment(sp.label+" traffic not accepted by "+sp.fwChain), dst, []string{"-j", "DROP"})
		}
		if !d.hasExternal {
			r.filter.rule(nf.ChainExternalServices, comment(d.extComment), dst, []string{"-j", d.extTarget})
		}
	}
}

func (r *ruleWriter) writeNodePort(sp *servicePort, d decision) {
	np := sp.port.NodePort
	if np == 0 {
		return
	}
	npPort := []string{"--dport", strconv.Itoa(int(np))}
	if d.hasEndpoints {
		if r.cfg.LocalhostNodePorts && r.cfg.NFAcct.LocalhostNodePorts {
			// Only counts: the rule after it would take the same packets to the same chain.
			r.nat.rule(nf.ChainNodePorts, comment(sp.label), sp.proto, []string{"-d", "127.0.0.0/8"}, npPort,
				countIn(true, nf.NFAcctLocalhostNodePorts), []string{"-j", sp.extChain})
		}
		r.nat.rule(nf.ChainNodePorts, comment(sp.label), sp.proto, npPort, []string{"-j", sp.extChain})
	}
	if !d.hasExternal {
		r.filter.rule(nf.ChainExternalServices, comment(d.extComment), []string{"-m", "addrtype", "--dst-type", "LOCAL"}, sp.proto, npPort, []string{"-j", d.extTarget})
	}
}

// writeHealthCheck lets the health-check node port in, and tells health how many
// local endpoints there are.
func (r *ruleWriter) writeHealthCheck(sp *servicePort) {
	hc := sp.svc.HealthCheckNodePort
	if hc == 0 || !sp.extLocal {
		return
	}
	if _, done := r.checks[sp.svc.ServiceKey]; !done {
		r.filter.rule(nf.ChainNodePorts, comment(sp.label+" health check node port"), []string{"-m", "tcp", "-p", "tcp", "--dport", strconv.Itoa(int(hc)), "-j", "ACCEPT"})
	}
	r.checks[sp.svc.ServiceKey] = bus.HealthCheck{NodePort: hc, LocalEndpoints: max(r.checks[sp.svc.ServiceKey].LocalEndpoints, countReadyLocal(sp.endpoints.local))}
}

// writeExternalChain writes the external-traffic chain: masquerade, and with a
// Local policy the short-circuit for traffic that starts on this node.
func (r *ruleWriter) writeExternalChain(sp *servicePort, d decision) {
	r.nat.declare(sp.extChain)
	if !sp.extLocal {
		r.nat.rule(sp.extChain, comment("masquerade traffic for "+sp.label+" external destinations"), []string{"-j", nf.ChainMarkMasq})
	} else {
		if r.isLocal != nil && d.usesClusterChain {
			r.nat.rule(sp.extChain, comment("pod traffic for "+sp.label+" external destinations"), r.isLocal, []string{"-j", sp.svcChain})
		}
		r.nat.rule(sp.extChain, comment("masquerade LOCAL traffic for "+sp.label+" external destinations"), []string{"-m", "addrtype", "--src-type", "LOCAL", "-j", nf.ChainMarkMasq})
		if d.usesClusterChain {
			r.nat.rule(sp.extChain, comment("route LOCAL traffic for "+sp.label+" external destinations"), []string{"-m", "addrtype", "--src-type", "LOCAL", "-j", sp.svcChain})
		}
	}
	if d.hasExternal {
		r.nat.add(sp.extChain, "-j", d.externalPolicyChain)
	}
}

// writeFirewallChain writes the chain for loadBalancerSourceRanges: allowed sources
// go on, the rest fall through undNATted and KUBE-PROXY-FIREWALL drops them.
func (r *ruleWriter) writeFirewallChain(sp *servicePort) {
	r.nat.declare(sp.fwChain)
	args := comment(sp.label + " loadbalancer IP")
	allowNode := false
	for _, src := range sp.sources {
		r.nat.rule(sp.fwChain, args, []string{"-s", src.String(), "-j", sp.extChain})
		allowNode = allowNode || r.primaryIPIn(src)
	}
	if allowNode {
		// A request from the node to a VIP that is a local address loops back
		// with the VIP as its source.
		for _, ip := range sp.lbIPs {
			r.nat.rule(sp.fwChain, args, []string{"-s", hostCIDR(ip), "-j", sp.extChain})
		}
	}
	r.nat.rule(sp.fwChain, args, comment("other traffic to "+sp.label+" will be dropped by KUBE-PROXY-FIREWALL"))
}

// writeEndpoints writes the load-balancing rules of a policy chain. Endpoints are
// inline DNAT rules rather than kube-proxy's per-endpoint KUBE-SEP- chains:
// iptables-restore --noflush on nf_tables costs much more per chain than per rule.
func (r *ruleWriter) writeEndpoints(sp *servicePort, chain string, eps []endpoint) {
	r.nat.declare(chain)
	affinity := sp.svc.AffinitySeconds > 0
	// Each endpoint is either an inline DNAT or, for an endpoint that may be a pod
	// on this node, a jump to its own KUBE-SEP- chain: only a local pod can be sent
	// back to itself (hairpin), and only that case must be masqueraded, so the reply
	// comes back through the node. An endpoint without a nodeName, or inside this
	// node's pod CIDRs, may be local too. Endpoints known to be elsewhere need no
	// chain: iptables-restore --noflush on nf_tables costs much more per chain than
	// per rule.
	target := make([][]string, len(eps))
	recent := make([]string, len(eps))
	for i, e := range eps {
		sep := nf.EndpointName(sp.name, e.addr.String())
		recent[i] = sep // kube-proxy names the affinity list after the endpoint chain
		if e.hairpin {
			r.writeEndpointChain(sp, sep, e, affinity)
			target[i] = []string{"-j", sep}
		} else {
			target[i] = []string{"-j", "DNAT", "--to-destination", e.addr.String()}
		}
	}
	if affinity {
		secs := strconv.Itoa(int(sp.svc.AffinitySeconds))
		for i, e := range eps {
			// A returning client renews its affinity: the KUBE-SEP- chain does that
			// with --set; an inline DNAT with --update (check and set in one).
			check := "--update"
			if e.hairpin {
				check = "--rcheck"
			}
			r.nat.rule(chain, r.endpointComment(sp.label+" -> "+e.addr.String()),
				[]string{"-m", "recent", "--name", recent[i], check, "--seconds", secs, "--reap"}, r.endpointProto(sp), target[i])
		}
	}
	for i, e := range eps {
		var pick, set []string
		if n := len(eps) - i; n > 1 {
			pick = []string{"-m", "statistic", "--mode", "random", "--probability", probability(n)}
		}
		if affinity && !e.hairpin {
			set = []string{"-m", "recent", "--name", recent[i], "--set"}
		}
		r.nat.rule(chain, r.endpointComment(sp.label+" -> "+e.addr.String()), pick, set, r.endpointProto(sp), target[i])
	}
}

// writeEndpointChain writes the KUBE-SEP- chain of a possibly local endpoint (once, even when
// both the cluster and the local policy chain use it).
func (r *ruleWriter) writeEndpointChain(sp *servicePort, sep string, e endpoint, affinity bool) {
	if _, done := r.nat.chains[sep]; done {
		return
	}
	label := r.endpointComment(sp.label)
	r.nat.rule(sep, label, []string{"-s", hostCIDR(e.addr.Addr()), "-j", nf.ChainMarkMasq})
	var set []string
	if affinity {
		set = []string{"-m", "recent", "--name", sep, "--set"}
	}
	r.nat.rule(sep, label, set, r.endpointProto(sp), []string{"-j", "DNAT", "--to-destination", e.addr.String()})
}

func probability(n int) string { return fmt.Sprintf("%0.10f", 1.0/float64(n)) }

func hostCIDR(a netip.Addr) string {
	return netip.PrefixFrom(a, a.BitLen()).String()
}

func countReadyLocal(eps []endpoint) int {
	n := 0
	for _, e := range eps {
		if e.local && e.ready {
			n++
		}
	}
	return n
}

// primaryIPIn says whether p holds the node's primary IP of this family (its first
// address of the family), the one address kube-proxy checks source ranges against.
func (r *ruleWriter) primaryIPIn(p netip.Prefix) bool {
	if node := r.snap.State.Node; node != nil {
		if ips := bus.AddrsOf(r.cfg.Family, node.Addrs); len(ips) > 0 {
			return p.Contains(ips[0])
		}
	}
	return false
}

// recordUDP notes which endpoints each UDP front-end now reaches, for conntrack.
func (r *ruleWriter) recordUDP(sp *servicePort, hasInternal, hasExternal bool) {
	port := uint16(sp.port.Port)
	internal, external := sp.endpoints.cluster, sp.endpoints.reachable
	if sp.intLocal {
		internal = sp.endpoints.local
	}
	if !hasInternal {
		internal = nil
	}
	if !hasExternal {
		external = nil
	}
	r.udp[netip.AddrPortFrom(sp.clusterIP, port)] = addrPorts(internal)
	for _, ip := range append(append([]netip.Addr{}, sp.externals...), sp.lbIPs...) {
		r.udp[netip.AddrPortFrom(ip, port)] = addrPorts(external)
	}
	if sp.port.NodePort != 0 {
		any := netip.IPv4Unspecified()
		if r.cfg.Family == bus.IPv6 {
			any = netip.IPv6Unspecified()
		}
		r.udp[netip.AddrPortFrom(any, uint16(sp.port.NodePort))] = addrPorts(external)
	}
}

func addrPorts(eps []endpoint) []netip.AddrPort {
	out := make([]netip.AddrPort, 0, len(eps))
	for _, e := range eps {
		out = append(out, e.addr)
	}
	return out
}

// bucket is the chain that holds the KUBE-SERVICES rules for destination addr; it
// records the bucket so writeBuckets can send traffic to it.
func (r *ruleWriter) bucket(addr netip.Addr) string {
	p := nf.Bucket(addr)
	r.buckets[p] = true
	return nf.BucketChain(p)
}

// writeBuckets sends traffic from KUBE-SERVICES down to the bucket of its
// destination through the dispatch chains above it (netfilter.PrefixBucket): a
// chain's jumps go to disjoint prefixes, so a packet enters at most one chain per
// level, and one that matches nothing there comes back and goes on to the
// NodePort rule. The buckets were filled by the services; the dispatch chains are
// written here, once per snapshot.
func (r *ruleWriter) writeBuckets() {
	children := map[netip.Prefix][]netip.Prefix{} // the zero Prefix: KUBE-SERVICES
	seen := map[netip.Prefix]bool{}
	for leaf := range r.buckets {
		for p := leaf; !seen[p]; {
			seen[p] = true
			parent, ok := nf.BucketParent(p)
			children[parent] = append(children[parent], p)
			if !ok {
				break
			}
			p = parent
		}
	}
	r.writeDispatch(nf.ChainServices, netip.Prefix{}, children)
}

// writeDispatch writes chain's jumps to the chains of its children prefixes, in
// address order, and then theirs.
func (r *ruleWriter) writeDispatch(chain string, p netip.Prefix, children map[netip.Prefix][]netip.Prefix) {
	kids := children[p]
	slices.SortFunc(kids, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	for _, k := range kids {
		r.nat.rule(chain, comment("services in "+k.String()), []string{"-d", k.String(), "-j", nf.BucketChain(k)})
	}
	for _, k := range kids {
		if len(children[k]) > 0 {
			r.writeDispatch(nf.BucketChain(k), k, children)
		}
	}
}

// writeNodePortsTail sends traffic for local addresses to KUBE-NODEPORTS; it must be
// the last rule of KUBE-SERVICES.
func (r *ruleWriter) writeNodePortsTail() {
	const text = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"
	targets := r.nodePortIPs()
	if targets == nil {
		dst := []string{"-m", "addrtype", "--dst-type", "LOCAL"}
		if r.cfg.Family == bus.IPv6 {
			dst = append(dst, "!", "-d", "::1/128")
		} else if !r.cfg.LocalhostNodePorts {
			dst = append(dst, "!", "-d", "127.0.0.0/8")
		}
		r.nat.rule(nf.ChainServices, comment(text), dst, []string{"-j", nf.ChainNodePorts})
		return
	}
	for _, ip := range targets {
		if ip.IsLoopback() && !r.cfg.LocalhostNodePorts {
			continue
		}
		r.nat.rule(nf.ChainServices, comment(text), []string{"-d", hostCIDR(ip), "-j", nf.ChainNodePorts})
	}
}

// healthCheckAddrs lists the addresses healthCheckNodePort servers listen on (nil:
// every address): what --nodeport-addresses selects, loopback included, as
// kube-proxy's service health server listens on every address the flag matches.
func (r *ruleWriter) healthCheckAddrs() []netip.Addr { return r.nodePortIPs() }

// nodePortIPs lists the addresses NodePorts answer on, or nil for "every local address".
func (r *ruleWriter) nodePortIPs() []netip.Addr { return NodePortIPs(r.cfg, r.snap.State) }
