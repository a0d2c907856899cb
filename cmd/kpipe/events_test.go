package main

import (
	"context"
	"log/slog"
	"testing"

	"k8s.io/client-go/kubernetes/fake"

	"github.com/kpipe/kpipe/stages/commit/fakekernel"
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
	d := fakeDeps(client, fakekernel.New(), slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- buildTree(o, d).Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v after cancel", err)
		}
	}()

	e := waitNodeEvent(ctx, t, client, "Starting")
	if e.Type != "Normal" || e.ReportingController != "kube-proxy" || e.Action != "StartKubeProxy" {
		t.Errorf("Starting event: type %q controller %q action %q, want Normal kube-proxy StartKubeProxy",
			e.Type, e.ReportingController, e.Action)
	}
}
