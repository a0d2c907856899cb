package watch

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/randfill"
)

// pick is one of the values, or a random string one time in five, so that
// both the valid and the invalid paths of conversion are taken.
func pick(r *rand.Rand, f *randfill.Filler, values ...string) string {
	if r.IntN(5) == 0 {
		var s string
		f.Fill(&s)
		return s
	}
	return values[r.IntN(len(values))]
}

func ips(r *rand.Rand, f *randfill.Filler) []string {
	out := make([]string, r.IntN(3))
	for i := range out {
		out[i] = pick(r, f, "10.96.0.10", "fd00::10", "::ffff:10.0.0.1", "203.0.113.7")
	}
	return out
}

// TestSlimKeepsWhatConvertReads fills every field of Services, EndpointSlices
// and Nodes at random (with valid names, types and addresses often enough to
// reach every part of conversion) and checks that conversion of the slimmed
// object, which is what the informers keep, is exactly that of the original:
// a field conversion reads and slim drops fails here.
func TestSlimKeepsWhatConvertReads(t *testing.T) {
	conv := Converter{NodeName: "node-a"}
	for seed := range int64(3000) {
		r := rand.New(rand.NewPCG(uint64(seed), 1))
		f := randfill.NewWithSeed(seed).NilChance(0.2).NumElements(0, 3)

		var svc corev1.Service
		f.Fill(&svc)
		svc.Namespace, svc.Name = pick(r, f, "ns"), pick(r, f, "web")
		svc.Spec.Type = corev1.ServiceType(pick(r, f, "ClusterIP", "NodePort", "LoadBalancer", "ExternalName"))
		svc.Spec.ClusterIPs = ips(r, f)
		svc.Spec.ClusterIP = pick(r, f, "10.96.0.1", "None", "")
		svc.Spec.ExternalIPs = ips(r, f)
		svc.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicy(pick(r, f, "Local", "Cluster"))
		if svc.Spec.InternalTrafficPolicy != nil {
			svc.Spec.InternalTrafficPolicy = ptr(corev1.ServiceInternalTrafficPolicy(pick(r, f, "Local", "Cluster")))
		}
		svc.Spec.SessionAffinity = corev1.ServiceAffinity(pick(r, f, "ClientIP", "None"))
		for i := range svc.Spec.Ports {
			p := &svc.Spec.Ports[i]
			p.Name, p.Protocol = pick(r, f, "", "http"), corev1.Protocol(pick(r, f, "TCP", "UDP", "SCTP", ""))
			p.Port, p.NodePort = int32(r.IntN(70000)-10), int32(r.IntN(70000)-10)
		}
		for i := range svc.Status.LoadBalancer.Ingress {
			ing := &svc.Status.LoadBalancer.Ingress[i]
			ing.IP = pick(r, f, "198.51.100.1", "", "2001:db8::1")
			if r.IntN(2) == 0 {
				ing.IPMode = ptr(corev1.LoadBalancerIPMode(pick(r, f, "Proxy", "VIP")))
			}
		}
		same(t, fmt.Sprintf("seed %d: Service", seed), &svc, conv.serviceResult)

		var sl discoveryv1.EndpointSlice
		f.Fill(&sl)
		sl.Namespace = pick(r, f, "ns")
		if sl.Labels == nil || r.IntN(5) > 0 {
			sl.Labels = map[string]string{discoveryv1.LabelServiceName: pick(r, f, "web")}
		}
		if r.IntN(2) == 0 {
			sl.Annotations = map[string]string{corev1.EndpointsLastChangeTriggerTime: pick(r, f, "2026-01-02T03:04:05Z")}
		}
		sl.AddressType = discoveryv1.AddressType(pick(r, f, "IPv4", "IPv6", "FQDN"))
		for i := range sl.Endpoints {
			sl.Endpoints[i].Addresses = ips(r, f)
		}
		same(t, fmt.Sprintf("seed %d: EndpointSlice", seed), &sl, conv.sliceResult)

		var n corev1.Node
		f.Fill(&n)
		if r.IntN(2) == 0 {
			n.Labels = map[string]string{corev1.LabelTopologyZone: pick(r, f, "zone-a")}
		}
		for i := range n.Status.Addresses {
			n.Status.Addresses[i].Type = corev1.NodeAddressType(pick(r, f, "InternalIP", "ExternalIP", "Hostname"))
			n.Status.Addresses[i].Address = pick(r, f, "192.0.2.1", "2001:db8::2")
		}
		if r.IntN(2) == 0 { // randfill leaves it nil
			n.DeletionTimestamp = &metav1.Time{Time: time.Unix(r.Int64N(1<<31), 0)}
		}
		n.Spec.PodCIDR = pick(r, f, "10.244.1.0/24", "")
		n.Spec.PodCIDRs = n.Spec.PodCIDRs[:0]
		for range r.IntN(3) {
			n.Spec.PodCIDRs = append(n.Spec.PodCIDRs, pick(r, f, "10.244.2.0/24", "fd00:10:244:2::/64"))
		}
		for i := range n.Spec.Taints {
			n.Spec.Taints[i].Key = pick(r, f, toBeDeletedTaint, "other")
		}
		same(t, fmt.Sprintf("seed %d: Node", seed), &n, func(o any) any { return conv.Node(o.(*corev1.Node)) })
	}
}

// serviceResult is all that conversion makes of a Service.
func (c Converter) serviceResult(o any) any {
	out, skips := c.Service(o.(*corev1.Service))
	return []any{out, skips}
}

// sliceResult is all that conversion, and sliceChange's own reads, make of
// an EndpointSlice.
func (c Converter) sliceResult(o any) any {
	sl := o.(*discoveryv1.EndpointSlice)
	out, skips := c.Slice(sl)
	return []any{out, skips, sl.Namespace, sl.Name, sl.Labels[discoveryv1.LabelServiceName]}
}

// same checks that convert gives the same for obj and slim(obj), and that
// slimming twice is slimming once (an informer may slim an object again).
func same(t *testing.T, what string, obj any, convert func(any) any) {
	t.Helper()
	once, err := slim(obj)
	if err != nil {
		t.Fatalf("%s: slim: %v", what, err)
	}
	if want, got := convert(obj), convert(once); !reflect.DeepEqual(want, got) {
		t.Fatalf("%s converts differently once slimmed:\nwant %s\ngot  %s", what, dump(want), dump(got))
	}
	twice, _ := slim(once)
	if !reflect.DeepEqual(once, twice) {
		t.Fatalf("slimming a slimmed %s changed it", what)
	}
}

func dump(v any) string { return fmt.Sprintf("%+v", v) }

// TestInformersKeepSlimObjects: what the informers cache is slimmed (no
// managedFields, no annotation kpipe does not read).
func TestInformersKeepSlimObjects(t *testing.T) {
	fat := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", ResourceVersion: "1",
			Annotations:   map[string]string{"kubectl.kubernetes.io/last-applied-configuration": "{...}"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:spec":{}}`)}}}},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.10", Selector: map[string]string{"app": "web"}},
	}
	list := func(context.Context, metav1.ListOptions) (*corev1.ServiceList, error) {
		return &corev1.ServiceList{ListMeta: metav1.ListMeta{ResourceVersion: "1"}, Items: []corev1.Service{*fat}}, nil
	}
	watch := func(context.Context, metav1.ListOptions) (k8swatch.Interface, error) { return k8swatch.NewFake(), nil }
	inf := informer[*corev1.ServiceList](&corev1.Service{}, func(*metav1.ListOptions) {}, func(error) {}, list, watch)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go inf.RunWithContext(ctx)
	deadline := time.Now().Add(10 * time.Second)
	for !inf.HasSynced() {
		if time.Now().After(deadline) {
			t.Fatal("informer did not sync")
		}
		time.Sleep(10 * time.Millisecond)
	}
	items := inf.GetStore().List()
	if len(items) != 1 {
		t.Fatalf("store holds %d objects, want 1", len(items))
	}
	got := items[0].(*corev1.Service)
	if got.ManagedFields != nil || got.Annotations != nil || got.Spec.Selector != nil {
		t.Errorf("informer keeps an unslimmed Service: %+v", got)
	}
	if got.Spec.ClusterIP != "10.96.0.10" || got.Name != "web" {
		t.Errorf("informer lost what kpipe reads: %+v", got)
	}
}
