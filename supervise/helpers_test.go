package supervise

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus/bustest"
)

// hang bounds every wait so that a bug fails a test instead of hanging the suite.
const hang = 10 * time.Second

var errBoom = errors.New("boom")

// recorder subscribes to the supervisors' events (Options.OnEvent) and keeps them
// in order, as "start a", "stop b", ... Each supervisor reports a start before
// launching the child and a stop after the child returned, on its own goroutine,
// so this order is the order of its decisions.
type recorder struct {
	mu     sync.Mutex
	events []string
	all    []Event // every event, in order
}

var eventNames = map[EventKind]string{
	Started:   "start",
	Stopped:   "stop",
	Failed:    "fail",
	Escalated: "escalate",
	Panicked:  "panic",
}

func (r *recorder) record(ev Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, eventNames[ev.Kind]+" "+ev.Stage)
	r.all = append(r.all, ev)
}

// of returns the events of one kind so far.
func (r *recorder) of(kind EventKind) []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Event
	for _, ev := range r.all {
		if ev.Kind == kind {
			out = append(out, ev)
		}
	}
	return out
}

// opts are fast options that report their events to r.
func (r *recorder) opts(st Strategy) Options {
	o := fast(st)
	o.OnEvent = r.record
	return o
}

// take returns the events so far and forgets them.
func (r *recorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.events
	r.events = nil
	return out
}

func (r *recorder) count(event string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.events {
		if e == event {
			n++
		}
	}
	return n
}

// lines is a goroutine-safe list of strings, for children to record what they saw.
type lines struct {
	mu sync.Mutex
	l  []string
}

func (l *lines) add(format string, args ...any) {
	l.mu.Lock()
	l.l = append(l.l, fmt.Sprintf(format, args...))
	l.mu.Unlock()
}

func (l *lines) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.l)
}

// fast are options with tiny backoffs and a budget that tests do not exhaust by
// accident. They log nothing: tests watch events (recorder), never log lines.
func fast(st Strategy) Options {
	return Options{
		Strategy:    st,
		Backoff:     Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		MaxRestarts: 1_000_000,
		Window:      time.Hour,
		Logger:      slog.New(slog.DiscardHandler),
	}
}

// block is a well-behaved stage: it runs until its context ends.
func block(ctx context.Context) error {
	<-ctx.Done()
	return nil
}

// blocker is a stage that records when it is told to stop.
func blocker(name string, exits *lines) Child {
	return Leaf(name, func(ctx context.Context) error {
		<-ctx.Done()
		exits.add("exit %s", name)
		return nil
	})
}

// runTree runs s in the background. done is closed when Run returns; stop cancels
// Run's context, waits for Run and returns its result. stop is also called at cleanup.
func runTree(t *testing.T, s *Supervisor) (stop func() error, done <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan struct{})
	var err error
	go func() {
		defer close(ch)
		err = s.Run(ctx)
	}()
	stop = func() error {
		cancel()
		select {
		case <-ch:
		case <-time.After(hang):
			t.Fatalf("%s: Run did not return after its context was cancelled", s.Name())
		}
		return err
	}
	t.Cleanup(func() { stop() })
	return stop, ch
}

func statusOf(t *testing.T, s *Supervisor, name string) Status {
	t.Helper()
	for _, st := range s.Status() {
		if st.Name == name {
			return st
		}
	}
	t.Fatalf("no stage %q in %+v", name, s.Status())
	return Status{}
}

// running says whether every leaf of s is running.
func running(s *Supervisor) bool {
	for _, st := range s.Status() {
		if st.State != stateRunning {
			return false
		}
	}
	return true
}

// restarted waits until stage has been restarted n times and is running again.
func restarted(t *testing.T, s *Supervisor, stage string, n int) {
	t.Helper()
	bustest.Eventually(t, func() bool {
		st := statusOf(t, s, stage)
		return st.Restarts >= n && st.State == stateRunning
	}, "%s restarted %d times and running", stage, n)
}
