package main

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/supervise"
)

// TestSideStagesNeverTouchTheRulePath: a conntrack stage that fails for ever and a
// canary that cannot start are restarted, alone, for as long as it takes; render
// and commit keep running and the process does not stop. (Conntrack used to share
// render and commit's restart budget: spending it restarted them, and then the
// whole tree gave up.)
func TestSideStagesNeverTouchTheRulePath(t *testing.T) {
	var starts struct{ render, commit, conntrack, canary atomic.Int32 }
	wait := func(n *atomic.Int32) runner {
		return func(ctx context.Context) error { n.Add(1); <-ctx.Done(); return nil }
	}
	fail := func(n *atomic.Int32) runner {
		return func(context.Context) error { n.Add(1); return errors.New("broken") }
	}
	idle := func(ctx context.Context) error { <-ctx.Done(); return nil }
	r := treeRunners{watch: idle, coalesce: idle, health: idle, canary: fail(&starts.canary),
		families: []familyRunners{{family: bus.IPv4, render: wait(&starts.render), commit: wait(&starts.commit), conntrack: fail(&starts.conntrack)}}}
	opts := func(s supervise.Strategy) supervise.Options {
		// A fast backoff: the restart budget (10 a minute) is spent within the test.
		return supervise.Options{Strategy: s, Logger: slog.New(slog.DiscardHandler),
			Backoff: supervise.Backoff{Initial: time.Millisecond, Max: 2 * time.Millisecond, Jitter: -1}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- arrange(r, opts).Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for starts.conntrack.Load() < 50 || starts.canary.Load() < 50 {
		select {
		case err := <-done:
			t.Fatalf("the tree stopped after %d conntrack and %d canary failures: %v", starts.conntrack.Load(), starts.canary.Load(), err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("only %d conntrack and %d canary restarts in 10s", starts.conntrack.Load(), starts.canary.Load())
		}
		time.Sleep(time.Millisecond)
	}
	if n, m := starts.render.Load(), starts.commit.Load(); n != 1 || m != 1 {
		t.Errorf("render started %d times and commit %d while conntrack failed; want once each", n, m)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v after cancel", err)
	}
}
