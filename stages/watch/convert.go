package watch

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/kpipe/kpipe/bus"
)

// The API's default and largest sessionAffinityConfig timeout (3 hours, 1 day).
const (
	defaultAffinitySeconds = 10800
	maxAffinitySeconds     = 86400
)

// toBeDeletedTaint is the cluster autoscaler's taint on a node it is about to
// delete: /healthz then answers 503, as kube-proxy's does.
const toBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// parseIP reads one address as the rules will write it: IPv4-mapped IPv6
// addresses become IPv4, and an IPv6 zone ("fe80::1%eth0"), which no rule can
// hold, makes it invalid.
func parseIP(s string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(s)
	if err != nil || a.Zone() != "" {
		return netip.Addr{}, false
	}
	return a.Unmap(), true
}

// validName says whether a namespace or service name is what the API allows (a
// DNS label): render writes names into rule comments, and a quote or a newline
// that passed validation nowhere would break the whole iptables-restore input.
func validName(s string) bool { return len(validation.IsDNS1123Label(s)) == 0 }

// validPortName: a port name is a DNS label, or empty for a single port.
func validPortName(s string) bool { return s == "" || validName(s) }

// usableEndpoint says whether a service can send traffic to a: not the
// unspecified address, loopback, link-local or multicast (the Endpoints API
// refuses these, and a DNAT to them reaches the node itself or nothing; to
// 169.254.169.254 it would reach a cloud's metadata service).
func usableEndpoint(a netip.Addr) bool {
	return !a.IsUnspecified() && !a.IsLoopback() && !a.IsLinkLocalUnicast() && !a.IsMulticast() &&
		a != netip.AddrFrom4([4]byte{255, 255, 255, 255})
}

// skip records one invalid part of an object: what, and why.
type skip struct{ kind, reason, detail string }

// Converter turns API objects into bus values. Invalid parts are dropped and
// reported, so one bad field never stops the rest of the object or other objects.
type Converter struct {
	NodeName string
}

// Service converts a v1.Service. It returns nil for services a node proxy ignores
// (ExternalName, headless, no valid cluster IP) and a skip for every dropped part.
func (c Converter) Service(s *corev1.Service) (*bus.Service, []skip) {
	var skips []skip
	bad := func(reason, detail string) { skips = append(skips, skip{"Service", reason, detail}) }
	if s.Spec.Type == corev1.ServiceTypeExternalName || s.Spec.ClusterIP == corev1.ClusterIPNone || s.Spec.ClusterIP == "" {
		return nil, nil
	}
	if !validName(s.Namespace) || !validName(s.Name) {
		bad("invalid-name", fmt.Sprintf("name %q/%q", s.Namespace, s.Name))
		return nil, skips
	}
	out := &bus.Service{ServiceKey: bus.ServiceKey{Namespace: s.Namespace, Name: s.Name}}
	clusterIPs := s.Spec.ClusterIPs
	if len(clusterIPs) == 0 {
		clusterIPs = []string{s.Spec.ClusterIP}
	}
	for _, ip := range clusterIPs {
		if a, ok := parseIP(ip); ok {
			out.ClusterIPs = append(out.ClusterIPs, a)
		} else {
			bad("invalid-cluster-ip", fmt.Sprintf("clusterIP %q", ip))
		}
	}
	if len(out.ClusterIPs) == 0 {
		return nil, skips
	}
	for _, ip := range s.Spec.ExternalIPs {
		if a, ok := parseIP(ip); ok {
			out.ExternalIPs = append(out.ExternalIPs, a)
		} else {
			bad("invalid-external-ip", fmt.Sprintf("externalIP %q", ip))
		}
	}
	if s.Spec.Type == corev1.ServiceTypeLoadBalancer {
		for _, ing := range s.Status.LoadBalancer.Ingress {
			if ing.IP == "" || (ing.IPMode != nil && *ing.IPMode == corev1.LoadBalancerIPModeProxy) {
				continue // a hostname, or a proxying load balancer that needs no VIP here
			}
			if a, ok := parseIP(ing.IP); ok {
				out.LoadBalancerIPs = append(out.LoadBalancerIPs, a)
			} else {
				bad("invalid-loadbalancer-ip", fmt.Sprintf("ingress IP %q", ing.IP))
			}
		}
		// Only the spec field, as kube-proxy: the beta annotation
		// (service.beta.kubernetes.io/load-balancer-source-ranges) is for cloud
		// providers' load balancers, and kube-proxy does not read it.
		for _, r := range s.Spec.LoadBalancerSourceRanges {
			if p, err := netip.ParsePrefix(strings.TrimSpace(r)); err == nil {
				out.LoadBalancerSourceRanges = append(out.LoadBalancerSourceRanges, p.Masked())
			} else {
				bad("invalid-source-range", fmt.Sprintf("loadBalancerSourceRange %q", r))
			}
		}
	}
	externally := s.Spec.Type == corev1.ServiceTypeNodePort || s.Spec.Type == corev1.ServiceTypeLoadBalancer || len(s.Spec.ExternalIPs) > 0
	out.ExternalPolicyLocal = externally && s.Spec.ExternalTrafficPolicy == corev1.ServiceExternalTrafficPolicyLocal
	out.InternalPolicyLocal = s.Spec.InternalTrafficPolicy != nil && *s.Spec.InternalTrafficPolicy == corev1.ServiceInternalTrafficPolicyLocal
	if hc := s.Spec.HealthCheckNodePort; out.ExternalPolicyLocal && s.Spec.Type == corev1.ServiceTypeLoadBalancer {
		if hc >= 0 && hc <= 65535 {
			out.HealthCheckNodePort = hc
		} else {
			bad("invalid-health-check-node-port", fmt.Sprintf("healthCheckNodePort %d", hc))
		}
	}
	if s.Spec.SessionAffinity == corev1.ServiceAffinityClientIP {
		out.AffinitySeconds = defaultAffinitySeconds
		if cfg := s.Spec.SessionAffinityConfig; cfg != nil && cfg.ClientIP != nil && cfg.ClientIP.TimeoutSeconds != nil {
			if t := *cfg.ClientIP.TimeoutSeconds; t >= 1 && t <= maxAffinitySeconds {
				out.AffinitySeconds = t
			} else {
				bad("invalid-affinity-timeout", fmt.Sprintf("sessionAffinityConfig timeout %d, using the default", t))
			}
		}
	}
	for _, p := range s.Spec.Ports {
		proto, ok := protocol(p.Protocol)
		switch {
		case !ok:
			bad("invalid-protocol", fmt.Sprintf("port %q protocol %q", p.Name, p.Protocol))
			continue
		case !validPortName(p.Name):
			bad("invalid-port-name", fmt.Sprintf("port %q", p.Name))
			continue
		case p.Port < 1 || p.Port > 65535:
			bad("invalid-port", fmt.Sprintf("port %q number %d", p.Name, p.Port))
			continue
		case p.NodePort < 0 || p.NodePort > 65535:
			bad("invalid-node-port", fmt.Sprintf("port %q nodePort %d", p.Name, p.NodePort))
			continue
		}
		out.Ports = append(out.Ports, bus.Port{Name: p.Name, Protocol: proto, Port: p.Port, NodePort: p.NodePort})
	}
	return out, skips
}

func protocol(p corev1.Protocol) (bus.Protocol, bool) {
	switch p {
	case corev1.ProtocolTCP, "":
		return bus.TCP, true
	case corev1.ProtocolUDP:
		return bus.UDP, true
	case corev1.ProtocolSCTP:
		return bus.SCTP, true
	}
	return "", false
}

// Slice converts an EndpointSlice. It returns nil for slices kpipe ignores (FQDN,
// no service label) and a skip for every dropped part.
func (c Converter) Slice(s *discoveryv1.EndpointSlice) (*bus.EndpointSlice, []skip) {
	var skips []skip
	bad := func(reason, detail string) { skips = append(skips, skip{"EndpointSlice", reason, detail}) }
	var family bus.Family
	switch s.AddressType {
	case discoveryv1.AddressTypeIPv4:
		family = bus.IPv4
	case discoveryv1.AddressTypeIPv6:
		family = bus.IPv6
	default:
		return nil, nil
	}
	svcName := s.Labels[discoveryv1.LabelServiceName]
	if svcName == "" {
		bad("no-service-name", "label "+discoveryv1.LabelServiceName+" missing")
		return nil, skips
	}
	if !validName(s.Namespace) || !validName(svcName) {
		bad("invalid-name", fmt.Sprintf("service %q/%q", s.Namespace, svcName))
		return nil, skips
	}
	out := &bus.EndpointSlice{Service: bus.ServiceKey{Namespace: s.Namespace, Name: svcName}, Name: s.Name, Family: family}
	if v := s.Annotations[corev1.EndpointsLastChangeTriggerTime]; v != "" {
		if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
			out.TriggerTime = t
		}
	}
	for _, p := range s.Ports {
		proto := corev1.ProtocolTCP
		if p.Protocol != nil {
			proto = *p.Protocol
		}
		bp, ok := protocol(proto)
		if !ok || p.Port == nil || *p.Port < 1 || *p.Port > 65535 {
			bad("invalid-port", fmt.Sprintf("port %v", describePort(p)))
			continue
		}
		name := ""
		if p.Name != nil {
			name = *p.Name
		}
		if !validPortName(name) {
			bad("invalid-port-name", fmt.Sprintf("port %q", name))
			continue
		}
		out.Ports = append(out.Ports, bus.EndpointPort{Name: name, Protocol: bp, Port: *p.Port})
	}
	// Sized once: at 10,000 slices, growing by appends held a third more.
	out.Items = make([]bus.Endpoint, 0, len(s.Endpoints))
	for _, e := range s.Endpoints {
		if len(e.Addresses) == 0 {
			bad("no-address", "endpoint without addresses")
			continue
		}
		a, ok := parseIP(e.Addresses[0])
		switch {
		case !ok:
			bad("invalid-address", fmt.Sprintf("address %q", e.Addresses[0]))
			continue
		case bus.FamilyOf(a) != family:
			bad("wrong-family", fmt.Sprintf("address %s in a %s slice", a, s.AddressType))
			continue
		case !usableEndpoint(a):
			bad("special-address", fmt.Sprintf("address %s (unspecified, loopback, link-local or multicast)", a))
			continue
		}
		// Unset conditions mean what the API says they mean (and kube-proxy reads):
		// ready and serving true, terminating false.
		ep := bus.Endpoint{
			Addr:        a,
			Ready:       e.Conditions.Ready == nil || *e.Conditions.Ready,
			Serving:     e.Conditions.Serving == nil || *e.Conditions.Serving,
			Terminating: e.Conditions.Terminating != nil && *e.Conditions.Terminating,
		}
		if e.NodeName != nil {
			ep.NodeName = *e.NodeName
		}
		if e.Zone != nil {
			ep.Zone = *e.Zone
		}
		if e.Hints != nil && len(e.Hints.ForZones)+len(e.Hints.ForNodes) > 0 {
			ep.Hints = &bus.Hints{}
			for _, z := range e.Hints.ForZones {
				ep.Hints.Zones = append(ep.Hints.Zones, z.Name)
			}
			for _, n := range e.Hints.ForNodes {
				ep.Hints.Nodes = append(ep.Hints.Nodes, n.Name)
			}
		}
		out.Items = append(out.Items, ep)
	}
	return out, skips
}

func describePort(p discoveryv1.EndpointPort) string {
	var b strings.Builder
	if p.Name != nil {
		b.WriteString(*p.Name + " ")
	}
	if p.Port != nil {
		fmt.Fprintf(&b, "%d", *p.Port)
	} else {
		b.WriteString("<none>")
	}
	if p.Protocol != nil {
		b.WriteString("/" + string(*p.Protocol))
	}
	return b.String()
}

// Node converts this node's Node object.
func (c Converter) Node(n *corev1.Node) *bus.Node {
	out := &bus.Node{Name: n.Name, Zone: n.Labels[corev1.LabelTopologyZone], Deleting: n.DeletionTimestamp != nil}
	for _, t := range n.Spec.Taints {
		if t.Key == toBeDeletedTaint {
			out.Deleting = true
		}
	}
	for _, kind := range []corev1.NodeAddressType{corev1.NodeInternalIP, corev1.NodeExternalIP} {
		for _, a := range n.Status.Addresses {
			if a.Type != kind {
				continue
			}
			if ip, ok := parseIP(a.Address); ok {
				out.Addrs = append(out.Addrs, ip)
			}
		}
	}
	cidrs := n.Spec.PodCIDRs
	if len(cidrs) == 0 && n.Spec.PodCIDR != "" {
		cidrs = []string{n.Spec.PodCIDR}
	}
	for _, c := range cidrs {
		if p, err := netip.ParsePrefix(c); err == nil {
			out.PodCIDRs = append(out.PodCIDRs, p.Masked())
		}
	}
	return out
}
