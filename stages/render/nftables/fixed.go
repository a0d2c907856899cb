package nftables

import (
	"strings"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// The fixed chains, sets and maps.
const (
	chainServices         = "services"
	chainMasquerading     = "masquerading"
	chainMarkMasq         = "mark-for-masquerade"
	chainReject           = "reject-chain"
	chainFirewallCheck    = "firewall-check"
	chainEndpointsCheck   = "service-endpoints-check"
	chainNodePortsCheck   = "nodeport-endpoints-check"
	chainClusterIPsCheck  = "cluster-ips-check"
	setClusterIPs         = "cluster-ips"
	setNodePortIPs        = "nodeport-ips"
	mapServiceIPs         = "service-ips"
	mapServiceNodePorts   = "service-nodeports"
	mapFirewallIPs        = "firewall-ips"
	mapNoEndpointServices = "no-endpoint-services"
	mapNoEndpointNodePort = "no-endpoint-nodeports"
)

// baseChain is one of kube-proxy's 8 base chains and the jumps in it.
type baseChain struct {
	name, typ, hook string
	priority        int
	jumps           []string // rules, in order
}

// Priorities as kube-proxy writes them (knftables turns the names into numbers).
const (
	priorityFilter = 0
	priorityDstNAT = -100
	prioritySrcNAT = 100
)

var baseChains = []baseChain{
	{"filter-prerouting-pre-dnat", "filter", "prerouting", priorityDstNAT - 10, []string{"ct state new jump " + chainFirewallCheck}},
	{"filter-output-pre-dnat", "filter", "output", priorityDstNAT - 10, []string{"ct state new jump " + chainFirewallCheck}},
	{"filter-input", "filter", "input", priorityFilter, []string{"ct state new jump " + chainNodePortsCheck, "ct state new jump " + chainEndpointsCheck}},
	{"filter-forward", "filter", "forward", priorityFilter, []string{"ct state new jump " + chainEndpointsCheck, "ct state new jump " + chainClusterIPsCheck}},
	{"filter-output", "filter", "output", priorityFilter, []string{"ct state new jump " + chainEndpointsCheck, "ct state new jump " + chainClusterIPsCheck}},
	{"nat-prerouting", "nat", "prerouting", priorityDstNAT, []string{"jump " + chainServices}},
	{"nat-output", "nat", "output", priorityDstNAT, []string{"jump " + chainServices}},
	{"nat-postrouting", "nat", "postrouting", prioritySrcNAT, []string{"jump " + chainMasquerading}},
}

// writeFixed writes what every full sync writes, in a fresh node's creation
// order: the fixed sets and maps, the base chains, the fixed chains.
func (w *writer) writeFixed() {
	w.writeFixedSets()
	for _, bc := range baseChains {
		c := w.chain(bc.name)
		c.Type, c.Hook, c.Priority = bc.typ, bc.hook, bc.priority
		for _, j := range bc.jumps {
			w.rule(bc.name, j)
		}
	}
	w.writeFixedChains()
}

func (w *writer) writeFixedSets() {
	tuple := w.addr + " . inet_proto . inet_service : verdict"
	port := "inet_proto . inet_service : verdict"
	w.set(&Set{Name: setClusterIPs, Type: w.addr, Comment: "Active ClusterIPs"})
	if w.nodePortIPs != nil {
		w.set(&Set{Name: setNodePortIPs, Type: w.addr, Comment: "IPs that accept NodePort traffic"})
		for _, ip := range w.nodePortIPs {
			w.element(setNodePortIPs, Element{Key: []string{ip.String()}})
		}
	}
	w.set(&Set{Name: mapNoEndpointServices, Map: true, Type: tuple, Comment: "vmap to drop or reject packets to services with no endpoints"})
	w.set(&Set{Name: mapNoEndpointNodePort, Map: true, Type: port, Comment: "vmap to drop or reject packets to service nodeports with no endpoints"})
	w.set(&Set{Name: mapFirewallIPs, Map: true, Type: tuple, Comment: "destinations that are subject to LoadBalancerSourceRanges"})
	w.set(&Set{Name: mapServiceIPs, Map: true, Type: tuple, Comment: "ClusterIP, ExternalIP and LoadBalancer IP traffic"})
	w.set(&Set{Name: mapServiceNodePorts, Map: true, Type: port, Comment: "NodePort traffic"})
}

func (w *writer) writeFixedChains() {
	tuple := w.ip + " daddr . meta l4proto . th dport"
	// NodePorts: on the nodeport-ips, or, when every address accepts them, on
	// every local address but loopback.
	nodePorts := w.ip + " daddr @" + setNodePortIPs
	nodePortsCheck := nodePorts
	if w.nodePortIPs == nil {
		noLocalhost := "ip daddr != 127.0.0.0/8"
		if w.cfg.Family == bus.IPv6 {
			noLocalhost = "ip6 daddr != ::1"
		}
		nodePorts, nodePortsCheck = "fib daddr type local "+noLocalhost, noLocalhost
	}
	w.rule(chainNodePortsCheck, nodePortsCheck+" meta l4proto . th dport vmap @"+mapNoEndpointNodePort)
	w.rule(chainEndpointsCheck, tuple+" vmap @"+mapNoEndpointServices)
	w.rule(chainFirewallCheck, tuple+" vmap @"+mapFirewallIPs)
	w.rule(chainServices, tuple+" vmap @"+mapServiceIPs)
	w.rule(chainServices, nodePorts+" meta l4proto . th dport vmap @"+mapServiceNodePorts)

	mark := w.cfg.mark()
	w.rule(chainMasquerading, "mark and "+mark+" == 0 return")
	w.rule(chainMasquerading, "mark set mark xor "+mark)
	w.rule(chainMasquerading, "masquerade fully-random")

	w.commented(chainClusterIPsCheck, w.ip+" daddr @"+setClusterIPs+" reject", "Reject traffic to invalid ports of ClusterIPs")
	if cidrs := bus.PrefixesOf(w.cfg.Family, w.cfg.ServiceCIDRs); len(cidrs) > 0 {
		list := make([]string, len(cidrs))
		for i, c := range cidrs {
			list[i] = c.Masked().String()
		}
		w.commented(chainClusterIPsCheck, w.ip+" daddr { "+strings.Join(list, ",")+" } drop", "Drop traffic to unallocated ClusterIPs")
	}

	w.rule(chainMarkMasq, "mark set mark or "+mark)
	w.chain(chainReject).Comment = "helper for @no-endpoint-services / @no-endpoint-nodeports"
	w.rule(chainReject, "reject")
}

// affinitySet is a ClientIP-affinity service port's set for one endpoint.
func (w *writer) affinitySet(name string, seconds int32) {
	w.set(&Set{Name: name, Type: w.addr, Flags: []string{"dynamic", "timeout"},
		Timeout: time.Duration(seconds) * time.Second})
}
