package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/canary"
	"github.com/kpipe/kpipe/stages/commit"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/conntrack"
)

// TestBuildTreeRecordsStarting: the tree, started on a fake apiserver, records
// kube-proxy's Starting event (events.k8s.io/v1) about its Node, in namespace
// default, reported by kube-proxy.
func TestBuildTreeRecordsStarting(t *testing.T) {
	client := fake.NewClientset()
	o := defaultOptions()
	o.HostnameOverride, o.HealthzBindAddress, o.MetricsBindAddress = "node-1", "127.0.0.1:0", "127.0.0.1:0"
	if err := o.complete(); err != nil {
		t.Fatal(err)
	}
	d := deps{client: client, kernels: map[bus.Family]commit.Kernel{bus.IPv4: fakekernel.New()},
		canaries:  map[bus.Family]canary.Canaries{bus.IPv4: liveCanaries{}},
		conntrack: func() (conntrack.Clearer, error) { return noConntrack{}, nil },
		host:      hostFacts{noRandomFully: map[bus.Family]bool{}},
		log:       slog.New(slog.DiscardHandler), registry: prometheus.NewRegistry()}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- buildTree(o, d).Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v after cancel", err)
		}
	}()

	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		list, err := client.EventsV1().Events("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range list.Items {
			if e.Reason == "Starting" && e.Regarding.Kind == "Node" && e.Regarding.Name == "node-1" {
				if e.Type != "Normal" || e.ReportingController != "kube-proxy" || e.Action != "StartKubeProxy" {
					t.Errorf("Starting event: type %q controller %q action %q, want Normal kube-proxy StartKubeProxy",
						e.Type, e.ReportingController, e.Action)
				}
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no Starting event about Node node-1 in default; events: %v", list.Items)
		}
	}
}
