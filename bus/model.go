// Package bus holds what crosses between kpipe's stages: the service and endpoint
// model that watch produces, the snapshot coalesce hands to render, the plan render
// hands to commit, commit's result, and the channel primitives that carry them.
// Every value here is immutable once sent.
package bus

import (
	"cmp"
	"net/netip"
	"strings"
	"time"
)

// Protocol is a Service port protocol as the API spells it.
type Protocol string

const (
	TCP  Protocol = "TCP"
	UDP  Protocol = "UDP"
	SCTP Protocol = "SCTP"
)

// Family is an IP family. Each family has its own render → commit → conntrack chain.
type Family int

const (
	IPv4 Family = 4
	IPv6 Family = 6
)

func (f Family) String() string {
	if f == IPv6 {
		return "IPv6"
	}
	return "IPv4"
}

// Lower is the family's name in stage names and labels: "ipv4", "ipv6".
func (f Family) Lower() string {
	if f == IPv6 {
		return "ipv6"
	}
	return "ipv4"
}

// FamilyOf says which family an address belongs to.
func FamilyOf(a netip.Addr) Family {
	if a.Is4() || a.Is4In6() {
		return IPv4
	}
	return IPv6
}

// AddrsOf returns the addresses of addrs of family f, in their order (nil: none).
func AddrsOf(f Family, addrs []netip.Addr) []netip.Addr {
	return ofFamily(f, addrs, func(a netip.Addr) netip.Addr { return a })
}

// PrefixesOf returns the prefixes of ps of family f, in their order (nil: none).
func PrefixesOf(f Family, ps []netip.Prefix) []netip.Prefix {
	return ofFamily(f, ps, netip.Prefix.Addr)
}

// ofFamily keeps the xs whose address is of family f: the one family filter
// of addresses and prefixes.
func ofFamily[T any](f Family, xs []T, addr func(T) netip.Addr) []T {
	var out []T
	for _, x := range xs {
		if FamilyOf(addr(x)) == f {
			out = append(out, x)
		}
	}
	return out
}

// ServiceKey names a Service.
type ServiceKey struct{ Namespace, Name string }

func (k ServiceKey) String() string { return k.Namespace + "/" + k.Name }

// Compare orders keys by namespace, then name: the order renderers write
// services in.
func (k ServiceKey) Compare(o ServiceKey) int {
	return cmp.Or(strings.Compare(k.Namespace, o.Namespace), strings.Compare(k.Name, o.Name))
}

// ServicePortName names one port of a Service, as kube-proxy's ServicePortName does.
type ServicePortName struct {
	ServiceKey
	Port     string // the port's name, "" for an unnamed single port
	Protocol Protocol
}

// String is "namespace/name:port", or "namespace/name" for an unnamed port, as
// kube-proxy writes it in rule comments and hashes it into chain names.
func (p ServicePortName) String() string {
	if p.Port == "" {
		return p.Namespace + "/" + p.Name
	}
	return p.Namespace + "/" + p.Name + ":" + p.Port
}

// Service is the part of a v1.Service that a node proxy acts on, already validated:
// every address parses and every port is in range.
type Service struct {
	ServiceKey
	ClusterIPs               []netip.Addr
	ExternalIPs              []netip.Addr
	LoadBalancerIPs          []netip.Addr // status.loadBalancer.ingress[].ip, except ipMode: Proxy
	LoadBalancerSourceRanges []netip.Prefix
	ExternalPolicyLocal      bool  // externalTrafficPolicy: Local (only for NodePort/LoadBalancer)
	InternalPolicyLocal      bool  // internalTrafficPolicy: Local
	HealthCheckNodePort      int32 // 0: none
	AffinitySeconds          int32 // sessionAffinity: ClientIP timeout; 0: no affinity
	Ports                    []Port
}

// Port is one port of a Service.
type Port struct {
	Name     string
	Protocol Protocol
	Port     int32
	NodePort int32 // 0: none
}

// ClusterIPOf is the Service's first ClusterIP of family f. A Service without
// one is no Service of that family: its pipeline renders nothing for it, and a
// change to it is none of that family's (kube-proxy's per-family proxiers skip
// it likewise). A nil Service has none.
func (s *Service) ClusterIPOf(f Family) (netip.Addr, bool) {
	if s == nil {
		return netip.Addr{}, false
	}
	for _, ip := range s.ClusterIPs {
		if FamilyOf(ip) == f {
			return ip, true
		}
	}
	return netip.Addr{}, false
}

// PortName is the ServicePortName of one of this Service's ports.
func (s *Service) PortName(p Port) ServicePortName {
	return ServicePortName{ServiceKey: s.ServiceKey, Port: p.Name, Protocol: p.Protocol}
}

// EndpointSlice is a validated discovery/v1 EndpointSlice: addresses of the wrong
// type or that do not parse were dropped (and counted) by watch.
type EndpointSlice struct {
	Service ServiceKey
	Name    string
	Family  Family
	Ports   []EndpointPort
	Items   []Endpoint
	// TriggerTime is the endpoints.kubernetes.io/last-change-trigger-time annotation:
	// when the change that made this slice happened (zero when absent).
	TriggerTime time.Time
}

// EndpointPort is one port of an EndpointSlice.
type EndpointPort struct {
	Name     string
	Protocol Protocol
	Port     int32
}

// Endpoint is one endpoint address with its conditions. It is kept small (72
// bytes): a cluster of 10,000 services holds 100,000 of them.
type Endpoint struct {
	Addr        netip.Addr
	NodeName    string
	Zone        string
	Hints       *Hints // nil when the endpoint has no hints
	Ready       bool
	Serving     bool
	Terminating bool
}

// Hints are an endpoint's topology hints.
type Hints struct {
	Zones []string // hints.forZones; nil when none
	Nodes []string // hints.forNodes; nil when none
}

// HintZones are the endpoint's zone hints, nil when it has none.
func (e *Endpoint) HintZones() []string {
	if e.Hints == nil {
		return nil
	}
	return e.Hints.Zones
}

// HintNodes are the endpoint's node hints, nil when it has none.
func (e *Endpoint) HintNodes() []string {
	if e.Hints == nil {
		return nil
	}
	return e.Hints.Nodes
}

// Node is the part of this node's Node object that kpipe uses.
type Node struct {
	Name     string
	Addrs    []netip.Addr   // InternalIP first, then ExternalIP
	PodCIDRs []netip.Prefix // spec.podCIDRs
	Zone     string         // topology.kubernetes.io/zone
	Deleting bool           // deletionTimestamp set: /healthz answers 503
}
