package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// nodeEventsSince lists the events with reason about the test bed's Node in
// namespace default (where kube-proxy's events about its Node go) dated from since.
func (e *env) nodeEventsSince(reason string, since time.Time) ([]eventsv1.Event, error) {
	ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
	defer cancel()
	list, err := tb.Client().EventsV1().Events("default").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var out []eventsv1.Event
	for _, ev := range list.Items {
		if ev.Reason == reason && ev.Regarding.Kind == "Node" && ev.Regarding.Name == testbed.NodeName && !ev.EventTime.Time.Before(since) {
			out = append(out, ev)
		}
	}
	return out, nil
}

// waitNodeEvent waits for an event with reason about the Node dated from since.
func (e *env) waitNodeEvent(reason string, since time.Time) eventsv1.Event {
	e.t.Helper()
	var got eventsv1.Event
	testbed.Eventually(e.t, 30*time.Second, func() error {
		evs, err := e.nodeEventsSince(reason, since)
		if err != nil {
			return err
		}
		if len(evs) == 0 {
			return fmt.Errorf("no %s event about Node %s since %s", reason, testbed.NodeName, since.Format(time.RFC3339))
		}
		got = evs[0]
		return nil
	})
	return got
}

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
	ev := e.waitNodeEvent("Starting", started)
	if ev.Type != "Normal" || ev.ReportingController != "kube-proxy" || ev.Action != "StartKubeProxy" {
		t.Fatalf("Starting event %s: type %q controller %q action %q, want Normal kube-proxy StartKubeProxy",
			ev.Name, ev.Type, ev.ReportingController, ev.Action)
	}
}

const conntrackMaxSysctl = "/proc/sys/net/netfilter/nf_conntrack_max"

// A node set-up step that fails (nf_conntrack_max is global: the node's network
// namespace cannot write it) is a Warning event on the Node once kpipe has its
// client; a start whose set-up all succeeds (--conntrack-max-per-core=0 leaves
// nf_conntrack_max alone) records none.
func TestEventsNodeSetupFailure(t *testing.T) {
	e := setup(t)
	e.restoreKpipeAtEnd()
	if out, err := tb.Exec(tb.NodeNS, "sh", "-c", "cat "+conntrackMaxSysctl+" > "+conntrackMaxSysctl); err == nil {
		t.Fatalf("%s is writable in the node namespace: this test needs a set-up step that fails (%s)", conntrackMaxSysctl, out)
	}
	// The OOM score kpipe inherits: lowering it needs CAP_SYS_RESOURCE, which a
	// test machine in a container may lack.
	oom, err := os.ReadFile("/proc/self/oom_score_adj")
	if err != nil {
		t.Fatal(err)
	}
	oomFlag := "--oom-score-adj=" + strings.TrimSpace(string(oom))

	started := time.Now() // the events of earlier starts are older
	if err := e.k.Restart("--conntrack-max-per-core=0", oomFlag); err != nil {
		t.Fatalf("restart kpipe: %v", err)
	}
	e.waitNodeEvent("Starting", started)
	for range 6 { // the set-up events are recorded right after Starting
		if evs, err := e.nodeEventsSince("NodeSetupFailed", started); err != nil || len(evs) > 0 {
			t.Fatalf("set-up events after a start with nothing failing: %v %v", evs, err)
		}
		time.Sleep(500 * time.Millisecond)
	}

	started = time.Now()
	if err := e.k.Restart(oomFlag); err != nil { // the default 32768 per core: nf_conntrack_max is written
		t.Fatalf("restart kpipe: %v", err)
	}
	ev := e.waitNodeEvent("NodeSetupFailed", started)
	if ev.Type != "Warning" || ev.ReportingController != "kube-proxy" || ev.Action != "SetSysctl/net/netfilter/nf_conntrack_max" ||
		!strings.Contains(ev.Note, "nf_conntrack_max") {
		t.Fatalf("set-up event %s: type %q controller %q action %q note %q, want a Warning from kube-proxy about nf_conntrack_max",
			ev.Name, ev.Type, ev.ReportingController, ev.Action, ev.Note)
	}
	t.Logf("set-up event: %s", ev.Note)
	if evs, err := e.nodeEventsSince("NodeSetupFailed", started); err != nil || len(evs) != 1 {
		t.Errorf("%d set-up events (%v), want 1 (only nf_conntrack_max fails): %v", len(evs), err, evs)
	}
}
