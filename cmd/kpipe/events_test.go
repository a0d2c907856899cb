package main

import (
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
	var logs syncBuffer
	d := fakeDeps(client, fakekernel.New(), slog.New(slog.NewTextHandler(&logs, nil)))
	ctx := runInBackground(t, &logs, buildTree(o, d).Run)

	e := waitNodeEvent(ctx, t, client, "Starting")
	if e.Type != "Normal" || e.ReportingController != "kube-proxy" || e.Action != "StartKubeProxy" {
		t.Errorf("Starting event: type %q controller %q action %q, want Normal kube-proxy StartKubeProxy",
			e.Type, e.ReportingController, e.Action)
	}
}
