package nftables

import (
	"cmp"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/render"
)

// servicePort is what one port of one service renders from.
type servicePort struct {
	svc       *bus.Service
	port      bus.Port
	name      bus.ServicePortName
	proto     string // "tcp", "udp", "sctp"
	clusterIP netip.Addr
	externals []netip.Addr
	lbIPs     []netip.Addr
	sources   []netip.Prefix // loadBalancerSourceRanges of the family
	policies  render.Policies
	eps       render.PortEndpoints
	// the chains of the port
	base, svcChain, localChain, extChain, fwChain string
}

// writeServicePort writes the elements, chains and affinity sets of one port.
func (w *writer) writeServicePort(svc *bus.Service, port bus.Port) {
	name := svc.PortName(port)
	sp := &servicePort{
		svc: svc, port: port, name: name, proto: strings.ToLower(string(port.Protocol)),
		externals: bus.AddrsOf(w.cfg.Family, svc.ExternalIPs), lbIPs: bus.AddrsOf(w.cfg.Family, svc.LoadBalancerIPs),
		sources:  bus.PrefixesOf(w.cfg.Family, svc.LoadBalancerSourceRanges),
		policies: render.PoliciesOf(svc, port, w.cfg.Family),
		eps:      render.SelectEndpoints(w.st, w.cfg.Family, w.cfg.NodeName, svc, port),
		base:     portBase(name),
	}
	sp.clusterIP, _ = svc.ClusterIPOf(w.cfg.Family)
	sp.svcChain, sp.localChain = prefixService+sp.base, prefixLocal+sp.base
	sp.extChain, sp.fwChain = prefixExternal+sp.base, prefixFirewall+sp.base
	// kube-proxy orders endpoints by their "ip:port" text everywhere.
	for _, l := range []*[]netip.AddrPort{&sp.eps.Cluster, &sp.eps.Local, &sp.eps.Reachable} {
		slices.SortFunc(*l, func(a, b netip.AddrPort) int { return cmp.Compare(a.String(), b.String()) })
	}
	p := w.plan(sp)
	w.writeElements(sp, p)
	w.writeChains(sp, p)
}

// portPlan is what a port's endpoints and policies make of its objects.
type portPlan struct {
	usesCluster, usesLocal, usesExternal, usesFirewall bool
	hasInternal, hasExternal                           bool
	internalChain, externalPolicyChain                 string
	// internalVerdict and externalVerdict are what traffic without endpoints
	// meets in the no-endpoint maps.
	internalVerdict, externalVerdict string
}

func (w *writer) plan(sp *servicePort) portPlan {
	p := portPlan{
		usesCluster:  len(sp.eps.Cluster) > 0 && sp.policies.UsesCluster(),
		usesLocal:    len(sp.eps.Local) > 0 && sp.policies.UsesLocal(),
		usesExternal: sp.eps.Any && sp.policies.Externally,
		usesFirewall: len(sp.lbIPs) > 0 && len(sp.sources) > 0,
		hasInternal:  sp.eps.Any, hasExternal: sp.eps.Any,
		internalChain: sp.svcChain, externalPolicyChain: sp.svcChain,
		internalVerdict: "goto " + chainReject, externalVerdict: "goto " + chainReject,
	}
	if sp.policies.InternalLocal {
		p.internalChain, p.hasInternal = sp.localChain, len(sp.eps.Local) > 0
	}
	if sp.policies.ExternalLocal {
		p.externalPolicyChain, p.hasExternal = sp.localChain, len(sp.eps.Local) > 0
	}
	if sp.eps.Any {
		// Endpoints elsewhere, none here for a Local policy: drop.
		p.internalVerdict, p.externalVerdict = "drop", "drop"
	}
	return p
}

// writeElements fills the fixed sets and maps for the port.
func (w *writer) writeElements(sp *servicePort, p portPlan) {
	port := strconv.Itoa(int(sp.port.Port))
	tuple := func(ip netip.Addr) []string { return []string{ip.String(), sp.proto, port} }
	label := sp.name.String()
	noEndpoints := func(ip netip.Addr, verdict string) {
		w.element(mapNoEndpointServices, Element{Key: tuple(ip), Value: verdict, Comment: label})
	}

	w.element(setClusterIPs, Element{Key: []string{sp.clusterIP.String()}})
	if p.hasInternal {
		w.element(mapServiceIPs, Element{Key: tuple(sp.clusterIP), Value: "goto " + p.internalChain})
	} else {
		noEndpoints(sp.clusterIP, p.internalVerdict)
	}
	for _, ip := range slices.Concat(sp.externals, sp.lbIPs) {
		if sp.eps.Any {
			w.element(mapServiceIPs, Element{Key: tuple(ip), Value: "goto " + sp.extChain})
		}
		if !p.hasExternal {
			noEndpoints(ip, p.externalVerdict)
		}
	}
	if p.usesFirewall {
		for _, ip := range sp.lbIPs {
			w.element(mapFirewallIPs, Element{Key: tuple(ip), Value: "goto " + sp.fwChain})
		}
	}
	if sp.port.NodePort != 0 {
		key := []string{sp.proto, strconv.Itoa(int(sp.port.NodePort))}
		if sp.eps.Any {
			w.element(mapServiceNodePorts, Element{Key: key, Value: "goto " + sp.extChain})
		}
		if !p.hasExternal {
			w.element(mapNoEndpointNodePort, Element{Key: key, Value: p.externalVerdict, Comment: label})
		}
	}
}

// writeChains writes the port's chains in the order kube-proxy creates them:
// endpoint chains, service-, local-, external-, firewall-.
func (w *writer) writeChains(sp *servicePort, p portPlan) {
	affinity := sp.svc.AffinitySeconds > 0
	for _, ep := range sp.eps.Reachable {
		w.chain(prefixEndpoint + endpointBase(sp.name, ep))
	}
	if p.usesCluster {
		w.chain(sp.svcChain)
	}
	if p.usesLocal {
		w.chain(sp.localChain)
	}
	if p.usesExternal {
		w.chain(sp.extChain)
	}
	if p.usesFirewall {
		w.chain(sp.fwChain)
	}

	if p.hasInternal {
		w.writeMasqueradeClusterIP(sp, p.internalChain)
	}
	if p.usesExternal {
		w.writeExternal(sp, p)
	}
	if p.usesFirewall {
		w.writeFirewall(sp)
	}
	if affinity {
		for _, ep := range sp.eps.Reachable {
			w.affinitySet(prefixAffinity+endpointBase(sp.name, ep), sp.svc.AffinitySeconds)
		}
	}
	if p.usesCluster {
		w.writeBalancing(sp, sp.svcChain, sp.eps.Cluster)
	}
	if p.usesLocal {
		w.writeBalancing(sp, sp.localChain, sp.eps.Local)
	}
	for _, ep := range sp.eps.Reachable {
		w.writeEndpoint(sp, ep)
	}
}

// writeMasqueradeClusterIP marks ClusterIP traffic for masquerade: all of it
// with masqueradeAll, else what does not come from a local pod (it may have
// been routed here from off the cluster and leave again).
func (w *writer) writeMasqueradeClusterIP(sp *servicePort, chain string) {
	dst := w.ip + " daddr " + sp.clusterIP.String()
	switch {
	case w.cfg.MasqueradeAll:
		w.rule(chain, dst+" jump "+chainMarkMasq)
	case w.isNotLocal != "":
		w.rule(chain, dst+" "+w.isNotLocal+" jump "+chainMarkMasq)
	}
}

// writeExternal writes the external- chain: masquerade and the Cluster policy,
// or for the Local policy the short-circuits that keep traffic from pods and
// from the node itself working, then the Local policy chain.
func (w *writer) writeExternal(sp *servicePort, p portPlan) {
	if !sp.policies.ExternalLocal {
		w.rule(sp.extChain, "jump "+chainMarkMasq)
	} else {
		if w.isLocal != "" {
			w.commented(sp.extChain, w.isLocal+" goto "+sp.svcChain, "short-circuit pod traffic")
		}
		w.commented(sp.extChain, "fib saddr type local jump "+chainMarkMasq, "masquerade local traffic")
		w.commented(sp.extChain, "fib saddr type local goto "+sp.svcChain, "short-circuit local traffic")
	}
	if p.hasExternal {
		w.rule(sp.extChain, "goto "+p.externalPolicyChain)
	}
}

// writeFirewall drops sources outside loadBalancerSourceRanges; when a range
// holds the node's IP, the LB IPs are allowed too (a request from the node
// to its own VIP comes back with the VIP as source).
func (w *writer) writeFirewall(sp *servicePort) {
	var sources []string
	allowNode := false
	nodeIP := w.nodeIP()
	for _, r := range sp.sources {
		sources = append(sources, r.Masked().String())
		allowNode = allowNode || (nodeIP.IsValid() && r.Contains(nodeIP))
	}
	if allowNode {
		for _, ip := range sp.lbIPs {
			sources = append(sources, ip.String())
		}
	}
	w.rule(sp.fwChain, w.ip+" saddr != { "+strings.Join(sources, " , ")+" } drop")
}

// nodeIP is the node's primary IP of the family (invalid when unknown).
func (w *writer) nodeIP() netip.Addr {
	if w.st.Node == nil {
		return netip.Addr{}
	}
	if ips := bus.AddrsOf(w.cfg.Family, w.st.Node.Addrs); len(ips) > 0 {
		return ips[0]
	}
	return netip.Addr{}
}

// writeBalancing sends a policy chain's traffic to its endpoints: affinity
// first, then a random pick.
func (w *writer) writeBalancing(sp *servicePort, chain string, eps []netip.AddrPort) {
	if sp.svc.AffinitySeconds > 0 {
		for _, ep := range eps {
			base := endpointBase(sp.name, ep)
			w.rule(chain, w.ip+" saddr @"+prefixAffinity+base+" goto "+prefixEndpoint+base)
		}
	}
	picks := make([]string, len(eps))
	for i, ep := range eps {
		picks[i] = strconv.Itoa(i) + " : goto " + prefixEndpoint + endpointBase(sp.name, ep)
	}
	w.rule(chain, "numgen random mod "+strconv.Itoa(len(eps))+" vmap { "+strings.Join(picks, " , ")+" }")
}

// writeEndpoint writes an endpoint's chain: masquerade hairpin traffic,
// record affinity, DNAT.
func (w *writer) writeEndpoint(sp *servicePort, ep netip.AddrPort) {
	base := endpointBase(sp.name, ep)
	chain := prefixEndpoint + base
	w.rule(chain, w.ip+" saddr "+ep.Addr().String()+" jump "+chainMarkMasq)
	if sp.svc.AffinitySeconds > 0 {
		w.rule(chain, "update @"+prefixAffinity+base+" { "+w.ip+" saddr }")
	}
	w.rule(chain, "meta l4proto "+sp.proto+" dnat to "+ep.String())
}
