package testbed

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// ManagedBy is the endpointslice.kubernetes.io/managed-by value of the slices
// the test bed writes (there is no endpoint-slice controller).
const ManagedBy = "kpe2e"

// CreateNamespace creates a Kubernetes namespace.
func (tb *Testbed) CreateNamespace(ctx context.Context, name string) error {
	_, err := tb.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// DeleteNamespace deletes every Service and EndpointSlice in namespace name and
// then the namespace itself. With no controller-manager nothing else would
// empty it, so it is finalized here.
func (tb *Testbed) DeleteNamespace(ctx context.Context, name string) error {
	cs := tb.client
	svcs, err := cs.CoreV1().Services(name).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list services of %s: %w", name, err)
	}
	for _, s := range svcs.Items {
		if err := cs.CoreV1().Services(name).Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete service %s/%s: %w", name, s.Name, err)
		}
	}
	if err := cs.DiscoveryV1().EndpointSlices(name).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("delete endpoint slices of %s: %w", name, err)
	}
	if err := cs.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("delete namespace %s: %w", name, err)
	}
	ns, err := cs.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("get namespace %s: %w", name, err)
	}
	ns.Spec.Finalizers = nil
	if _, err := cs.CoreV1().Namespaces().Finalize(ctx, ns, metav1.UpdateOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("finalize namespace %s: %w", name, err)
	}
	return nil
}

// Port makes a service port: name (may be empty), protocol, service port and
// target port.
func Port(name string, proto corev1.Protocol, port, target int32) corev1.ServicePort {
	return corev1.ServicePort{Name: name, Protocol: proto, Port: port, TargetPort: intstr.FromInt32(target)}
}

// Service builds a ClusterIP service object (not yet created).
func Service(ns, name string, ports ...corev1.ServicePort) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.ServiceSpec{
			Type:  corev1.ServiceTypeClusterIP,
			Ports: ports,
		},
	}
}

// CreateService creates svc and returns it as stored (with its ClusterIPs).
func (tb *Testbed) CreateService(ctx context.Context, svc *corev1.Service) (*corev1.Service, error) {
	out, err := tb.client.CoreV1().Services(svc.Namespace).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create service %s/%s: %w", svc.Namespace, svc.Name, err)
	}
	return out, nil
}

// UpdateService changes a service with mutate (retrying on conflicts).
func (tb *Testbed) UpdateService(ctx context.Context, ns, name string, mutate func(*corev1.Service)) (*corev1.Service, error) {
	for i := 0; ; i++ {
		svc, err := tb.client.CoreV1().Services(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("get service %s/%s: %w", ns, name, err)
		}
		mutate(svc)
		out, err := tb.client.CoreV1().Services(ns).Update(ctx, svc, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) && i < 5 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("update service %s/%s: %w", ns, name, err)
		}
		return out, nil
	}
}

// SetLoadBalancerIngress sets status.loadBalancer.ingress of a service (what a
// cloud controller would do) and returns the service as stored.
func (tb *Testbed) SetLoadBalancerIngress(ctx context.Context, ns, name string, ingress ...corev1.LoadBalancerIngress) (*corev1.Service, error) {
	api := tb.client.CoreV1().Services(ns)
	for i := 0; ; i++ {
		svc, err := api.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("get service %s/%s: %w", ns, name, err)
		}
		svc.Status.LoadBalancer.Ingress = ingress
		out, err := api.UpdateStatus(ctx, svc, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) && i < 5 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("update status of service %s/%s: %w", ns, name, err)
		}
		return out, nil
	}
}

// LBIngressIP is a load-balancer ingress entry for ip; mode "" leaves
// ipMode unset (the API then means VIP).
func LBIngressIP(ip string, mode corev1.LoadBalancerIPMode) corev1.LoadBalancerIngress {
	ing := corev1.LoadBalancerIngress{IP: ip}
	if mode != "" {
		ing.IPMode = ptr.To(mode)
	}
	return ing
}

// DeleteService deletes a service.
func (tb *Testbed) DeleteService(ctx context.Context, ns, name string) error {
	if err := tb.client.CoreV1().Services(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return fmt.Errorf("delete service %s/%s: %w", ns, name, err)
	}
	return nil
}

// Endpoint is one address of an EndpointSlice.
type Endpoint struct {
	IP          string
	Ready       bool
	Serving     bool
	Terminating bool
	// NodeName defaults to the test bed's node.
	NodeName string
	Zone     string
	// HintZones, when set, become the endpoint's hints.forZones.
	HintZones []string
}

// ReadyEndpoints are ready, serving endpoints for pods (1-based numbers), IPv4.
func (tb *Testbed) ReadyEndpoints(pods ...int) []Endpoint {
	eps := make([]Endpoint, 0, len(pods))
	for _, n := range pods {
		eps = append(eps, Endpoint{IP: tb.Pod(n).IPv4, Ready: true, Serving: true})
	}
	return eps
}

// ReadyEndpoints6 are ready, serving endpoints for pods, IPv6.
func (tb *Testbed) ReadyEndpoints6(pods ...int) []Endpoint {
	eps := make([]Endpoint, 0, len(pods))
	for _, n := range pods {
		eps = append(eps, Endpoint{IP: tb.Pod(n).IPv6, Ready: true, Serving: true})
	}
	return eps
}

// EndpointSlice builds the slice for svc holding eps, with one port per
// service port (same name and protocol, the target port as number). The slice
// is named "<service>-<family>", family from the first endpoint (IPv4 when eps
// is empty) unless name is given.
func EndpointSlice(svc *corev1.Service, name string, eps []Endpoint) *discoveryv1.EndpointSlice {
	family := discoveryv1.AddressTypeIPv4
	if len(eps) > 0 && strings.Contains(eps[0].IP, ":") {
		family = discoveryv1.AddressTypeIPv6
	}
	if name == "" {
		name = svc.Name + "-" + strings.ToLower(string(family))
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: svc.Namespace,
			Name:      name,
			Labels: map[string]string{
				discoveryv1.LabelServiceName: svc.Name,
				discoveryv1.LabelManagedBy:   ManagedBy,
			},
		},
		AddressType: family,
		Endpoints:   []discoveryv1.Endpoint{},
	}
	for _, p := range svc.Spec.Ports {
		target := p.TargetPort.IntVal
		if target == 0 {
			target = p.Port
		}
		slice.Ports = append(slice.Ports, discoveryv1.EndpointPort{
			Name:     ptr.To(p.Name),
			Protocol: ptr.To(p.Protocol),
			Port:     ptr.To(target),
		})
	}
	for _, e := range eps {
		node := e.NodeName
		if node == "" {
			node = NodeName
		}
		ep := discoveryv1.Endpoint{
			Addresses: []string{e.IP},
			Conditions: discoveryv1.EndpointConditions{
				Ready:       ptr.To(e.Ready),
				Serving:     ptr.To(e.Serving),
				Terminating: ptr.To(e.Terminating),
			},
			NodeName: ptr.To(node),
		}
		if e.Zone != "" {
			ep.Zone = ptr.To(e.Zone)
		}
		if len(e.HintZones) > 0 {
			ep.Hints = &discoveryv1.EndpointHints{}
			for _, z := range e.HintZones {
				ep.Hints.ForZones = append(ep.Hints.ForZones, discoveryv1.ForZone{Name: z})
			}
		}
		slice.Endpoints = append(slice.Endpoints, ep)
	}
	return slice
}

// SetEndpoints creates or replaces the EndpointSlice of svc for the family of
// eps (see EndpointSlice) so that it holds exactly eps.
func (tb *Testbed) SetEndpoints(ctx context.Context, svc *corev1.Service, eps []Endpoint) (*discoveryv1.EndpointSlice, error) {
	return tb.ApplyEndpointSlice(ctx, EndpointSlice(svc, "", eps))
}

// ApplyEndpointSlice creates slice, or updates it if it exists.
func (tb *Testbed) ApplyEndpointSlice(ctx context.Context, slice *discoveryv1.EndpointSlice) (*discoveryv1.EndpointSlice, error) {
	api := tb.client.DiscoveryV1().EndpointSlices(slice.Namespace)
	for i := 0; ; i++ {
		cur, err := api.Get(ctx, slice.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			out, err := api.Create(ctx, slice, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) && i < 5 {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("create endpoint slice %s/%s: %w", slice.Namespace, slice.Name, err)
			}
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("get endpoint slice %s/%s: %w", slice.Namespace, slice.Name, err)
		}
		upd := slice.DeepCopy()
		upd.ResourceVersion = cur.ResourceVersion
		out, err := api.Update(ctx, upd, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) && i < 5 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("update endpoint slice %s/%s: %w", slice.Namespace, slice.Name, err)
		}
		return out, nil
	}
}

// DeleteEndpointSlice deletes a slice.
func (tb *Testbed) DeleteEndpointSlice(ctx context.Context, ns, name string) error {
	if err := tb.client.DiscoveryV1().EndpointSlices(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return fmt.Errorf("delete endpoint slice %s/%s: %w", ns, name, err)
	}
	return nil
}

// ClusterAddr is "clusterIP:port" of the first ClusterIP of svc.
func ClusterAddr(svc *corev1.Service, port int32) string {
	return joinHostPort(svc.Spec.ClusterIP, int(port))
}

// ServiceComment is how kpipe's rules name a service port in iptables
// comments: "<namespace>/<name>:<portname>".
func ServiceComment(ns, name, port string) string {
	if port == "" {
		return ns + "/" + name
	}
	return ns + "/" + name + ":" + port
}

// NodePortOf is the nodePort the apiserver allocated to the port of svc named
// port (0 when there is none).
func NodePortOf(svc *corev1.Service, port string) int32 {
	for _, p := range svc.Spec.Ports {
		if p.Name == port {
			return p.NodePort
		}
	}
	return 0
}

// HostPort is "ip:port" ("[ip]:port" for IPv6).
func HostPort(ip string, port int32) string { return joinHostPort(ip, int(port)) }

// GetNode returns the test bed's Node object.
func (tb *Testbed) GetNode(ctx context.Context) (*corev1.Node, error) {
	n, err := tb.client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get node %s: %w", NodeName, err)
	}
	return n, nil
}

// UpdateNode changes the test bed's Node object (metadata and spec) with
// mutate, retrying on conflicts.
func (tb *Testbed) UpdateNode(ctx context.Context, mutate func(*corev1.Node)) (*corev1.Node, error) {
	return tb.updateNode(ctx, false, mutate)
}

// UpdateNodeStatus changes the status of the test bed's Node object (e.g. its
// addresses) with mutate, retrying on conflicts.
func (tb *Testbed) UpdateNodeStatus(ctx context.Context, mutate func(*corev1.Node)) (*corev1.Node, error) {
	return tb.updateNode(ctx, true, mutate)
}

func (tb *Testbed) updateNode(ctx context.Context, status bool, mutate func(*corev1.Node)) (*corev1.Node, error) {
	api := tb.client.CoreV1().Nodes()
	for i := 0; ; i++ {
		n, err := api.Get(ctx, NodeName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("get node %s: %w", NodeName, err)
		}
		mutate(n)
		var out *corev1.Node
		if status {
			out, err = api.UpdateStatus(ctx, n, metav1.UpdateOptions{})
		} else {
			out, err = api.Update(ctx, n, metav1.UpdateOptions{})
		}
		if apierrors.IsConflict(err) && i < 5 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("update node %s: %w", NodeName, err)
		}
		return out, nil
	}
}

// NodeAddresses are the Node object's status.addresses as the test bed
// creates them: InternalIPs NodeIPv4 and NodeIPv6, and the hostname.
func NodeAddresses() []corev1.NodeAddress {
	return []corev1.NodeAddress{
		{Type: corev1.NodeInternalIP, Address: NodeIPv4},
		{Type: corev1.NodeInternalIP, Address: NodeIPv6},
		{Type: corev1.NodeHostName, Address: NodeName},
	}
}
