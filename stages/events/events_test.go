package events

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/events"

	"github.com/kpipe/kpipe/bus"
)

// startingEvents lists the Starting events about Node node in "default", where
// kube-proxy's events about its (cluster-scoped) Node go.
func startingEvents(t *testing.T, client *fake.Clientset, node string) []eventsv1.Event {
	return nodeEvents(t, client, node, ReasonStarting)
}

// nodeEvents lists the events with reason about Node node in "default".
func nodeEvents(t *testing.T, client *fake.Clientset, node, reason string) []eventsv1.Event {
	t.Helper()
	list, err := client.EventsV1().Events("default").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []eventsv1.Event
	for _, e := range list.Items {
		if e.Reason == reason && e.Regarding.Kind == "Node" && e.Regarding.Name == node {
			out = append(out, e)
		}
	}
	return out
}

// TestRunRecordsStarting: Run records kube-proxy's Normal Starting event on the
// Node, reported by kube-proxy, in namespace default.
func TestRunRecordsStarting(t *testing.T) {
	client := fake.NewClientset()
	b, rec, _ := NewRecorder(client)
	defer b.Shutdown()
	s := NewStage(Params{Broadcaster: b, Recorder: rec, Node: "node-a", Families: []bus.Family{bus.IPv4}, Board: bus.NewBoard()})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	var got []eventsv1.Event
	for deadline := time.Now().Add(10 * time.Second); len(got) == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no Starting event about Node node-a in namespace default")
		}
		got = startingEvents(t, client, "node-a")
	}
	e := got[0]
	if e.Type != "Normal" || e.Action != ActionStart || e.ReportingController != "kube-proxy" {
		t.Errorf("Starting event = type %q action %q controller %q, want Normal StartKubeProxy kube-proxy",
			e.Type, e.Action, e.ReportingController)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run = %v", err)
	}
}

// TestRestartedRunDoesNotRecordStarting: a supervisor restart of the stage is not
// a new start of the process.
func TestRestartedRunDoesNotRecordStarting(t *testing.T) {
	b, _, _ := NewRecorder(fake.NewClientset())
	defer b.Shutdown()
	rec := events.NewFakeRecorder(10)
	s := NewStage(Params{Broadcaster: b, Recorder: rec, Node: "node-a", Board: bus.NewBoard()})
	for run := range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		time.Sleep(50 * time.Millisecond)
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run %d = %v", run, err)
		}
	}
	if n := len(rec.Events); n != 1 {
		t.Fatalf("%d events after 3 Runs, want 1 (Starting)", n)
	}
	if e := <-rec.Events; !strings.HasPrefix(e, "Normal Starting") {
		t.Fatalf("event %q, want Normal Starting", e)
	}
}

// failCommit and syncCommit are what the commit stage publishes on a failed and
// a successful commit.
func failCommit(b *bus.Board, f bus.Family, msg string) {
	b.Reporter(bus.Commit.Of(f)).Failed(errors.New(msg), time.Now())
}

func syncCommit(b *bus.Board, f bus.Family, at time.Time) {
	b.Update(bus.Commit.Of(f), func(r *bus.Report) { r.LastSync = at })
}

// TestCheckSyncsWarnsAfterFailuresInARow: one Warning when a family's commits
// failed FailedSyncs times in a row, none for fewer, none repeated in the same
// streak, and a new one for a new streak after a successful commit.
func TestCheckSyncsWarnsAfterFailuresInARow(t *testing.T) {
	board := bus.NewBoard()
	rec := events.NewFakeRecorder(100)
	s := NewStage(Params{Broadcaster: nil, Recorder: rec, Node: "node-a", Families: []bus.Family{bus.IPv4, bus.IPv6}, Board: board})
	warnings := func() []string {
		var out []string
		for {
			select {
			case e := <-rec.Events:
				out = append(out, e)
			default:
				return out
			}
		}
	}

	failCommit(board, bus.IPv4, "restore: exit 1")
	failCommit(board, bus.IPv4, "restore: exit 1")
	s.checkSyncs()
	if w := warnings(); len(w) != 0 {
		t.Fatalf("after 2 failures: %q, want no event", w)
	}
	failCommit(board, bus.IPv4, "restore: exit 4")
	s.checkSyncs()
	w := warnings()
	if len(w) != 1 || !strings.HasPrefix(w[0], "Warning "+ReasonSyncFailed+" ") || !strings.Contains(w[0], "restore: exit 4") {
		t.Fatalf("after 3 failures: %q, want one Warning %s with the last error", w, ReasonSyncFailed)
	}
	for range 3 {
		failCommit(board, bus.IPv4, "restore: exit 1")
		s.checkSyncs()
		if w := warnings(); len(w) != 0 {
			t.Fatalf("more failures in the same streak: %q, want no new event", w)
		}
	}
	// A successful commit ends the streak; two failures after it are not three.
	syncCommit(board, bus.IPv4, time.Now())
	s.checkSyncs()
	failCommit(board, bus.IPv4, "x")
	failCommit(board, bus.IPv4, "x")
	s.checkSyncs()
	if w := warnings(); len(w) != 0 {
		t.Fatalf("2 failures after a success: %q, want no event", w)
	}
	failCommit(board, bus.IPv4, "x")
	s.checkSyncs()
	if w := warnings(); len(w) != 1 {
		t.Fatalf("a new streak of 3: %q, want one Warning", w)
	}
}

// TestRunRecordsSetupFailures: each node set-up step that failed before the
// client existed is one Warning on the Node, recorded by the first Run only.
func TestRunRecordsSetupFailures(t *testing.T) {
	client := fake.NewClientset()
	b, rec, _ := NewRecorder(client)
	defer b.Shutdown()
	failures := []SetupFailure{
		{Step: "SetSysctl/net/netfilter/nf_conntrack_max", Note: "could not set net/netfilter/nf_conntrack_max to 131072: permission denied"},
		{Step: "SetSysctl/net/netfilter/nf_conntrack_tcp_timeout_established", Note: "could not set it: read-only file system"},
		{Step: "SetOOMScoreAdj", Note: "could not set oom_score_adj to -999: permission denied"},
	}
	s := NewStage(Params{Broadcaster: b, Recorder: rec, Node: "node-a", SetupFailures: failures, Board: bus.NewBoard()})
	for run := range 2 { // the second Run is a supervisor restart
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		for deadline := time.Now().Add(10 * time.Second); len(nodeEvents(t, client, "node-a", ReasonSetupFailed)) < len(failures); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("run %d: %d %s events, want %d", run, len(nodeEvents(t, client, "node-a", ReasonSetupFailed)), ReasonSetupFailed, len(failures))
			}
		}
		time.Sleep(200 * time.Millisecond) // time for a duplicate to arrive
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run %d = %v", run, err)
		}
	}
	got := nodeEvents(t, client, "node-a", ReasonSetupFailed)
	if len(got) != len(failures) {
		t.Fatalf("%d %s events after 2 Runs, want %d: %v", len(got), ReasonSetupFailed, len(failures), got)
	}
	notes := map[string]string{}
	for _, e := range got {
		if e.Type != "Warning" || e.ReportingController != "kube-proxy" || e.Series != nil {
			t.Errorf("event %q: type %q controller %q series %v, want a Warning from kube-proxy, no series",
				e.Note, e.Type, e.ReportingController, e.Series)
		}
		notes[e.Action] = e.Note
	}
	for _, f := range failures {
		if notes[f.Step] != f.Note {
			t.Errorf("event with action %q: note %q, want %q", f.Step, notes[f.Step], f.Note)
		}
	}
}
