package bustest

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// recorder is a testing.TB that records Fatalf and ends the goroutine, as
// testing.T does, instead of failing the test that uses it.
type recorder struct {
	testing.TB
	fatal string
}

func (r *recorder) Helper() {}

func (r *recorder) Fatalf(format string, args ...any) {
	r.fatal = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// run runs f with a recorder on its own goroutine (Fatalf ends it) and returns
// what f was failed with, "" if nothing.
func run(t *testing.T, f func(tb testing.TB)) string {
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() { defer close(done); f(r) }()
	<-done
	return r.fatal
}

func TestEventuallyWaitsForTheCondition(t *testing.T) {
	var polls atomic.Int32
	fatal := run(t, func(tb testing.TB) {
		eventuallyWithin(tb, time.Minute, func() bool { return polls.Add(1) == 3 }, "three polls")
	})
	if fatal != "" || polls.Load() != 3 {
		t.Fatalf("failed with %q after %d polls; want success on the third", fatal, polls.Load())
	}
}

func TestEventuallyFailsAtTheDeadline(t *testing.T) {
	start := time.Now()
	polls := 0
	fatal := run(t, func(tb testing.TB) {
		eventuallyWithin(tb, 50*time.Millisecond, func() bool { polls++; return false }, "the %s", "impossible")
	})
	if want := "timed out waiting for the impossible"; fatal != want || polls < 2 {
		t.Fatalf("failed with %q after %d polls; want %q after polling more than once", fatal, polls, want)
	}
	if waited := time.Since(start); waited < 50*time.Millisecond {
		t.Fatalf("gave up after %v, before its 50ms", waited)
	}
}

func TestTakeWaitsForAPut(t *testing.T) {
	m := bus.NewMailbox[int]()
	go func() { time.Sleep(10 * time.Millisecond); m.Put(7) }()
	var got int
	if fatal := run(t, func(tb testing.TB) { got = takeWithin(tb, time.Minute, m, "seven") }); fatal != "" || got != 7 {
		t.Fatalf("took %d, failed with %q; want 7", got, fatal)
	}
}

func TestTakeFailsWhenNothingComes(t *testing.T) {
	m := bus.NewMailbox[int]()
	fatal := run(t, func(tb testing.TB) { takeWithin(tb, 20*time.Millisecond, m, "value") })
	if fatal != "no value: context deadline exceeded" {
		t.Fatalf("failed with %q", fatal)
	}
}
