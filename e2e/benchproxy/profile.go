package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// profiler saves kpipe's heap profile at the points of a run where its memory
// matters (after the first sync, the peak; after the churn), when BENCH_PROFILE
// names a directory: kpipe then runs with --profiling (pprof on its metrics
// address). Each point is also logged with the process's resident set so far.
type profiler struct {
	tb    *testbed.Testbed
	ns    string
	name  string // the run's name, prefixing each file
	proxy string
	pid   int
}

func profileDir() string { return os.Getenv("BENCH_PROFILE") }

// profileArgs are the extra flags proxy needs for profiles to be taken.
func profileArgs(proxy string) []string {
	if proxy != "kpipe" || profileDir() == "" {
		return nil
	}
	return []string{"--profiling"}
}

// at logs the resident set at phase and saves the heap profile there.
func (p profiler) at(phase string) {
	if u, err := readUsage(p.pid); err == nil {
		logf("%s %s: peak RSS so far %.1f MiB", p.name, phase, float64(u.peakRSSKiB)/1024)
	}
	if len(profileArgs(p.proxy)) == 0 {
		return
	}
	code, body, err := p.tb.HTTPGet(p.ns, "http://127.0.0.1:10249/debug/pprof/heap")
	if err != nil || code != 200 {
		logf("%s %s: heap profile: HTTP %d, %v", p.name, phase, code, err)
		return
	}
	path := filepath.Join(profileDir(), fmt.Sprintf("%s-%s.heap", p.name, phase))
	if err := os.WriteFile(path, body, 0o644); err != nil {
		logf("%s %s: %v", p.name, phase, err)
		return
	}
	logf("%s %s: heap profile %s", p.name, phase, path)
}
