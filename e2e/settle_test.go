package e2e

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// The negative helpers (eventuallyDropped, ...) must not pass on a lucky
// first try: a fake request that is refused every other time never settles.
func TestNegativeHelpersRejectAFlappingOutcome(t *testing.T) {
	n := 0
	answer := testbed.Answer{Endpoint: "10.244.0.11", SeenSource: "10.244.0.21:40000"}
	flapping := func(ns, addr string) (testbed.Answer, error) {
		n++
		if n%2 == 1 {
			return testbed.Answer{}, testbed.ErrRefused
		}
		return answer, nil
	}
	refused := func(a testbed.Answer, err error) error {
		if err == nil {
			return errAnswered
		}
		return nil
	}
	// Rejected at the second request, the first answered one (a timeout
	// would return no outcomes).
	seen, err := settle(time.Second, dialer{dial: flapping}, "kpe2e-x-client", "10.96.0.10:80", refused)
	want := []string{outcome(testbed.Answer{}, testbed.ErrRefused), outcome(answer, nil)}
	if err == nil || !slices.Equal(seen, want) {
		t.Fatalf("a refused/answered/refused/... series: %v, outcomes %q; want an error after %q", err, seen, want)
	}
	t.Logf("flapping series rejected: %v", err)

	always := func(ns, addr string) (testbed.Answer, error) { return testbed.Answer{}, testbed.ErrRefused }
	seen, err = settle(time.Second, dialer{dial: always}, "kpe2e-x-client", "10.96.0.10:80", refused)
	if err != nil || len(seen) != settleRequests {
		t.Fatalf("a steadily refused series: %v, outcomes %v", err, seen)
	}
}

var errAnswered = errors.New("answered")
