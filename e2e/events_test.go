package e2e

import (
	"testing"
	"time"
)

// TestEventsStarting: a started kpipe records kube-proxy's Starting event on its
// Node in the apiserver — events.k8s.io/v1, namespace default, reported by
// kube-proxy — so `kubectl events` and dashboards made for kube-proxy see it.
func TestEventsStarting(t *testing.T) {
	setup(t)
	// A fresh start, dated: the event must come from this process.
	started := time.Now().Add(-time.Second)
	if err := tb.Kpipe().Restart(); err != nil {
		t.Fatalf("restart kpipe: %v", err)
	}
	ev := waitNodeEvent(t, "Starting", started)
	if ev.Type != "Normal" || ev.Action != "StartKubeProxy" {
		t.Fatalf("Starting event %s: type %q action %q, want Normal StartKubeProxy", ev.Name, ev.Type, ev.Action)
	}
}
