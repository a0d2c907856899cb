package watch

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/bus"
)

func ptr[T any](v T) *T { return &v }

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func prefixes(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

func reasons(skips []skip) []string {
	var out []string
	for _, s := range skips {
		out = append(out, s.kind+"/"+s.reason)
	}
	return out
}

func clusterIPService(name string, mutate func(*corev1.Service)) *corev1.Service {
	s := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
		Spec: corev1.ServiceSpec{
			Type:       corev1.ServiceTypeClusterIP,
			ClusterIP:  "10.96.0.10",
			ClusterIPs: []string{"10.96.0.10"},
			Ports:      []corev1.ServicePort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80}},
		},
	}
	if mutate != nil {
		mutate(s)
	}
	return s
}

func TestConvertServiceIgnored(t *testing.T) {
	tests := map[string]*corev1.Service{
		"ExternalName": clusterIPService("ext", func(s *corev1.Service) {
			s.Spec.Type, s.Spec.ClusterIP, s.Spec.ClusterIPs, s.Spec.ExternalName = corev1.ServiceTypeExternalName, "", nil, "example.com"
		}),
		"headless": clusterIPService("headless", func(s *corev1.Service) {
			s.Spec.ClusterIP, s.Spec.ClusterIPs = corev1.ClusterIPNone, []string{corev1.ClusterIPNone}
		}),
		"no cluster IP": clusterIPService("none", func(s *corev1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "", nil }),
	}
	for name, in := range tests {
		t.Run(name, func(t *testing.T) {
			out, skips := Converter{}.Service(in)
			if out != nil {
				t.Errorf("Service = %+v; want nil (ignored)", out)
			}
			if len(skips) != 0 {
				t.Errorf("skips = %v; an ignored service is not invalid", reasons(skips))
			}
		})
	}
}

func TestConvertServiceValid(t *testing.T) {
	in := clusterIPService("web", func(s *corev1.Service) {
		s.Spec.ClusterIPs = []string{"10.96.0.10", "fd00::10"}
		s.Spec.Ports = []corev1.ServicePort{
			{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80},
			{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53},
			{Name: "sctp", Protocol: corev1.ProtocolSCTP, Port: 9999},
			{Name: "default", Port: 8080}, // protocol defaults to TCP
		}
		s.Spec.InternalTrafficPolicy = ptr(corev1.ServiceInternalTrafficPolicyLocal)
	})
	out, skips := Converter{}.Service(in)
	if len(skips) != 0 {
		t.Fatalf("skips = %v; want none", reasons(skips))
	}
	if out.ServiceKey != (bus.ServiceKey{Namespace: "ns", Name: "web"}) {
		t.Errorf("key = %v", out.ServiceKey)
	}
	if !slices.Equal(out.ClusterIPs, addrs("10.96.0.10", "fd00::10")) {
		t.Errorf("ClusterIPs = %v", out.ClusterIPs)
	}
	want := []bus.Port{
		{Name: "http", Protocol: bus.TCP, Port: 80},
		{Name: "dns", Protocol: bus.UDP, Port: 53},
		{Name: "sctp", Protocol: bus.SCTP, Port: 9999},
		{Name: "default", Protocol: bus.TCP, Port: 8080},
	}
	if !slices.Equal(out.Ports, want) {
		t.Errorf("Ports = %+v; want %+v", out.Ports, want)
	}
	if !out.InternalPolicyLocal {
		t.Error("internalTrafficPolicy Local lost")
	}
	if out.ExternalPolicyLocal || out.HealthCheckNodePort != 0 || out.AffinitySeconds != 0 {
		t.Errorf("unexpected settings: %+v", out)
	}
}

func TestConvertServiceDropsInvalidParts(t *testing.T) {
	tests := []struct {
		name   string
		in     *corev1.Service
		reason string
		check  func(t *testing.T, s *bus.Service)
	}{
		{
			name: "cluster IP",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.ClusterIPs = []string{"10.96.0.10", "not-an-ip"}
			}),
			reason: "Service/invalid-cluster-ip",
			check: func(t *testing.T, s *bus.Service) {
				if !slices.Equal(s.ClusterIPs, addrs("10.96.0.10")) {
					t.Errorf("ClusterIPs = %v; want the valid one", s.ClusterIPs)
				}
			},
		},
		{
			name: "external IP",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.ExternalIPs = []string{"203.0.113.7", "300.1.1.1"}
			}),
			reason: "Service/invalid-external-ip",
			check: func(t *testing.T, s *bus.Service) {
				if !slices.Equal(s.ExternalIPs, addrs("203.0.113.7")) {
					t.Errorf("ExternalIPs = %v; want the valid one", s.ExternalIPs)
				}
			},
		},
		{
			name: "load balancer IP",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.Type = corev1.ServiceTypeLoadBalancer
				s.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: "198.51.100.1"}, {IP: "bogus"}}
			}),
			reason: "Service/invalid-loadbalancer-ip",
			check: func(t *testing.T, s *bus.Service) {
				if !slices.Equal(s.LoadBalancerIPs, addrs("198.51.100.1")) {
					t.Errorf("LoadBalancerIPs = %v; want the valid one", s.LoadBalancerIPs)
				}
			},
		},
		{
			name: "source range",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.Type = corev1.ServiceTypeLoadBalancer
				s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/24", "10.0.0.0/33"}
			}),
			reason: "Service/invalid-source-range",
			check: func(t *testing.T, s *bus.Service) {
				if !slices.Equal(s.LoadBalancerSourceRanges, prefixes("192.0.2.0/24")) {
					t.Errorf("LoadBalancerSourceRanges = %v; want the valid one", s.LoadBalancerSourceRanges)
				}
			},
		},
		{
			name: "port number",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, corev1.ServicePort{Name: "big", Protocol: corev1.ProtocolTCP, Port: 70000})
			}),
			reason: "Service/invalid-port",
		},
		{
			name: "zero port",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, corev1.ServicePort{Name: "zero", Protocol: corev1.ProtocolTCP, Port: 0})
			}),
			reason: "Service/invalid-port",
		},
		{
			name: "node port",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.Type = corev1.ServiceTypeNodePort
				s.Spec.Ports = append(s.Spec.Ports, corev1.ServicePort{Name: "np", Protocol: corev1.ProtocolTCP, Port: 81, NodePort: 99999})
			}),
			reason: "Service/invalid-node-port",
		},
		{
			name: "protocol",
			in: clusterIPService("a", func(s *corev1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, corev1.ServicePort{Name: "icmp", Protocol: "ICMP", Port: 7})
			}),
			reason: "Service/invalid-protocol",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, skips := Converter{}.Service(tt.in)
			if got := reasons(skips); !slices.Equal(got, []string{tt.reason}) {
				t.Errorf("skips = %v; want [%s]", got, tt.reason)
			}
			for _, s := range skips {
				if s.detail == "" {
					t.Errorf("skip %s has no detail naming the bad value", s.reason)
				}
			}
			if out == nil {
				t.Fatal("the whole service was dropped; want the valid parts kept")
			}
			// The valid port always survives.
			if !slices.Contains(out.Ports, bus.Port{Name: "http", Protocol: bus.TCP, Port: 80}) {
				t.Errorf("Ports = %+v; want the valid http port kept", out.Ports)
			}
			for _, p := range out.Ports {
				if p.Port < 1 || p.Port > 65535 || p.NodePort < 0 || p.NodePort > 65535 {
					t.Errorf("an invalid port got through: %+v", p)
				}
			}
			if len(out.ClusterIPs) == 0 {
				t.Error("cluster IP lost")
			}
			if tt.check != nil {
				tt.check(t, out)
			}
		})
	}
}

func TestConvertServiceNoValidClusterIP(t *testing.T) {
	out, skips := Converter{}.Service(clusterIPService("a", func(s *corev1.Service) {
		s.Spec.ClusterIP, s.Spec.ClusterIPs = "garbage", []string{"garbage"}
	}))
	if out != nil {
		t.Errorf("Service = %+v; want nil without a valid cluster IP", out)
	}
	if got := reasons(skips); !slices.Equal(got, []string{"Service/invalid-cluster-ip"}) {
		t.Errorf("skips = %v", got)
	}
}

func TestConvertServiceLoadBalancerIngress(t *testing.T) {
	in := clusterIPService("lb", func(s *corev1.Service) {
		s.Spec.Type = corev1.ServiceTypeLoadBalancer
		s.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{
			{IP: "198.51.100.1"},
			{IP: "198.51.100.2", IPMode: ptr(corev1.LoadBalancerIPModeProxy)},
			{IP: "198.51.100.3", IPMode: ptr(corev1.LoadBalancerIPModeVIP)},
			{Hostname: "lb.example.com"},
		}
	})
	out, skips := Converter{}.Service(in)
	if len(skips) != 0 {
		t.Errorf("skips = %v; a hostname or a Proxy ingress is not invalid", reasons(skips))
	}
	if !slices.Equal(out.LoadBalancerIPs, addrs("198.51.100.1", "198.51.100.3")) {
		t.Errorf("LoadBalancerIPs = %v; want .1 and .3 (the Proxy-mode .2 needs no VIP here)", out.LoadBalancerIPs)
	}

	// A status left over on a service that is no longer a LoadBalancer is ignored.
	in.Spec.Type = corev1.ServiceTypeClusterIP
	out, _ = Converter{}.Service(in)
	if len(out.LoadBalancerIPs) != 0 {
		t.Errorf("ClusterIP service got LoadBalancerIPs %v", out.LoadBalancerIPs)
	}
}

func TestConvertServiceSourceRanges(t *testing.T) {
	// kube-proxy reads only spec.loadBalancerSourceRanges (pkg/proxy/serviceport.go,
	// newBaseServiceInfo); the beta annotation is for cloud providers' load balancers.
	const annotation = "service.beta.kubernetes.io/load-balancer-source-ranges"
	t.Run("spec ranges, masked and trimmed", func(t *testing.T) {
		out, skips := Converter{}.Service(clusterIPService("lb", func(s *corev1.Service) {
			s.Spec.Type = corev1.ServiceTypeLoadBalancer
			s.Spec.LoadBalancerSourceRanges = []string{"10.1.2.3/8", " 192.0.2.0/24", "fd00::/64 "}
			s.Annotations = map[string]string{annotation: "198.51.100.0/24"}
		}))
		if len(skips) != 0 {
			t.Errorf("skips = %v", reasons(skips))
		}
		if want := prefixes("10.0.0.0/8", "192.0.2.0/24", "fd00::/64"); !slices.Equal(out.LoadBalancerSourceRanges, want) {
			t.Errorf("ranges = %v; want the spec's %v", out.LoadBalancerSourceRanges, want)
		}
	})
	t.Run("annotation alone is ignored", func(t *testing.T) {
		out, skips := Converter{}.Service(clusterIPService("lb", func(s *corev1.Service) {
			s.Spec.Type = corev1.ServiceTypeLoadBalancer
			s.Annotations = map[string]string{annotation: "10.1.2.3/8, 192.0.2.0/24,fd00::/64"}
		}))
		if len(skips) != 0 {
			t.Errorf("skips = %v", reasons(skips))
		}
		if len(out.LoadBalancerSourceRanges) != 0 {
			t.Errorf("ranges = %v; want none: kube-proxy does not read the annotation, so the LB is open to every source", out.LoadBalancerSourceRanges)
		}
	})
	t.Run("not a load balancer", func(t *testing.T) {
		out, _ := Converter{}.Service(clusterIPService("np", func(s *corev1.Service) {
			s.Spec.Type = corev1.ServiceTypeNodePort
			s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/24"}
		}))
		if len(out.LoadBalancerSourceRanges) != 0 {
			t.Errorf("NodePort service got source ranges %v", out.LoadBalancerSourceRanges)
		}
	})
}

func TestConvertServiceAffinity(t *testing.T) {
	tests := []struct {
		name string
		spec func(*corev1.Service)
		want int32
	}{
		{"none", func(s *corev1.Service) { s.Spec.SessionAffinity = corev1.ServiceAffinityNone }, 0},
		{"ClientIP default timeout", func(s *corev1.Service) { s.Spec.SessionAffinity = corev1.ServiceAffinityClientIP }, 10800},
		{"ClientIP config without timeout", func(s *corev1.Service) {
			s.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
			s.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{}}
		}, 10800},
		{"ClientIP explicit timeout", func(s *corev1.Service) {
			s.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
			s.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr(int32(60))}}
		}, 60},
		{"timeout without ClientIP affinity", func(s *corev1.Service) {
			s.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr(int32(60))}}
		}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, _ := Converter{}.Service(clusterIPService("a", tt.spec))
			if out.AffinitySeconds != tt.want {
				t.Errorf("AffinitySeconds = %d; want %d", out.AffinitySeconds, tt.want)
			}
		})
	}
}

func TestConvertServiceTrafficPolicy(t *testing.T) {
	local := corev1.ServiceExternalTrafficPolicyLocal
	tests := []struct {
		name        string
		spec        func(*corev1.Service)
		wantLocal   bool
		wantHCNodes int32
	}{
		{"ClusterIP with Local is not external", func(s *corev1.Service) {
			s.Spec.ExternalTrafficPolicy = local
		}, false, 0},
		{"ClusterIP with externalIPs and Local", func(s *corev1.Service) {
			s.Spec.ExternalTrafficPolicy = local
			s.Spec.ExternalIPs = []string{"203.0.113.7"}
		}, true, 0},
		{"NodePort Local has no health check port", func(s *corev1.Service) {
			s.Spec.Type = corev1.ServiceTypeNodePort
			s.Spec.ExternalTrafficPolicy = local
			s.Spec.HealthCheckNodePort = 32000
			s.Spec.Ports[0].NodePort = 30080
		}, true, 0},
		{"LoadBalancer Local has the health check port", func(s *corev1.Service) {
			s.Spec.Type = corev1.ServiceTypeLoadBalancer
			s.Spec.ExternalTrafficPolicy = local
			s.Spec.HealthCheckNodePort = 32000
			s.Spec.Ports[0].NodePort = 30080
		}, true, 32000},
		{"LoadBalancer Cluster", func(s *corev1.Service) {
			s.Spec.Type = corev1.ServiceTypeLoadBalancer
			s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyCluster
			s.Spec.HealthCheckNodePort = 32000
		}, false, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, _ := Converter{}.Service(clusterIPService("a", tt.spec))
			if out.ExternalPolicyLocal != tt.wantLocal {
				t.Errorf("ExternalPolicyLocal = %v; want %v", out.ExternalPolicyLocal, tt.wantLocal)
			}
			if out.HealthCheckNodePort != tt.wantHCNodes {
				t.Errorf("HealthCheckNodePort = %d; want %d", out.HealthCheckNodePort, tt.wantHCNodes)
			}
		})
	}
}

func endpointSlice(name string, family discoveryv1.AddressType, mutate func(*discoveryv1.EndpointSlice)) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		AddressType: family,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Protocol: ptr(corev1.ProtocolTCP), Port: ptr(int32(8080))}},
	}
	if mutate != nil {
		mutate(s)
	}
	return s
}

func TestConvertSliceIgnoresFQDN(t *testing.T) {
	out, skips := Converter{}.Slice(endpointSlice("web-fqdn", discoveryv1.AddressTypeFQDN, func(s *discoveryv1.EndpointSlice) {
		s.Endpoints = []discoveryv1.Endpoint{{Addresses: []string{"example.com"}}}
	}))
	if out != nil || len(skips) != 0 {
		t.Errorf("FQDN slice = %+v, skips %v; want ignored silently", out, reasons(skips))
	}
}

func TestConvertSliceWithoutServiceName(t *testing.T) {
	out, skips := Converter{}.Slice(endpointSlice("orphan", discoveryv1.AddressTypeIPv4, func(s *discoveryv1.EndpointSlice) {
		s.Labels = nil
		s.Endpoints = []discoveryv1.Endpoint{{Addresses: []string{"10.244.0.5"}}}
	}))
	if out != nil {
		t.Errorf("slice without a service-name label = %+v; want nil", out)
	}
	if got := reasons(skips); !slices.Equal(got, []string{"EndpointSlice/no-service-name"}) {
		t.Errorf("skips = %v", got)
	}
}

func TestConvertSliceDropsBadAddresses(t *testing.T) {
	tests := []struct {
		family discoveryv1.AddressType
		good   string
		bad    []string
		want   []string
	}{
		{discoveryv1.AddressTypeIPv4, "10.244.0.5", []string{"garbage", "fd00::5"}, []string{"EndpointSlice/invalid-address", "EndpointSlice/wrong-family"}},
		{discoveryv1.AddressTypeIPv6, "fd00::5", []string{"::zz", "10.244.0.5"}, []string{"EndpointSlice/invalid-address", "EndpointSlice/wrong-family"}},
	}
	for _, tt := range tests {
		t.Run(string(tt.family), func(t *testing.T) {
			out, skips := Converter{}.Slice(endpointSlice("web-1", tt.family, func(s *discoveryv1.EndpointSlice) {
				for _, a := range tt.bad {
					s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}})
				}
				s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{tt.good}}, discoveryv1.Endpoint{})
			}))
			want := append(tt.want, "EndpointSlice/no-address")
			if got := reasons(skips); !slices.Equal(got, want) {
				t.Errorf("skips = %v; want %v", got, want)
			}
			if out == nil || len(out.Items) != 1 || out.Items[0].Addr != netip.MustParseAddr(tt.good) {
				t.Fatalf("slice = %+v; want only %s kept", out, tt.good)
			}
			wantFamily := bus.IPv4
			if tt.family == discoveryv1.AddressTypeIPv6 {
				wantFamily = bus.IPv6
			}
			if out.Family != wantFamily {
				t.Errorf("Family = %v; want %v", out.Family, wantFamily)
			}
		})
	}
}

func TestConvertSliceBasics(t *testing.T) {
	out, skips := Converter{}.Slice(endpointSlice("web-1", discoveryv1.AddressTypeIPv4, func(s *discoveryv1.EndpointSlice) {
		s.Ports = []discoveryv1.EndpointPort{
			{Name: ptr("http"), Protocol: ptr(corev1.ProtocolTCP), Port: ptr(int32(8080))},
			{Port: ptr(int32(53)), Protocol: ptr(corev1.ProtocolUDP)}, // unnamed
			{Name: ptr("default-proto"), Port: ptr(int32(9000))},      // TCP by default
			{Name: ptr("no-number")},                        // dropped
			{Name: ptr("too-big"), Port: ptr(int32(65536))}, // dropped
		}
		s.Endpoints = []discoveryv1.Endpoint{{Addresses: []string{"10.244.0.5"}, NodeName: ptr("node-1"), Zone: ptr("zone-a")}}
	}))
	if got := reasons(skips); !slices.Equal(got, []string{"EndpointSlice/invalid-port", "EndpointSlice/invalid-port"}) {
		t.Errorf("skips = %v", got)
	}
	if out.Service != (bus.ServiceKey{Namespace: "ns", Name: "web"}) || out.Name != "web-1" {
		t.Errorf("slice names service %v, slice %q", out.Service, out.Name)
	}
	wantPorts := []bus.EndpointPort{{Name: "http", Protocol: bus.TCP, Port: 8080}, {Name: "", Protocol: bus.UDP, Port: 53},
		{Name: "default-proto", Protocol: bus.TCP, Port: 9000}}
	if !slices.Equal(out.Ports, wantPorts) {
		t.Errorf("Ports = %+v; want %+v", out.Ports, wantPorts)
	}
	if ep := out.Items[0]; ep.NodeName != "node-1" || ep.Zone != "zone-a" || ep.HintZones() != nil || ep.HintNodes() != nil {
		t.Errorf("endpoint = %+v", ep)
	}
}

func TestConvertSliceConditions(t *testing.T) {
	tests := []struct {
		name                        string
		cond                        discoveryv1.EndpointConditions
		ready, serving, terminating bool
	}{
		{"all unset", discoveryv1.EndpointConditions{}, true, true, false},
		// The API: "A nil value should be interpreted as true" (kube-proxy's
		// endpointslicecache reads it so): a terminating endpoint that does not say
		// whether it serves is a fallback like one that says it does.
		{"not ready, serving unset", discoveryv1.EndpointConditions{Ready: ptr(false)}, false, true, false},
		{"terminating, serving unset", discoveryv1.EndpointConditions{Ready: ptr(false), Terminating: ptr(true)}, false, true, true},
		{"ready, serving unset", discoveryv1.EndpointConditions{Ready: ptr(true)}, true, true, false},
		{"terminating but serving", discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}, false, true, true},
		{"terminating not serving", discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(false), Terminating: ptr(true)}, false, false, true},
		{"ready unset, serving false", discoveryv1.EndpointConditions{Serving: ptr(false)}, true, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, _ := Converter{}.Slice(endpointSlice("web-1", discoveryv1.AddressTypeIPv4, func(s *discoveryv1.EndpointSlice) {
				s.Endpoints = []discoveryv1.Endpoint{{Addresses: []string{"10.244.0.5"}, Conditions: tt.cond}}
			}))
			ep := out.Items[0]
			if ep.Ready != tt.ready || ep.Serving != tt.serving || ep.Terminating != tt.terminating {
				t.Errorf("ready/serving/terminating = %v/%v/%v; want %v/%v/%v",
					ep.Ready, ep.Serving, ep.Terminating, tt.ready, tt.serving, tt.terminating)
			}
		})
	}
}

func TestConvertSliceHints(t *testing.T) {
	out, _ := Converter{}.Slice(endpointSlice("web-1", discoveryv1.AddressTypeIPv4, func(s *discoveryv1.EndpointSlice) {
		s.Endpoints = []discoveryv1.Endpoint{
			{Addresses: []string{"10.244.0.5"}, Hints: &discoveryv1.EndpointHints{
				ForZones: []discoveryv1.ForZone{{Name: "zone-a"}, {Name: "zone-b"}},
				ForNodes: []discoveryv1.ForNode{{Name: "node-1"}},
			}},
			{Addresses: []string{"10.244.0.6"}, Hints: &discoveryv1.EndpointHints{ForZones: []discoveryv1.ForZone{{Name: "zone-c"}}}},
			{Addresses: []string{"10.244.0.7"}},
		}
	}))
	if got := out.Items[0]; !slices.Equal(got.HintZones(), []string{"zone-a", "zone-b"}) || !slices.Equal(got.HintNodes(), []string{"node-1"}) {
		t.Errorf("hints of first endpoint = zones %v nodes %v", got.HintZones(), got.HintNodes())
	}
	if got := out.Items[1]; !slices.Equal(got.HintZones(), []string{"zone-c"}) || got.HintNodes() != nil {
		t.Errorf("hints of second endpoint = zones %v nodes %v; want zone-c and no node hints", got.HintZones(), got.HintNodes())
	}
	if got := out.Items[2]; got.HintZones() != nil || got.HintNodes() != nil {
		t.Errorf("endpoint without hints has zones %v nodes %v; want nil", got.HintZones(), got.HintNodes())
	}
}

func TestConvertNode(t *testing.T) {
	now := metav1.Now()
	tests := []struct {
		name string
		in   *corev1.Node
		want bus.Node
	}{
		{
			name: "addresses, CIDRs and zone",
			in: &corev1.Node{
				ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{corev1.LabelTopologyZone: "zone-a"}},
				Spec:       corev1.NodeSpec{PodCIDR: "10.244.1.0/24", PodCIDRs: []string{"10.244.1.0/24", "fd00:1::/64"}},
				Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{
					{Type: corev1.NodeExternalIP, Address: "203.0.113.1"},
					{Type: corev1.NodeHostName, Address: "node-1"},
					{Type: corev1.NodeInternalIP, Address: "192.168.0.1"},
					{Type: corev1.NodeInternalIP, Address: "garbage"},
					{Type: corev1.NodeInternalIP, Address: "fd00::1"},
				}},
			},
			want: bus.Node{Name: "node-1", Zone: "zone-a", Addrs: addrs("192.168.0.1", "fd00::1", "203.0.113.1"),
				PodCIDRs: prefixes("10.244.1.0/24", "fd00:1::/64")},
		},
		{
			name: "only the old podCIDR field",
			in:   &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Spec: corev1.NodeSpec{PodCIDR: "10.244.1.7/24"}},
			want: bus.Node{Name: "node-1", PodCIDRs: prefixes("10.244.1.0/24")},
		},
		{
			name: "being deleted",
			in:   &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", DeletionTimestamp: &now}},
			want: bus.Node{Name: "node-1", Deleting: true},
		},
		{
			name: "cluster autoscaler taint",
			in: &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{
				{Key: "other", Effect: corev1.TaintEffectNoSchedule},
				{Key: "ToBeDeletedByClusterAutoscaler", Value: "1700000000", Effect: corev1.TaintEffectNoSchedule},
			}}},
			want: bus.Node{Name: "node-1", Deleting: true},
		},
		{
			name: "other taints do not mean deleting",
			in: &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{
				{Key: "node.kubernetes.io/unschedulable", Effect: corev1.TaintEffectNoSchedule},
			}}},
			want: bus.Node{Name: "node-1"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Converter{NodeName: "node-1"}.Node(tt.in)
			if got.Name != tt.want.Name || got.Zone != tt.want.Zone || got.Deleting != tt.want.Deleting ||
				!slices.Equal(got.Addrs, tt.want.Addrs) || !slices.Equal(got.PodCIDRs, tt.want.PodCIDRs) {
				t.Errorf("Node = %+v; want %+v", *got, tt.want)
			}
		})
	}
}

// TestConvertSliceTriggerTime: the last-change-trigger-time annotation is read
// (for the network programming latency metric); a malformed one is ignored.
func TestConvertSliceTriggerTime(t *testing.T) {
	withAnnotation := func(v string) *bus.EndpointSlice {
		out, _ := Converter{}.Slice(endpointSlice("web-1", discoveryv1.AddressTypeIPv4, func(s *discoveryv1.EndpointSlice) {
			s.Annotations = map[string]string{corev1.EndpointsLastChangeTriggerTime: v}
		}))
		return out
	}
	want := time.Date(2026, 11, 23, 1, 2, 3, 400000000, time.UTC)
	if got := withAnnotation("2026-11-23T01:02:03.4Z").TriggerTime; !got.Equal(want) {
		t.Errorf("TriggerTime = %v; want %v", got, want)
	}
	if got := withAnnotation("yesterday").TriggerTime; !got.IsZero() {
		t.Errorf("TriggerTime = %v for a malformed annotation; want zero", got)
	}
}
