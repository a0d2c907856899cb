package netnstest

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

// recordingTB stands in for a test, to see whether Unavailable skips or fails it.
type recordingTB struct {
	testing.TB
	skipped, failed bool
	msg             string
}

func (r *recordingTB) Helper()          {}
func (r *recordingTB) Skip(args ...any) { r.skipped, r.msg = true, fmt.Sprint(args...) }
func (r *recordingTB) Fatalf(format string, a ...any) {
	r.failed, r.msg = true, fmt.Sprintf(format, a...)
}

func TestUnavailableFailsInCIAndSkipsElsewhere(t *testing.T) {
	for _, tt := range []struct {
		ci   string
		fail bool
	}{{"true", true}, {"1", true}, {"TRUE", true}, {"", false}, {"false", false}, {"0", false}, {"yes-please", false}} {
		t.Run("CI="+tt.ci, func(t *testing.T) {
			t.Setenv("CI", tt.ci)
			r := &recordingTB{TB: t}
			Unavailable(r, "needs root")
			if r.failed != tt.fail || r.skipped == tt.fail {
				t.Errorf("failed %v, skipped %v; want failed %v (and skipped the opposite)", r.failed, r.skipped, tt.fail)
			}
			if r.msg == "" {
				t.Error("no reason given")
			}
		})
	}
}

// setShort sets -short for the rest of the test.
func setShort(t *testing.T, short bool) {
	was := flag.Lookup("test.short").Value.String()
	if err := flag.Set("test.short", strconv.FormatBool(short)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { flag.Set("test.short", was) })
}

// Under -short nothing that needs root and the kernel runs, root or not, and
// that is a skip even in CI: the fast loop leaves them out by choice.
func TestShortSkipsWhatNeedsRootEvenInCI(t *testing.T) {
	setShort(t, true)
	t.Setenv("CI", "true")
	r := &recordingTB{TB: t}
	RequireRoot(r)
	if !r.skipped || r.failed || !strings.Contains(r.msg, "-short") {
		t.Errorf("skipped %v, failed %v, %q; want a skip naming -short", r.skipped, r.failed, r.msg)
	}
	if code, unavailable := MainUnavailable(); !unavailable || code != 0 {
		t.Errorf("MainUnavailable() = %d, %v; want 0, true", code, unavailable)
	}
}

// Without -short, root runs them; anyone else skips them, or fails in CI.
func TestWithoutShortRootDecides(t *testing.T) {
	setShort(t, false)
	t.Setenv("CI", "true")
	r := &recordingTB{TB: t}
	RequireRoot(r)
	code, unavailable := MainUnavailable()
	if os.Geteuid() == 0 {
		if r.skipped || r.failed || unavailable || code != 0 {
			t.Errorf("as root: skipped %v, failed %v (%q), MainUnavailable() = %d, %v; want the tests run", r.skipped, r.failed, r.msg, code, unavailable)
		}
		return
	}
	if !r.failed || !strings.Contains(r.msg, "needs root") || !unavailable || code != 1 {
		t.Errorf("not root, CI=true: failed %v (%q), MainUnavailable() = %d, %v; want failures naming root", r.failed, r.msg, code, unavailable)
	}
}
