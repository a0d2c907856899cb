package watch

import (
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// slim is the informers' transform: it keeps of each object only what watch
// reads (Converter and the handlers), so the informer caches do not hold
// managedFields, annotations, selectors, endpoint targetRefs and the like for
// every Service and EndpointSlice (at 10,000 of each, most of kpipe's heap).
// It copies what it keeps into a new object, so it may see an object it
// already slimmed. TestSlimKeepsWhatConvertReads fills every field at random
// and checks that conversion gives the same result either way.
func slim(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.Service:
		return slimService(o), nil
	case *discoveryv1.EndpointSlice:
		return slimSlice(o), nil
	case *corev1.Node:
		return slimNode(o), nil
	}
	return obj, nil
}

// slimMeta keeps an object's identity (the informer's key and the reflector's
// resource version) and the labels and annotations named.
func slimMeta(m *metav1.ObjectMeta, labels, annotations []string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Namespace: m.Namespace, Name: m.Name, UID: m.UID, ResourceVersion: m.ResourceVersion,
		DeletionTimestamp: m.DeletionTimestamp, Labels: only(m.Labels, labels), Annotations: only(m.Annotations, annotations)}
}

// only is m with just the keys named (nil when none is there).
func only(m map[string]string, keys []string) map[string]string {
	var out map[string]string
	for _, k := range keys {
		if v, ok := m[k]; ok {
			if out == nil {
				out = make(map[string]string, len(keys))
			}
			out[k] = v
		}
	}
	return out
}

func slimService(s *corev1.Service) *corev1.Service {
	sp := &s.Spec
	out := &corev1.Service{ObjectMeta: slimMeta(&s.ObjectMeta, nil, nil), Spec: corev1.ServiceSpec{
		Type: sp.Type, ClusterIP: sp.ClusterIP, ClusterIPs: sp.ClusterIPs, ExternalIPs: sp.ExternalIPs,
		LoadBalancerSourceRanges: sp.LoadBalancerSourceRanges, ExternalTrafficPolicy: sp.ExternalTrafficPolicy,
		InternalTrafficPolicy: sp.InternalTrafficPolicy, HealthCheckNodePort: sp.HealthCheckNodePort,
		SessionAffinity: sp.SessionAffinity, SessionAffinityConfig: sp.SessionAffinityConfig,
	}}
	if len(sp.Ports) > 0 {
		out.Spec.Ports = make([]corev1.ServicePort, len(sp.Ports))
		for i, p := range sp.Ports {
			out.Spec.Ports[i] = corev1.ServicePort{Name: p.Name, Protocol: p.Protocol, Port: p.Port, NodePort: p.NodePort}
		}
	}
	for _, ing := range s.Status.LoadBalancer.Ingress {
		out.Status.LoadBalancer.Ingress = append(out.Status.LoadBalancer.Ingress, corev1.LoadBalancerIngress{IP: ing.IP, IPMode: ing.IPMode})
	}
	return out
}

func slimSlice(s *discoveryv1.EndpointSlice) *discoveryv1.EndpointSlice {
	out := &discoveryv1.EndpointSlice{
		ObjectMeta:  slimMeta(&s.ObjectMeta, []string{discoveryv1.LabelServiceName}, []string{corev1.EndpointsLastChangeTriggerTime}),
		AddressType: s.AddressType, Ports: s.Ports,
	}
	if len(s.Endpoints) > 0 {
		out.Endpoints = make([]discoveryv1.Endpoint, len(s.Endpoints))
		for i, e := range s.Endpoints {
			// Only the first address is used (the API allows one).
			out.Endpoints[i] = discoveryv1.Endpoint{Addresses: e.Addresses[:min(len(e.Addresses), 1):min(len(e.Addresses), 1)],
				Conditions: e.Conditions, NodeName: e.NodeName, Zone: e.Zone, Hints: e.Hints}
		}
	}
	return out
}

func slimNode(n *corev1.Node) *corev1.Node {
	out := &corev1.Node{ObjectMeta: slimMeta(&n.ObjectMeta, []string{corev1.LabelTopologyZone}, nil),
		Spec: corev1.NodeSpec{PodCIDR: n.Spec.PodCIDR, PodCIDRs: n.Spec.PodCIDRs}}
	for _, t := range n.Spec.Taints {
		if t.Key == toBeDeletedTaint {
			out.Spec.Taints = append(out.Spec.Taints, corev1.Taint{Key: t.Key})
		}
	}
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP || a.Type == corev1.NodeExternalIP {
			out.Status.Addresses = append(out.Status.Addresses, a)
		}
	}
	return out
}
