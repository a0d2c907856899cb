package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// controlAgent is the user agent of the test's own informers.
const controlAgent = "kpe2e-control"

// TestAPIServerRestartListsNothingAgain: the kube-apiserver restarts (stopped,
// down for 5 s, started again), as each apiserver of an HA control plane does
// in an upgrade. kpipe must resume its watches from their resourceVersions, as
// client-go's informers (kube-proxy's) do, and not LIST every Service and
// EndpointSlice again: at thousands of nodes that is a relist storm on every
// control-plane upgrade.
//
// A single apiserver restarting loses its watch cache: the new one can resume
// a watch only from the latest resourceVersion, and answers 410 Gone to an
// older one, after which any client-go informer lists again. So the test runs
// informers of its own with kpipe's selectors (the control: what client-go
// alone lists) and makes an EndpointSlice change the last write before the
// restart, so that a watch of EndpointSlices can be resumed (the control
// proves it: it lists none). The apiserver's audit log counts the lists by
// user agent: kpipe's must be none of EndpointSlices and no more than the
// control's of Services, once a change of the Service and of its endpoints,
// made after the apiserver is back, is programmed by kpipe and held by the
// control (both resumed), and again at two more such changes 5 s apart.
func TestAPIServerRestartListsNothingAgain(t *testing.T) {
	e := setup(t)
	controlPlaneBackAtEnd(t)
	port := testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort)
	svc := e.service("echo", port)
	addr := testbed.ClusterAddr(svc, 80)
	pod := tb.Pod(clientPod).NS
	control := startControlInformers(t, e.ctx)
	e.lastWrite(svc, control, addr, pod)

	stopped := time.Now()
	if err := tb.StopAPIServer(); err != nil {
		t.Fatalf("stop kube-apiserver: %v", err)
	}
	time.Sleep(5*time.Second - time.Since(stopped))
	if err := tb.StartAPIServer(e.ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("kube-apiserver ready again %v after it was stopped", since(stopped))

	for i, pods := range [][]int{{1, 2, 3}, {1, 3}, {2, 3}} {
		if i > 0 {
			time.Sleep(5 * time.Second)
		}
		e.changeBoth(svc, control, i, pods)
		expectExactly(t, fmt.Sprintf("change %d after the restart", i+1), tcp(2*time.Second), pod, addr, podIPs(pods...))
		lists, err := tb.Lists(stopped)
		if err != nil {
			t.Fatal(err)
		}
		kpipe, ctl := lists["kpipe"], lists[controlAgent]
		t.Logf("lists since the restart, once change %d was programmed: kpipe %v, control %v", i+1, kpipe, ctl)
		if ctl["endpointslices"] != 0 {
			t.Fatalf("the control informer listed EndpointSlices again (%d): the apiserver could not resume even a current watch; the test cannot tell kpipe's lists from the ones the apiserver forces", ctl["endpointslices"])
		}
		for _, r := range []string{"services", "endpointslices"} {
			if kpipe[r] > ctl[r] {
				t.Errorf("kpipe listed %s %d times since the apiserver restarted, client-go's informers %d; want no more (the watches resume from their resourceVersions)", r, kpipe[r], ctl[r])
			}
		}
		if t.Failed() {
			return
		}
	}
}

// controlInformers are client-go's informers of the Services and
// EndpointSlices kpipe watches, with its selectors, run by the test.
type controlInformers struct{ services, slices cache.SharedIndexInformer }

func startControlInformers(t *testing.T, ctx context.Context) controlInformers {
	t.Helper()
	cfg := tb.RESTConfig()
	cfg.UserAgent = controlAgent
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	proxied := func(o *metav1.ListOptions) {
		o.LabelSelector = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
	}
	informer := func(get cache.Getter, resource string, obj runtime.Object) cache.SharedIndexInformer {
		lw := cache.NewFilteredListWatchFromClient(get, resource, metav1.NamespaceAll, proxied)
		return cache.NewSharedIndexInformer(lw, obj, 0, cache.Indexers{})
	}
	c := controlInformers{
		services: informer(cs.CoreV1().RESTClient(), "services", &corev1.Service{}),
		slices:   informer(cs.DiscoveryV1().RESTClient(), "endpointslices", &discoveryv1.EndpointSlice{}),
	}
	ctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	go c.services.RunWithContext(ctx)
	go c.slices.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), c.services.HasSynced, c.slices.HasSynced) {
		t.Fatal("the control informers did not sync")
	}
	return c
}

// changeBoth changes svc (an annotation) and its endpoints (to pods) and waits
// until the control informers hold both.
func (e *env) changeBoth(svc *corev1.Service, control controlInformers, round int, pods []int) {
	e.t.Helper()
	up, err := tb.UpdateService(e.ctx, svc.Namespace, svc.Name, func(s *corev1.Service) {
		metav1.SetMetaDataAnnotation(&s.ObjectMeta, "kpe2e/round", fmt.Sprint(round))
	})
	if err != nil {
		e.t.Fatal(err)
	}
	sl, err := tb.SetEndpoints(e.ctx, svc, tb.ReadyEndpoints(pods...))
	if err != nil {
		e.t.Fatal(err)
	}
	testbed.Eventually(e.t, 90*time.Second, func() error {
		if err := holds(control.services, up); err != nil {
			return err
		}
		return holds(control.slices, sl)
	})
}

// holds says whether inf holds obj as it is now.
func holds(inf cache.SharedIndexInformer, obj metav1.Object) error {
	got, ok, err := inf.GetStore().Get(obj)
	if err != nil || !ok {
		return fmt.Errorf("the control informer does not hold %s/%s: %v", obj.GetNamespace(), obj.GetName(), err)
	}
	if rv := got.(metav1.Object).GetResourceVersion(); rv != obj.GetResourceVersion() {
		return fmt.Errorf("the control informer holds %s/%s at resourceVersion %s, not yet %s", obj.GetNamespace(), obj.GetName(), rv, obj.GetResourceVersion())
	}
	return nil
}

// lastWrite changes svc's EndpointSlice so that it is the last write to the
// API: kpipe programmed it, the control informer holds it, and nothing was
// written since (the apiserver renews its own lease every 10 s: then it tries
// again).
func (e *env) lastWrite(svc *corev1.Service, control controlInformers, addr, pod string) {
	e.t.Helper()
	for try, pods := range [][]int{{1, 2}, {1, 3}, {1, 2}, {1, 3}, {1, 2}} {
		sl, err := tb.SetEndpoints(e.ctx, svc, tb.ReadyEndpoints(pods...))
		if err != nil {
			e.t.Fatal(err)
		}
		expectExactly(e.t, "before the restart", tcp(2*time.Second), pod, addr, podIPs(pods...))
		testbed.Eventually(e.t, 10*time.Second, func() error {
			if rv := control.slices.LastSyncResourceVersion(); rv != sl.ResourceVersion {
				return fmt.Errorf("the control informer holds EndpointSlices at resourceVersion %s, not yet %s", rv, sl.ResourceVersion)
			}
			return nil
		})
		// A list's resourceVersion is the latest.
		now, err := tb.Client().CoreV1().Namespaces().List(e.ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", e.ns).String()})
		if err != nil {
			e.t.Fatal(err)
		}
		if now.ResourceVersion == sl.ResourceVersion {
			return
		}
		e.t.Logf("try %d: written since the EndpointSlice (resourceVersion %s): now %s", try+1, sl.ResourceVersion, now.ResourceVersion)
	}
	e.t.Fatal("could not make an EndpointSlice change the last write to the API")
}
