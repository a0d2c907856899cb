package main

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
)

// TestBuildTreeProgramsAService: the real supervisor tree, built by buildTree on
// a fake apiserver and a fake kernel (no root: canaries, conntrack and the
// address watch are faked or off, health listens on 127.0.0.1:0), puts a
// Service created after it started into the kernel's nat table: its ClusterIP
// rule and the DNAT to its endpoint.
func TestBuildTreeProgramsAService(t *testing.T) {
	client, watching := watchedClient()
	kernel := fakekernel.New()
	var logs syncBuffer
	o := defaultOptions()
	o.HostnameOverride, o.HealthzBindAddress, o.MetricsBindAddress = "node-1", "127.0.0.1:0", "127.0.0.1:0"
	o.MinSyncPeriod = 0
	if err := o.complete(); err != nil {
		t.Fatal(err)
	}
	d := fakeDeps(client, kernel, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))

	ctx := runInBackground(t, &logs, buildTree(o, d).Run)
	waitWatches(t, watching, "services", "endpointslices")

	createWebService(ctx, t, client)

	waitNAT(t, kernel, "the ClusterIP and DNAT rules of ns/web", func(nat []string) bool {
		return hasRule(nat, "-d 10.96.0.10/32", "--dport 80", "-j KUBE-SVC-") && hasRule(nat, "-j DNAT --to-destination 10.244.1.5:8080")
	})
}

// runInBackground runs run until the test ends, then cancels it and fails the
// test unless it returns nil within 10 s; logs are printed if the test failed.
func runInBackground(t *testing.T, logs *syncBuffer, run func(context.Context) error) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run = %v after cancel", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("did not stop after cancel")
		}
		if t.Failed() {
			t.Log(logs.String())
		}
	})
	return ctx
}

// watchedClient is a fake apiserver that says on watching which resource a
// watch was started for. (The fake's watches miss what happens before they
// start: create objects only once the watches are in place.)
func watchedClient() (*fake.Clientset, <-chan string) {
	client := fake.NewClientset()
	watching := make(chan string, 16)
	client.PrependWatchReactor("*", func(a k8stesting.Action) (bool, k8swatch.Interface, error) {
		w, err := client.Tracker().Watch(a.GetResource(), a.GetNamespace())
		if err != nil {
			return false, nil, err
		}
		select {
		case watching <- a.GetResource().Resource:
		default:
		}
		return true, w, nil
	})
	return client, watching
}

// createWebService creates Service ns/web (ClusterIP 10.96.0.10, port 80) and
// an EndpointSlice with one endpoint, 10.244.1.5:8080.
func createWebService(ctx context.Context, t *testing.T, client *fake.Clientset) {
	t.Helper()
	createService(ctx, t, client, testService{name: "web", clusterIP: "10.96.0.10", proto: corev1.ProtocolTCP, port: 80,
		endpoint: "10.244.1.5", targetPort: 8080})
}

// testService is a ClusterIP Service of one port with one endpoint.
type testService struct {
	name, clusterIP, endpoint string
	proto                     corev1.Protocol
	port, targetPort          int32
}

// createService creates Service ns/<name> and its EndpointSlice ns/<name>-1.
func createService(ctx context.Context, t *testing.T, client *fake.Clientset, s testService) {
	t.Helper()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: s.name},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, ClusterIP: s.clusterIP, ClusterIPs: []string{s.clusterIP},
			Ports: []corev1.ServicePort{{Name: "p", Protocol: s.proto, Port: s.port}}},
	}
	portName := "p"
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: s.name + "-1", Labels: map[string]string{discoveryv1.LabelServiceName: s.name}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Protocol: &s.proto, Port: &s.targetPort}},
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{s.endpoint}}},
	}
	if _, err := client.CoreV1().Services("ns").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices("ns").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// hasRule says whether one of rules contains every part.
func hasRule(rules []string, parts ...string) bool {
	return slices.ContainsFunc(rules, func(r string) bool {
		for _, p := range parts {
			if !strings.Contains(r, p) {
				return false
			}
		}
		return true
	})
}

// waitNAT waits up to 20 s for the kernel's nat table to satisfy ok.
func waitNAT(t *testing.T, kernel *fakekernel.Kernel, what string, ok func(nat []string) bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		nat := kernel.Rules(nf.TableNAT)
		if ok(nat) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not after 20s: %s; nat holds:\n%s", what, strings.Join(nat, "\n"))
		}
	}
}

// waitWatches waits until each of resources is watched.
func waitWatches(t *testing.T, watching <-chan string, resources ...string) {
	t.Helper()
	want := map[string]bool{}
	for _, r := range resources {
		want[r] = true
	}
	timeout := time.After(20 * time.Second)
	for len(want) > 0 {
		select {
		case r := <-watching:
			delete(want, r)
		case <-timeout:
			t.Fatalf("no watch on %v after 20s", want)
		}
	}
}

// syncBuffer is a bytes.Buffer the stages may log to concurrently.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
