package netnstest

import (
	"fmt"
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
