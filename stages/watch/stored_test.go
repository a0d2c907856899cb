package watch

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/kpipe/kpipe/bus"
)

// TestInformersKeepConvertedValues: the informer caches hold what conversion
// made of each object (shared with the state sent to coalesce), not the API
// object with its managedFields, annotations and selectors.
func TestInformersKeepConvertedValues(t *testing.T) {
	fat := corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", ResourceVersion: "7",
			Annotations:   map[string]string{"kubectl.kubernetes.io/last-applied-configuration": strings.Repeat("x", 4096)},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:spec":{}}`)}}}},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.10", Selector: map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80}}},
	}
	list := func(context.Context, metav1.ListOptions) (*corev1.ServiceList, error) {
		return &corev1.ServiceList{ListMeta: metav1.ListMeta{ResourceVersion: "7"}, Items: []corev1.Service{fat}}, nil
	}
	watch := func(context.Context, metav1.ListOptions) (k8swatch.Interface, error) { return k8swatch.NewFake(), nil }
	conv := Converter{NodeName: "node-1"}
	inf := informer[*corev1.ServiceList](&corev1.Service{}, func(*metav1.ListOptions) {}, &lostServer{}, conv.convertForStore, list, watch)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go inf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctxTimeout(t, ctx).Done(), inf.HasSynced) {
		t.Fatal("informer did not sync")
	}
	items := inf.GetStore().List()
	if len(items) != 1 {
		t.Fatalf("store holds %d objects, want 1", len(items))
	}
	st, ok := items[0].(*stored)
	if !ok {
		t.Fatalf("store holds a %T, want what conversion made of it", items[0])
	}
	want, _ := conv.Service(&fat)
	if st.service == nil || st.service.ServiceKey != want.ServiceKey || st.service.ClusterIPs[0] != want.ClusterIPs[0] || len(st.service.Ports) != 1 {
		t.Errorf("store holds %+v, want %+v", st.service, want)
	}
	if _, ok, _ := inf.GetStore().GetByKey("ns/web"); !ok {
		t.Error("the converted object is not under the Service's key")
	}
}

func ctxTimeout(t *testing.T, ctx context.Context) context.Context {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestConversionPanicIsStored: a conversion that panics in the informers'
// transform is kept (an error would make the informer drop the object), and
// fails the stage when the object is sent, as a panic in a handler does.
func TestConversionPanicIsStored(t *testing.T) {
	out, err := Converter{}.convertForStore((*corev1.Service)(nil))
	if err != nil {
		t.Fatalf("transform error %v: the informer would drop the object", err)
	}
	st, ok := out.(*stored)
	if !ok || st.panicked == nil {
		t.Fatalf("transform gave %#v; want a stored object that records the panic", out)
	}
	s := &Stage{log: slog.New(slog.DiscardHandler), status: bus.NewBoard().Reporter(bus.Watch)}
	if err := s.catch("test", func() { s.converted(st) }); err == nil {
		t.Error("sending an object whose conversion panicked did not fail")
	}
}
