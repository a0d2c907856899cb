package e2e

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

func TestZZScratch(t *testing.T) {
	e := setup(t)
	svc := e.service("bad", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	for i, addr := range []string{"fd00:10:244::12", "::ffff:10.244.0.12", "10.244.0.012", "garbage", "10.244.0.12 "} {
		eps := tb.ReadyEndpoints(1)
		eps = append(eps, testbed.Endpoint{IP: addr, Ready: true, Serving: true})
		sl := testbed.EndpointSlice(svc, "bad-"+string(rune('a'+i)), eps)
		sl.AddressType = "IPv4"
		_, err := tb.Client().DiscoveryV1().EndpointSlices(e.ns).Create(e.ctx, sl, metav1.CreateOptions{})
		t.Logf("%q: %v", addr, err)
	}
	// LB ipMode
	lb := testbed.Service(e.ns, "lb", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	lb.Spec.Type = corev1.ServiceTypeLoadBalancer
	lb.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	s, err := tb.CreateService(e.ctx, lb)
	t.Logf("lb: %v hc=%d np=%v", err, s.Spec.HealthCheckNodePort, s.Spec.Ports)
	s, err = tb.SetLoadBalancerIngress(e.ctx, e.ns, "lb", testbed.LBIngressIP("203.0.113.20", ""), testbed.LBIngressIP("203.0.113.21", corev1.LoadBalancerIPModeProxy))
	t.Logf("status: %v %+v", err, s.Status)
	pc := testbed.Service(e.ns, "pc", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	pc.Spec.TrafficDistribution = new(string)
	*pc.Spec.TrafficDistribution = "PreferClose"
	s, err = tb.CreateService(e.ctx, pc)
	t.Logf("pc: %v %v", err, s.Spec.TrafficDistribution)
	out, _ := tb.Exec(tb.NodeNS, "sysctl", "net.netfilter.nf_conntrack_tcp_be_liberal")
	t.Logf("sysctl: %s", out)
}
