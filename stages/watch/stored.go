package watch

import (
	"fmt"
	"runtime/debug"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/kpipe/kpipe/bus"
)

// stored is what the informers keep of a Service, an EndpointSlice or the
// Node: its identity and what conversion made of it, never the API object.
// The converted values are the ones sent to coalesce, so the informer caches
// and the desired state share them: at 10,000 services the API objects, even
// with managedFields and the like stripped, took as much heap again.
type stored struct {
	namespace, name, resourceVersion string

	service *bus.Service       // a Service: nil when a node proxy ignores it
	slice   *bus.EndpointSlice // an EndpointSlice: nil when ignored
	node    *bus.Node          // the Node
	// sliceService is an EndpointSlice's kubernetes.io/service-name label.
	sliceService string
	// skips are the parts conversion dropped, reported whenever the object is
	// sent (as when watch converted at each send).
	skips []skip
	// panicked is what conversion panicked with: sending the object fails the
	// stage, as a panic in a handler does.
	panicked error
}

// GetObjectMeta makes a stored object known to the informers' key functions.
func (s *stored) GetObjectMeta() metav1.Object {
	return &metav1.ObjectMeta{Namespace: s.namespace, Name: s.name, ResourceVersion: s.resourceVersion}
}

func (s *stored) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// DeepCopyObject copies the wrapper; the values it points to are immutable.
func (s *stored) DeepCopyObject() runtime.Object { c := *s; return &c }

// convertForStore is the informers' transform: it converts each API object as
// it arrives (an object already converted passes through). It never fails: the
// informer would drop an object whose transform failed, so a conversion that
// panics is stored as such.
func (c Converter) convertForStore(obj any) (out any, _ error) {
	st := &stored{}
	defer func() {
		if v := recover(); v != nil {
			st.panicked = fmt.Errorf("converting %s/%s: %v\n%s", st.namespace, st.name, v, debug.Stack())
			out = st
		}
	}()
	switch o := obj.(type) {
	case *corev1.Service:
		st.identify(&o.ObjectMeta)
		st.service, st.skips = c.Service(o)
	case *discoveryv1.EndpointSlice:
		st.identify(&o.ObjectMeta)
		st.sliceService = o.Labels[discoveryv1.LabelServiceName]
		st.slice, st.skips = c.Slice(o)
	case *corev1.Node:
		st.identify(&o.ObjectMeta)
		st.node = c.Node(o)
	default:
		return obj, nil
	}
	return st, nil
}

func (s *stored) identify(m *metav1.ObjectMeta) {
	s.namespace, s.name, s.resourceVersion = m.Namespace, m.Name, m.ResourceVersion
}
