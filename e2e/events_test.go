package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// TestEventsStarting: a started kpipe records kube-proxy's Starting event on its
// Node in the apiserver — events.k8s.io/v1, namespace default, reported by
// kube-proxy — so `kubectl events` and dashboards made for kube-proxy see it.
func TestEventsStarting(t *testing.T) {
	e := setup(t)
	// A fresh start, dated: the event must come from this process.
	started := time.Now().Add(-time.Second)
	if err := tb.Kpipe().Restart(); err != nil {
		t.Fatalf("restart kpipe: %v", err)
	}
	testbed.Eventually(t, 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
		defer cancel()
		list, err := tb.Client().EventsV1().Events("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, ev := range list.Items {
			if ev.Reason != "Starting" || ev.Regarding.Kind != "Node" || ev.Regarding.Name != testbed.NodeName ||
				ev.EventTime.Time.Before(started) {
				continue
			}
			if ev.Type != "Normal" || ev.ReportingController != "kube-proxy" || ev.Action != "StartKubeProxy" {
				t.Fatalf("Starting event %s: type %q controller %q action %q, want Normal kube-proxy StartKubeProxy",
					ev.Name, ev.Type, ev.ReportingController, ev.Action)
			}
			return nil
		}
		return fmt.Errorf("no Starting event about Node %s since %s among %d events in default",
			testbed.NodeName, started.Format(time.RFC3339), len(list.Items))
	})
}
