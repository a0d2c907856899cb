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
)

// hang bounds every wait so that a bug fails a test instead of hanging the suite.
const hang = 10 * time.Second

var errBoom = errors.New("boom")

// recorder is a slog.Handler that keeps the supervisors' start/stop/fail events in
// the order they were logged, as "start a", "stop b", ... The supervisor logs a
// start before launching the child and a stop after the child returned, on its
// own goroutine, so this order is the order of its decisions.
type recorder struct {
	mu     sync.Mutex
	events []string
	delays []time.Duration // restart_in of each failure
	stacks []string        // stack of each panic
}

var eventKinds = map[string]string{
	msgStarting:  "start",
	msgStopped:   "stop",
	msgFailed:    "fail",
	msgEscalated: "escalate",
	msgPanicked:  "panic",
}

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *recorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *recorder) WithGroup(string) slog.Handler            { return r }

func (r *recorder) Handle(_ context.Context, rec slog.Record) error {
	attrs := map[string]slog.Value{}
	rec.Attrs(func(a slog.Attr) bool {
		attrs[a.Key] = a.Value
		return true
	})
	r.mu.Lock()
	defer r.mu.Unlock()
	if kind, ok := eventKinds[rec.Message]; ok {
		r.events = append(r.events, kind+" "+attrs["stage"].String())
	}
	if v, ok := attrs["restart_in"]; ok {
		r.delays = append(r.delays, v.Duration())
	}
	if v, ok := attrs["stack"]; ok {
		r.stacks = append(r.stacks, v.String())
	}
	return nil
}

func (r *recorder) logger() *slog.Logger { return slog.New(r) }

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

// fast are options with tiny backoffs and a budget that tests do not exhaust by accident.
func fast(st Strategy, log *slog.Logger) Options {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return Options{
		Strategy:    st,
		Backoff:     Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		MaxRestarts: 1_000_000,
		Window:      time.Hour,
		Logger:      log,
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

// eventually polls cond until it holds or the hang timeout passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
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
	eventually(t, fmt.Sprintf("%s restarted %d times and running", stage, n), func() bool {
		st := statusOf(t, s, stage)
		return st.Restarts >= n && st.State == stateRunning
	})
}
