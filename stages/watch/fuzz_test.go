package watch

import (
	"net/netip"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/bus"
)

// fuzzInput is what the fuzz targets build a Service and its EndpointSlices
// from. Lists (addresses, ports) are comma-separated; extraPorts and extraEps
// (times 4) add generated ports and endpoints, for sizes near the API's limits.
type fuzzInput struct {
	namespace, name, svcType, clusterIPs, externalIPs, lbIPs, sourceRanges string
	portName, protocol                                                     string
	port, nodePort, healthCheckNodePort, affinitySeconds                   int32
	policies                                                               uint8 // bit 0: externalTrafficPolicy Local, 1: internal Local, 2: ClientIP affinity, 3: ipMode Proxy
	extraPorts                                                             uint8
	sliceName, addressType, serviceLabel, addresses, trigger               string
	epPortName, epProtocol                                                 string
	epPort                                                                 int32
	conditions                                                             uint8 // bits 0-2: ready, serving, terminating; 3-5: each set at all
	nodeName, zone, hints                                                  string
	extraEps                                                               uint8
	duplicate                                                              bool // a second slice with the same endpoints
}

// fuzzObjects fuzzes a Service and its slices through check. The seed corpus
// (testdata/fuzz/<target>/) holds the absurd inputs of issue 10: 1,000 ports or
// endpoints, invalid, IPv4-mapped, link-local and multicast addresses, ports 0
// and 65536, names at the length limit and beyond, duplicate endpoints.
func fuzzObjects(f *testing.F, check func(t *testing.T, svc *corev1.Service, slices []*discoveryv1.EndpointSlice)) {
	f.Add("ns", "web", "ClusterIP", "10.96.0.10", "", "", "", "http", "TCP", int32(80), int32(0), int32(0), int32(0), uint8(0), uint8(0),
		"web-1", "IPv4", "web", "10.244.0.5,10.244.0.6", "", "http", "TCP", int32(8080), uint8(0), "node-a", "zone-a", "", uint8(0), false)
	f.Fuzz(func(t *testing.T, namespace, name, svcType, clusterIPs, externalIPs, lbIPs, sourceRanges, portName, protocol string,
		port, nodePort, healthCheckNodePort, affinitySeconds int32, policies, extraPorts uint8,
		sliceName, addressType, serviceLabel, addresses, trigger, epPortName, epProtocol string, epPort int32,
		conditions uint8, nodeName, zone, hints string, extraEps uint8, duplicate bool) {
		in := fuzzInput{namespace, name, svcType, clusterIPs, externalIPs, lbIPs, sourceRanges, portName, protocol,
			port, nodePort, healthCheckNodePort, affinitySeconds, policies, extraPorts,
			sliceName, addressType, serviceLabel, addresses, trigger, epPortName, epProtocol, epPort,
			conditions, nodeName, zone, hints, extraEps, duplicate}
		svc, slices := in.objects()
		check(t, svc, slices)
	})
}

func list(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

func (in fuzzInput) objects() (*corev1.Service, []*discoveryv1.EndpointSlice) {
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: in.namespace, Name: in.name},
		Spec: corev1.ServiceSpec{
			Type:                     corev1.ServiceType(in.svcType),
			ClusterIPs:               list(in.clusterIPs),
			ExternalIPs:              list(in.externalIPs),
			LoadBalancerSourceRanges: list(in.sourceRanges),
			HealthCheckNodePort:      in.healthCheckNodePort,
		},
	}
	if len(svc.Spec.ClusterIPs) > 0 {
		svc.Spec.ClusterIP = svc.Spec.ClusterIPs[0]
	}
	for _, ip := range list(in.lbIPs) {
		ing := corev1.LoadBalancerIngress{IP: ip}
		if in.policies&8 != 0 {
			ing.IPMode = ptr(corev1.LoadBalancerIPModeProxy)
		}
		svc.Status.LoadBalancer.Ingress = append(svc.Status.LoadBalancer.Ingress, ing)
	}
	if in.policies&1 != 0 {
		svc.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	}
	if in.policies&2 != 0 {
		svc.Spec.InternalTrafficPolicy = ptr(corev1.ServiceInternalTrafficPolicyLocal)
	}
	if in.policies&4 != 0 {
		svc.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
		svc.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr(in.affinitySeconds)}}
	}
	svc.Spec.Ports = []corev1.ServicePort{{Name: in.portName, Protocol: corev1.Protocol(in.protocol), Port: in.port, NodePort: in.nodePort}}
	for i := range int(in.extraPorts) * 4 {
		svc.Spec.Ports = append(svc.Spec.Ports, corev1.ServicePort{Name: "p" + strconv.Itoa(i), Protocol: corev1.Protocol(in.protocol), Port: in.port + 1 + int32(i)})
	}

	labels := map[string]string{}
	if in.serviceLabel != "" {
		labels[discoveryv1.LabelServiceName] = in.serviceLabel
	}
	sl := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: in.namespace, Name: in.sliceName, Labels: labels},
		AddressType: discoveryv1.AddressType(in.addressType),
	}
	if in.trigger != "" {
		sl.Annotations = map[string]string{corev1.EndpointsLastChangeTriggerTime: in.trigger}
	}
	epPort := discoveryv1.EndpointPort{Name: ptr(in.epPortName), Protocol: ptr(corev1.Protocol(in.epProtocol)), Port: ptr(in.epPort)}
	sl.Ports = []discoveryv1.EndpointPort{epPort}
	for i := range int(in.extraPorts) * 4 {
		sl.Ports = append(sl.Ports, discoveryv1.EndpointPort{Name: ptr("p" + strconv.Itoa(i)), Protocol: ptr(corev1.Protocol(in.protocol)), Port: ptr(in.epPort + 1 + int32(i))})
	}
	cond := func(bit uint8) *bool {
		if in.conditions&(bit<<3) == 0 {
			return nil
		}
		return ptr(in.conditions&bit != 0)
	}
	endpoint := func(addr string) discoveryv1.Endpoint {
		e := discoveryv1.Endpoint{Conditions: discoveryv1.EndpointConditions{Ready: cond(1), Serving: cond(2), Terminating: cond(4)}}
		if addr != "" {
			e.Addresses = []string{addr}
		}
		if in.nodeName != "" {
			e.NodeName = ptr(in.nodeName)
		}
		if in.zone != "" {
			e.Zone = ptr(in.zone)
		}
		if in.hints != "" {
			e.Hints = &discoveryv1.EndpointHints{}
			for _, h := range list(in.hints) {
				e.Hints.ForZones = append(e.Hints.ForZones, discoveryv1.ForZone{Name: h})
				e.Hints.ForNodes = append(e.Hints.ForNodes, discoveryv1.ForNode{Name: h})
			}
		}
		return e
	}
	addrs := list(in.addresses)
	for _, a := range addrs {
		sl.Endpoints = append(sl.Endpoints, endpoint(a))
	}
	// Generated endpoints follow the first address, whatever range it is in.
	if len(addrs) > 0 {
		if a, err := netip.ParseAddr(addrs[0]); err == nil {
			for range int(in.extraEps) * 4 {
				if a = a.Next(); !a.IsValid() {
					break
				}
				sl.Endpoints = append(sl.Endpoints, endpoint(a.String()))
			}
		}
	}
	slices := []*discoveryv1.EndpointSlice{sl}
	if in.duplicate {
		dup := sl.DeepCopy()
		dup.Name += "-dup"
		slices = append(slices, dup)
	}
	return svc, slices
}

// FuzzConvert converts fuzzed Services and EndpointSlices and checks that what
// reaches the model is valid as bus documents it, and that every part left out
// was reported as a skip.
func FuzzConvert(f *testing.F) {
	fuzzObjects(f, func(t *testing.T, svc *corev1.Service, slices []*discoveryv1.EndpointSlice) {
		conv := Converter{NodeName: "node-a"}
		out, skips := conv.Service(svc)
		checkService(t, svc, out, skips)
		for _, sl := range slices {
			out, skips := conv.Slice(sl)
			checkSlice(t, sl, out, skips)
		}
	})
}

func count(skips []skip, reasons ...string) int {
	n := 0
	for _, s := range skips {
		for _, r := range reasons {
			if s.reason == r {
				n++
			}
		}
	}
	return n
}

func checkSkips(t *testing.T, kind string, skips []skip) {
	t.Helper()
	for _, s := range skips {
		if s.kind != kind || s.reason == "" {
			t.Errorf("skip %+v: want kind %s and a reason", s, kind)
		}
	}
}

// checkKey: render writes the names into rule comments.
func checkKey(t *testing.T, k bus.ServiceKey) {
	t.Helper()
	if !validName(k.Namespace) || !validName(k.Name) {
		t.Errorf("service %q kept: its names are not DNS labels", k)
	}
}

func checkService(t *testing.T, in *corev1.Service, out *bus.Service, skips []skip) {
	t.Helper()
	checkSkips(t, "Service", skips)
	if out == nil {
		return
	}
	checkKey(t, out.ServiceKey)
	if len(out.ClusterIPs) == 0 {
		t.Errorf("service kept without a cluster IP")
	}
	for _, list := range [][]netip.Addr{out.ClusterIPs, out.ExternalIPs, out.LoadBalancerIPs} {
		for _, a := range list {
			if !a.IsValid() || a.Is4In6() || a.Zone() != "" {
				t.Errorf("service address %v kept: not a plain IPv4 or IPv6 address", a)
			}
		}
	}
	for _, p := range out.LoadBalancerSourceRanges {
		if !p.IsValid() || p != p.Masked() {
			t.Errorf("source range %v kept: invalid or not masked", p)
		}
	}
	if out.HealthCheckNodePort < 0 || out.HealthCheckNodePort > 65535 {
		t.Errorf("healthCheckNodePort %d kept", out.HealthCheckNodePort)
	}
	if out.AffinitySeconds < 0 || out.AffinitySeconds > maxAffinitySeconds {
		t.Errorf("affinity timeout %d kept", out.AffinitySeconds)
	}
	for _, p := range out.Ports {
		if !validPortName(p.Name) || !validProtocol(p.Protocol) || p.Port < 1 || p.Port > 65535 || p.NodePort < 0 || p.NodePort > 65535 {
			t.Errorf("port %+v kept", p)
		}
	}
	if got, want := len(out.Ports)+count(skips, "invalid-protocol", "invalid-port", "invalid-node-port", "invalid-port-name"), len(in.Spec.Ports); got != want {
		t.Errorf("%d ports kept and skipped; the service has %d", got, want)
	}
}

func checkSlice(t *testing.T, in *discoveryv1.EndpointSlice, out *bus.EndpointSlice, skips []skip) {
	t.Helper()
	checkSkips(t, "EndpointSlice", skips)
	if out == nil {
		return
	}
	for _, p := range out.Ports {
		if !validPortName(p.Name) || !validProtocol(p.Protocol) || p.Port < 1 || p.Port > 65535 {
			t.Errorf("slice port %+v kept", p)
		}
	}
	if got, want := len(out.Ports)+count(skips, "invalid-port", "invalid-port-name"), len(in.Ports); got != want {
		t.Errorf("%d slice ports kept and skipped; the slice has %d", got, want)
	}
	checkKey(t, out.Service)
	for _, e := range out.Items {
		a := e.Addr
		if !a.IsValid() || a.Is4In6() || a.Zone() != "" || bus.FamilyOf(a) != out.Family {
			t.Errorf("endpoint %v kept in a %v slice", a, out.Family)
		}
		if !usableEndpoint(a) {
			t.Errorf("endpoint %v kept: not an address a service can send to", a)
		}
	}
	endpointSkips := count(skips, "no-address", "invalid-address", "wrong-family", "special-address")
	if got, want := len(out.Items)+endpointSkips, len(in.Endpoints); got != want {
		t.Errorf("%d endpoints kept and skipped; the slice has %d", got, want)
	}
}

func validProtocol(p bus.Protocol) bool { return p == bus.TCP || p == bus.UDP || p == bus.SCTP }
