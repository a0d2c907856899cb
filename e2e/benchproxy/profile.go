package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// profiler saves kpipe's profiles when BENCH_PROFILE names a directory
// (kpipe then runs with --profiling: pprof on its metrics address): its heap
// where its memory matters (after the first sync, the peak; after the
// churn), and its CPU over the churn (stages are pprof labels: go tool pprof
// -tagfocus stage=commit-ipv4 ...). Each point is also logged with the
// process's resident set so far, profiles or not.
type profiler struct {
	tb   *testbed.Testbed
	ns   string
	name string // the run's name, prefixing each file
	pid  int
	on   bool // the proxy runs with profileArgs
}

func newProfiler(tb *testbed.Testbed, ns, name, proxy string, pid int) profiler {
	return profiler{tb: tb, ns: ns, name: name, pid: pid, on: len(profileArgs(proxy)) > 0}
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
	if !p.on {
		return
	}
	if err := p.save("heap", phase+".heap", 0); err != nil {
		logf("%s %s: heap profile: %v", p.name, phase, err)
	}
}

// cpu starts a CPU profile of the next seconds into the run's file suffix,
// as soon as kpipe's pprof listener answers (a process just started opens
// it within a second); the channel gives its outcome when it is saved (a
// nil channel when profiles are off).
func (p profiler) cpu(suffix string, seconds int) <-chan error {
	if !p.on {
		return nil
	}
	done := make(chan error, 1)
	go func() {
		err := p.save(fmt.Sprintf("profile?seconds=%d", seconds), suffix, seconds)
		for tries := 1; errors.Is(err, syscall.ECONNREFUSED) && tries < 50; tries++ {
			time.Sleep(20 * time.Millisecond)
			err = p.save(fmt.Sprintf("profile?seconds=%d", seconds), suffix, seconds)
		}
		done <- err
	}()
	return done
}

// save GETs the pprof profile at what, which takes seconds to take, into
// the run's file suffix.
func (p profiler) save(what, suffix string, seconds int) error {
	url := testbed.MetricsURL + "/debug/pprof/" + what
	code, body, err := p.tb.HTTPGetWithin(p.ns, url, time.Duration(seconds+30)*time.Second)
	if err == nil && code != 200 {
		err = fmt.Errorf("%s: HTTP %d: %s", url, code, body)
	}
	if err != nil {
		return err
	}
	path := filepath.Join(profileDir(), p.name+"-"+suffix)
	if err := os.WriteFile(path, body, 0o644); err != nil {
		return err
	}
	logf("%s: profile %s", p.name, path)
	return nil
}
