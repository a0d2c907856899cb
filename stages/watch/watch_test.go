package watch

import (
	"context"
	"net/netip"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
)

const within = 10 * time.Second

// stageHarness runs the watch stage against a fake apiserver.
type stageHarness struct {
	t       *testing.T
	client  *fake.Clientset
	out     *bus.ChangeQueue
	taken   []bus.Change // taken from out, not yet returned by next
	replay  *bus.ReplayFlag
	board   *bus.Board
	reg     *prometheus.Registry
	stage   *Stage
	watches chan string // resource names whose watch has started

	mu        sync.Mutex
	selectors map[string][]string  // list selectors by resource: "labels|fields"
	active    []k8swatch.Interface // the watches handed out

	// The current Run: its cancel, and where its result arrives.
	cancel context.CancelFunc
	done   chan error
}

func startStage(t *testing.T, objects ...runtime.Object) *stageHarness {
	t.Helper()
	return startStageWith(t, nil, objects...)
}

// startStageWith is startStage with setup applied to the stage before it runs.
func startStageWith(t *testing.T, setup func(*Stage), objects ...runtime.Object) *stageHarness {
	t.Helper()
	h := &stageHarness{t: t, client: fake.NewClientset(objects...), out: bus.NewChangeQueue(), replay: bus.NewReplayFlag(),
		board: bus.NewBoard(), reg: prometheus.NewRegistry(), watches: make(chan string, 64), selectors: map[string][]string{}}
	h.client.PrependReactor("list", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if l, ok := a.(k8stesting.ListAction); ok {
			r := l.GetListRestrictions()
			h.mu.Lock()
			h.selectors[a.GetResource().Resource] = append(h.selectors[a.GetResource().Resource], r.Labels.String()+"|"+r.Fields.String())
			h.mu.Unlock()
		}
		return false, nil, nil // fall through to the object tracker
	})
	// The fake's watches do not replay what happened before they started: report
	// when each is in place, so the test changes objects only after.
	h.client.PrependWatchReactor("*", func(a k8stesting.Action) (bool, k8swatch.Interface, error) {
		w, err := h.client.Tracker().Watch(a.GetResource(), a.GetNamespace())
		if err != nil {
			return false, nil, err
		}
		h.mu.Lock()
		h.active = append(h.active, w)
		h.mu.Unlock()
		h.watches <- a.GetResource().Resource
		return true, w, nil
	})
	h.stage = NewStage(Params{Client: h.client, NodeName: "node-1", Out: h.out, Replay: h.replay,
		Env: bus.Envs{Metrics: metrics.New(h.reg), Board: h.board}.For(bus.Watch)})
	if setup != nil {
		setup(h.stage)
	}
	h.run()
	return h
}

// run starts the stage's Run (again, as the supervisor's restart does); the test's
// cleanup cancels it and expects nil unless the test took its result with exit.
func (h *stageHarness) run() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	h.cancel, h.done = cancel, done
	go func() { done <- h.stage.Run(ctx) }()
	h.t.Cleanup(func() {
		cancel()
		select {
		case err, ok := <-done:
			if ok && err != nil {
				h.t.Errorf("Run returned %v after cancel; want nil", err)
			}
		case <-time.After(within):
			h.t.Error("Run did not return after its context was cancelled")
		}
	})
}

// exit waits for the current Run to return on its own (its context still live) and
// returns its error.
func (h *stageHarness) exit() error {
	h.t.Helper()
	select {
	case err := <-h.done:
		close(h.done) // taken: the cleanup expects nothing more
		return err
	case <-time.After(within):
		h.t.Fatal("Run did not return with its context live: hung?")
		return nil
	}
}

// stopWatches ends every watch handed out so far, as an apiserver going away does.
func (h *stageHarness) stopWatches() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, w := range h.active {
		w.Stop()
	}
	h.active = nil
}

// waitWatches waits until the three watches (services, endpointslices, nodes) run.
func (h *stageHarness) waitWatches() {
	h.t.Helper()
	seen := map[string]bool{}
	deadline := time.After(within)
	for len(seen) < 3 {
		select {
		case r := <-h.watches:
			seen[r] = true
		case <-deadline:
			h.t.Fatalf("watches started: %v; want services, endpointslices, nodes", seen)
		}
	}
}

// next returns the first change that match accepts, skipping others (the informers
// may still deliver their initial adds after the first replay; they are redundant).
func (h *stageHarness) next(what string, match func(bus.Change) bool) bus.Change {
	h.t.Helper()
	deadline := time.After(within)
	for {
		for len(h.taken) > 0 {
			c := h.taken[0]
			h.taken = h.taken[1:]
			if match(c) {
				return c
			}
		}
		select {
		case <-h.out.Ready():
			h.taken = append(h.taken, flatten(h.out)...)
		case <-deadline:
			h.t.Fatalf("no change: %s", what)
		}
	}
}

// flatten takes what q holds as the changes coalesce applies, in order: the
// replay first.
func flatten(q *bus.ChangeQueue) []bus.Change {
	cs, ok := q.TryTake()
	if !ok {
		return nil
	}
	var out []bus.Change
	if cs.Replay != nil {
		out = append(out, bus.Change{Kind: bus.Replayed, Replay: cs.Replay})
	}
	return append(out, cs.Objects...)
}

func (h *stageHarness) nextReplay() *bus.State {
	h.t.Helper()
	return h.next("a replay", func(c bus.Change) bool { return c.Kind == bus.Replayed }).Replay
}

func (h *stageHarness) skipped(kind, reason string) float64 {
	h.t.Helper()
	mfs, err := h.reg.Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "kpipe_skipped_objects_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["kind"] == kind && labels["reason"] == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func service(name, ip string, labels map[string]string) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: labels},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, ClusterIP: ip, ClusterIPs: []string{ip},
			Ports: []corev1.ServicePort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80}}},
	}
}

func slice(name, svc, ip string, labels map[string]string) *discoveryv1.EndpointSlice {
	l := map[string]string{discoveryv1.LabelServiceName: svc}
	for k, v := range labels {
		l[k] = v
	}
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: l},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Protocol: ptr(corev1.ProtocolTCP), Port: ptr(int32(8080))}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{ip}}},
	}
}

func node(name string) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelTopologyZone: "zone-a"}},
		Spec:       corev1.NodeSpec{PodCIDRs: []string{"10.244.1.0/24"}},
		Status:     corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "192.168.0.1"}}},
	}
}

var (
	webKey   = bus.ServiceKey{Namespace: "ns", Name: "web"}
	otherKey = bus.ServiceKey{Namespace: "ns", Name: "other-proxy"}
	hlKey    = bus.ServiceKey{Namespace: "ns", Name: "headless-labelled"}
)

func TestStageReplaysStartingState(t *testing.T) {
	h := startStage(t,
		service("web", "10.96.0.10", nil),
		service("other-proxy", "10.96.0.11", map[string]string{"service.kubernetes.io/service-proxy-name": "someone-else"}),
		service("headless-labelled", "10.96.0.12", map[string]string{"service.kubernetes.io/headless": ""}),
		service("external-name", "", nil),
		slice("web-abc", "web", "10.244.1.5", nil),
		slice("other-proxy-abc", "other-proxy", "10.244.1.6", map[string]string{"service.kubernetes.io/service-proxy-name": "someone-else"}),
		slice("hl-abc", "headless-labelled", "10.244.1.7", map[string]string{"service.kubernetes.io/headless": ""}),
		node("node-1"),
	)
	st := h.nextReplay()
	if st.Services[webKey] == nil {
		t.Fatalf("replay services = %v; want %v", st.Services, webKey)
	}
	if got := st.Services[webKey].ClusterIPs; len(got) != 1 || got[0].String() != "10.96.0.10" {
		t.Errorf("web cluster IPs = %v", got)
	}
	for _, k := range []bus.ServiceKey{otherKey, hlKey, {Namespace: "ns", Name: "external-name"}} {
		if _, ok := st.Services[k]; ok {
			t.Errorf("replay holds %v; it is not ours", k)
		}
	}
	if len(st.Services) != 1 {
		t.Errorf("replay services = %v; want only web", st.Services)
	}
	if sl := st.Slices[webKey]["web-abc"]; sl == nil || len(sl.Items) != 1 || sl.Items[0].Addr.String() != "10.244.1.5" {
		t.Errorf("replay slices of web = %v", st.Slices[webKey])
	}
	if len(st.Slices) != 1 {
		t.Errorf("replay slices = %v; want only web's", st.Slices)
	}
	if st.Node == nil || st.Node.Name != "node-1" || st.Node.Zone != "zone-a" || len(st.Node.Addrs) != 1 {
		t.Errorf("replay node = %+v", st.Node)
	}

	// The selectors the apiserver is asked for are kube-proxy's.
	h.mu.Lock()
	defer h.mu.Unlock()
	const want = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name|"
	for _, r := range []string{"services", "endpointslices"} {
		if got := h.selectors[r]; len(got) == 0 || got[0] != want {
			t.Errorf("%s listed with %q; want %q", r, got, want)
		}
	}
	if got := h.selectors["nodes"]; len(got) == 0 || got[0] != "|metadata.name=node-1" {
		t.Errorf("nodes listed with %q; want only this node by name", got)
	}
}

func TestStageSendsChanges(t *testing.T) {
	ctx := context.Background()
	h := startStage(t, service("web", "10.96.0.10", nil), slice("web-abc", "web", "10.244.1.5", nil), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	svcs := h.client.CoreV1().Services("ns")

	// Update.
	web := service("web", "10.96.0.10", nil)
	web.Spec.Ports[0].Port = 8443
	if _, err := svcs.Update(ctx, web, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	c := h.next("web updated", func(c bus.Change) bool {
		return c.Kind == bus.ServiceChanged && c.Key == webKey && c.Service != nil && c.Service.Ports[0].Port == 8443
	})
	if c.Service.ServiceKey != webKey {
		t.Errorf("changed service names %v", c.Service.ServiceKey)
	}

	// Slice update and delete.
	slices := h.client.DiscoveryV1().EndpointSlices("ns")
	if _, err := slices.Update(ctx, slice("web-abc", "web", "10.244.1.99", nil), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	c = h.next("slice updated", func(c bus.Change) bool {
		return c.Kind == bus.SliceChanged && c.Slice != nil && c.Slice.Items[0].Addr.String() == "10.244.1.99"
	})
	if c.Key != webKey || c.SliceName != "web-abc" {
		t.Errorf("slice change key %v name %q; want %v web-abc", c.Key, c.SliceName, webKey)
	}
	if err := slices.Delete(ctx, "web-abc", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next("slice deleted", func(c bus.Change) bool {
		return c.Kind == bus.SliceChanged && c.Key == webKey && c.SliceName == "web-abc" && c.Slice == nil
	})

	// Delete.
	if err := svcs.Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next("web deleted", func(c bus.Change) bool {
		return c.Kind == bus.ServiceChanged && c.Key == webKey && c.Service == nil
	})

	// Node marked for deletion.
	n := node("node-1")
	n.Spec.Taints = []corev1.Taint{{Key: "ToBeDeletedByClusterAutoscaler", Effect: corev1.TaintEffectNoSchedule}}
	if _, err := h.client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next("node deleting", func(c bus.Change) bool { return c.Kind == bus.NodeChanged && c.Node.Deleting })
	if !h.board.Read()[bus.Watch].NodeDeleting {
		t.Errorf("watch report = %+v; want NodeDeleting", h.board.Read()[bus.Watch])
	}
}

func TestStageInvalidServiceIsCountedAndDoesNotStopOthers(t *testing.T) {
	ctx := context.Background()
	h := startStage(t, node("node-1"))
	h.nextReplay()
	h.waitWatches()
	svcs := h.client.CoreV1().Services("ns")

	if _, err := svcs.Create(ctx, service("broken", "not-an-ip", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	partly := service("partly", "10.96.0.21", nil)
	partly.Spec.ExternalIPs = []string{"203.0.113.9", "999.1.1.1"}
	if _, err := svcs.Create(ctx, partly, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := svcs.Create(ctx, service("after", "10.96.0.20", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c := h.next("partly created", func(c bus.Change) bool {
		return c.Kind == bus.ServiceChanged && c.Key.Name == "partly"
	})
	if c.Service == nil || len(c.Service.ExternalIPs) != 1 || c.Service.ExternalIPs[0].String() != "203.0.113.9" {
		t.Errorf("partly = %+v; want it with its one valid external IP", c.Service)
	}
	c = h.next("after created", func(c bus.Change) bool {
		return c.Kind == bus.ServiceChanged && c.Key.Name == "after"
	})
	if c.Service == nil || c.Service.ClusterIPs[0].String() != "10.96.0.20" {
		t.Errorf("valid service after an invalid one = %+v", c.Service)
	}
	if n := h.skipped("Service", "invalid-cluster-ip"); n < 1 {
		t.Errorf("kpipe_skipped_objects_total{kind=Service,reason=invalid-cluster-ip} = %v; want >= 1", n)
	}
	if n := h.skipped("Service", "invalid-external-ip"); n < 1 {
		t.Errorf("kpipe_skipped_objects_total{kind=Service,reason=invalid-external-ip} = %v; want >= 1", n)
	}

	// The replay that follows holds the valid ones and not the broken one.
	h.replay.Raise()
	st := h.nextReplay()
	if st.Services[bus.ServiceKey{Namespace: "ns", Name: "after"}] == nil || st.Services[bus.ServiceKey{Namespace: "ns", Name: "partly"}] == nil {
		t.Errorf("replay services = %v; want after and partly", st.Services)
	}
	if _, ok := st.Services[bus.ServiceKey{Namespace: "ns", Name: "broken"}]; ok {
		t.Error("replay holds the service without a valid cluster IP")
	}
}

func TestStageReplaysOnRequest(t *testing.T) {
	ctx := context.Background()
	h := startStage(t, service("web", "10.96.0.10", nil), node("node-1"))
	h.nextReplay()
	h.waitWatches()
	if _, err := h.client.CoreV1().Services("ns").Create(ctx, service("new", "10.96.0.30", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next("new created", func(c bus.Change) bool { return c.Kind == bus.ServiceChanged && c.Key.Name == "new" })

	h.replay.Raise()
	st := h.nextReplay()
	if len(st.Services) != 2 || st.Services[webKey] == nil || st.Services[bus.ServiceKey{Namespace: "ns", Name: "new"}] == nil {
		t.Errorf("replay on request = %v; want web and new", st.Services)
	}
	if st.Node == nil || st.Node.Name != "node-1" {
		t.Errorf("replay node = %+v", st.Node)
	}
}

// TestStageNodeChangedOnlyWhenUsedFieldsChange: the kubelet's status heartbeats
// change nothing kpipe uses and must not become NodeChanged events.
func TestStageNodeChangedOnlyWhenUsedFieldsChange(t *testing.T) {
	ctx := context.Background()
	// What watch sends, before the queue folds an object's changes into its latest.
	var mu sync.Mutex
	var zones []string
	h := startStageWith(t, func(s *Stage) {
		s.beforeSend = func(c bus.Change) {
			if c.Kind == bus.NodeChanged {
				mu.Lock()
				defer mu.Unlock()
				zones = append(zones, c.Node.Zone)
			}
		}
	}, node("node-1"))
	h.nextReplay()
	h.waitWatches()
	nodes := h.client.CoreV1().Nodes()
	beat := 0
	heartbeat := func(zone string) {
		t.Helper()
		beat++
		n := node("node-1")
		n.Labels[corev1.LabelTopologyZone] = zone
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
			LastHeartbeatTime: metav1.NewTime(time.Unix(int64(1000+beat), 0))}}
		if _, err := nodes.Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Heartbeats around two real changes; events of one informer arrive in order,
	// so every heartbeat before zone-c has been handled when zone-c arrives.
	heartbeat("zone-a")
	heartbeat("zone-a")
	heartbeat("zone-b")
	heartbeat("zone-b")
	heartbeat("zone-b")
	heartbeat("zone-c")
	h.next("node in zone-c", func(c bus.Change) bool { return c.Kind == bus.NodeChanged && c.Node.Zone == "zone-c" })
	mu.Lock()
	sent := slices.Clone(zones)
	mu.Unlock()
	if !slices.Equal(sent, []string{"zone-b", "zone-c"}) {
		t.Errorf("NodeChanged zones = %v; want [zone-b zone-c]: one per real change", sent)
	}

	// A replay still carries the node.
	h.replay.Raise()
	if st := h.nextReplay(); st.Node == nil || st.Node.Zone != "zone-c" {
		t.Errorf("replay node = %+v; want zone-c", st.Node)
	}
}

// TestSameNodeComparesEveryField: a field added to bus.Node must take part in the
// comparison, or a change to it would never reach render.
func TestSameNodeComparesEveryField(t *testing.T) {
	base := bus.Node{Name: "n", Zone: "z", Addrs: []netip.Addr{netip.MustParseAddr("192.0.2.1")},
		PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24")}}
	if !sameNode(&base, &bus.Node{Name: "n", Zone: "z", Addrs: slices.Clone(base.Addrs), PodCIDRs: slices.Clone(base.PodCIDRs)}) {
		t.Error("equal values compare different")
	}
	if sameNode(&base, nil) || !sameNode(nil, nil) {
		t.Error("nil compares wrong")
	}
	typ := reflect.TypeOf(base)
	for i := range typ.NumField() {
		changed := base
		f := reflect.ValueOf(&changed).Elem().Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString(f.String() + "x")
		case reflect.Bool:
			f.SetBool(!f.Bool())
		case reflect.Slice:
			f.Set(reflect.Append(reflect.MakeSlice(f.Type(), 0, f.Len()+1), reflect.Zero(f.Type().Elem())))
		default:
			t.Fatalf("field %s of kind %s: teach this test and sameNode about it", typ.Field(i).Name, f.Kind())
		}
		if sameNode(&base, &changed) {
			t.Errorf("a change to %s is not seen", typ.Field(i).Name)
		}
	}
}
