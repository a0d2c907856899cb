// Package bustest holds what tests of the stages and of their supervisor share:
// waiting, with a deadline, for a value a stage puts in a mailbox or for a
// condition another goroutine makes true. It sits under bus because bus is
// the bottom of kpipe's imports (every stage's tests can import it, and it
// imports nothing of kpipe's but bus).
package bustest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// Patience bounds how long a test waits for something that must happen: long
// enough for a loaded machine under the race detector, short enough that a
// hang fails the test rather than go test's timeout.
const Patience = 10 * time.Second

// pollEvery is how often Eventually checks its condition.
const pollEvery = time.Millisecond

// Eventually polls cond until it holds, failing the test as "timed out waiting
// for" and what format and args say, once Patience has passed.
func Eventually(tb testing.TB, cond func() bool, format string, args ...any) {
	tb.Helper()
	eventuallyWithin(tb, Patience, cond, format, args...)
}

func eventuallyWithin(tb testing.TB, patience time.Duration, cond func() bool, format string, args ...any) {
	tb.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out waiting for %s", fmt.Sprintf(format, args...))
		}
		time.Sleep(pollEvery)
	}
}

// Take takes m's next value, failing the test as "no what" if none comes
// within Patience.
func Take[T any](tb testing.TB, m *bus.Mailbox[T], what string) T {
	tb.Helper()
	return takeWithin(tb, Patience, m, what)
}

func takeWithin[T any](tb testing.TB, patience time.Duration, m *bus.Mailbox[T], what string) T {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	v, err := m.Take(ctx)
	if err != nil {
		tb.Fatalf("no %s: %v", what, err)
	}
	return v
}
