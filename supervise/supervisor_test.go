package supervise

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus/bustest"
)

func TestLeafRunsWithPprofLabel(t *testing.T) {
	labels := make(chan string, 2)
	label := func(ctx context.Context) error {
		v, _ := pprof.Label(ctx, "stage")
		labels <- v
		return block(ctx)
	}
	s := Tree("kpipe", fast(OneForOne),
		Leaf("render", label),
		Tree("side", fast(OneForOne), Leaf("canary", label)),
	)
	runTree(t, s)
	var got []string
	for range 2 {
		select {
		case v := <-labels:
			got = append(got, v)
		case <-time.After(hang):
			t.Fatal("stages did not start")
		}
	}
	slices.Sort(got)
	if want := []string{"canary", "render"}; !slices.Equal(got, want) {
		t.Errorf("stage labels = %q, want %q", got, want)
	}
}

func TestPanicIsAFailure(t *testing.T) {
	rec := &recorder{}
	var runs atomic.Int32
	s := Tree("kpipe", rec.opts(OneForOne), Leaf("render", func(ctx context.Context) error {
		if runs.Add(1) == 1 {
			panic("kaboom")
		}
		return block(ctx)
	}))
	stop, _ := runTree(t, s)
	restarted(t, s, "render", 1)

	st := statusOf(t, s, "render")
	if !strings.Contains(st.LastError, "kaboom") {
		t.Errorf("LastError = %q, want the panic value", st.LastError)
	}
	panics := rec.of(Panicked)
	if len(panics) != 1 || !strings.Contains(panics[0].Stack, "TestPanicIsAFailure") {
		t.Errorf("panic events = %+v, want one whose stack names the panicking function", panics)
	} else if ev := panics[0]; ev.Supervisor != "kpipe" || ev.Stage != "render" || !strings.Contains(ev.Err.Error(), "kaboom") {
		t.Errorf("panic event = %+v, want kpipe/render with the panic value", ev)
	}
	if err := stop(); err != nil {
		t.Errorf("Run = %v, want nil", err)
	}
	want := []string{"start render", "panic render", "fail render", "start render", "stop render"}
	if got := rec.take(); !slices.Equal(got, want) {
		t.Errorf("events:\n got %q\nwant %q", got, want)
	}
}

func TestPanicWithErrorWraps(t *testing.T) {
	var runs atomic.Int32
	var got atomic.Value
	o := fast(OneForOne)
	o.OnRestart = func(_ string, err error) { got.Store(err) }
	s := Tree("kpipe", o, Leaf("render", func(ctx context.Context) error {
		if runs.Add(1) == 1 {
			panic(errBoom)
		}
		return block(ctx)
	}))
	runTree(t, s)
	restarted(t, s, "render", 1)
	if err, _ := got.Load().(error); !errors.Is(err, errBoom) {
		t.Errorf("restart cause = %v, want it to wrap the panicked error", err)
	}
}

func TestReturnWhileRunningIsAFailure(t *testing.T) {
	for _, tc := range []struct {
		name    string
		err     error
		wantErr string
	}{
		{"nil", nil, errReturned.Error()},
		{"error", errBoom, "boom"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var runs atomic.Int32
			s := Tree("kpipe", fast(OneForOne), Leaf("render", func(ctx context.Context) error {
				if runs.Add(1) == 1 {
					return tc.err
				}
				return block(ctx)
			}))
			runTree(t, s)
			restarted(t, s, "render", 1)
			if got := statusOf(t, s, "render").LastError; got != tc.wantErr {
				t.Errorf("LastError = %q, want %q", got, tc.wantErr)
			}
		})
	}
}

func TestStopIsNotAFailure(t *testing.T) {
	rec := &recorder{}
	s := Tree("kpipe", rec.opts(OneForOne),
		Leaf("render", block),
		// Returning the context's error on stop is normal too.
		Leaf("commit", func(ctx context.Context) error {
			<-ctx.Done()
			return ctx.Err()
		}),
	)
	stop, _ := runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	for _, st := range s.Status() {
		if st.State != stateStopped || st.Restarts != 0 || st.LastError != "" {
			t.Errorf("after stop: %+v, want stopped, no restarts, no error", st)
		}
	}
	if n := rec.count("fail render") + rec.count("fail commit"); n != 0 {
		t.Errorf("%d failures logged for a normal stop", n)
	}
}

func TestKill(t *testing.T) {
	causes := make(chan error, 1)
	s := Tree("kpipe", fast(OneForOne),
		Leaf("health", block),
		Tree("pipeline", fast(RestForOne), Leaf("render", func(ctx context.Context) error {
			<-ctx.Done()
			select {
			case causes <- context.Cause(ctx):
			default:
			}
			return nil // as a well-behaved stage would: Kill still counts as a failure
		})),
	)
	runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")

	if err := s.Kill("render"); err != nil {
		t.Fatalf("Kill(render) = %v", err)
	}
	select {
	case cause := <-causes:
		if !errors.Is(cause, errKilled) {
			t.Errorf("context cause = %v, want killed", cause)
		}
	case <-time.After(hang):
		t.Fatal("killed stage's context was not cancelled")
	}
	restarted(t, s, "render", 1)
	if st := statusOf(t, s, "render"); st.LastError != "killed" || st.Restarts != 1 {
		t.Errorf("render after Kill: %+v, want 1 restart and LastError killed", st)
	}
	if st := statusOf(t, s, "health"); st.Restarts != 0 {
		t.Errorf("health restarted %d times, want 0", st.Restarts)
	}
	if err := s.Kill("nope"); !errors.Is(err, errUnknown) {
		t.Errorf("Kill(nope) = %v, want unknown stage", err)
	}
	if err := s.Kill("pipeline"); !errors.Is(err, errUnknown) {
		t.Errorf("Kill(pipeline) = %v, want unknown stage (only leaves can be killed)", err)
	}
}

func TestKillStageNotRunning(t *testing.T) {
	o := fast(OneForOne)
	o.Backoff = Backoff{Initial: time.Hour, Max: 2 * time.Hour}
	s := Tree("kpipe", o, Leaf("render", block))
	if err := s.Kill("render"); !errors.Is(err, errNotRunning) {
		t.Errorf("Kill before Run = %v, want not running", err)
	}
	runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "running")
	if err := s.Kill("render"); err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, func() bool { return statusOf(t, s, "render").State == stateBackoff }, "backoff")
	if err := s.Kill("render"); !errors.Is(err, errNotRunning) {
		t.Errorf("Kill during backoff = %v, want not running", err)
	}
}

func TestOneForOneRestartsOnlyTheFailedChild(t *testing.T) {
	rec := &recorder{}
	s := Tree("kpipe", rec.opts(OneForOne),
		Leaf("a", block), Leaf("b", block), Leaf("c", block))
	stop, _ := runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := s.Kill("b"); err != nil {
		t.Fatal(err)
	}
	restarted(t, s, "b", 1)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"start a", "start b", "start c",
		"fail b", "start b",
		"stop c", "stop b", "stop a",
	}
	if got := rec.take(); !slices.Equal(got, want) {
		t.Errorf("events:\n got %q\nwant %q", got, want)
	}
	for _, st := range s.Status() {
		if want := map[string]int{"b": 1}[st.Name]; st.Restarts != want {
			t.Errorf("%s restarted %d times, want %d", st.Name, st.Restarts, want)
		}
	}
}

func TestRestForOneOrder(t *testing.T) {
	rec := &recorder{}
	exits := &lines{}
	s := Tree("kpipe", rec.opts(RestForOne),
		blocker("a", exits), blocker("b", exits), blocker("c", exits), blocker("d", exits))
	stop, _ := runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := s.Kill("b"); err != nil {
		t.Fatal(err)
	}
	restarted(t, s, "d", 1)
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	want := []string{
		"start a", "start b", "start c", "start d",
		// b fails: the ones after it stop in reverse order, then all start again in order.
		"fail b", "stop d", "stop c", "start b", "start c", "start d",
		"stop d", "stop c", "stop b", "stop a",
	}
	if got := rec.take(); !slices.Equal(got, want) {
		t.Errorf("supervisor events:\n got %q\nwant %q", got, want)
	}
	// Each stop waits for the child to return before the next one is cancelled, so
	// the children themselves see the same order.
	wantExits := []string{"exit b", "exit d", "exit c", "exit d", "exit c", "exit b", "exit a"}
	if got := exits.get(); !slices.Equal(got, wantExits) {
		t.Errorf("children saw:\n got %q\nwant %q", got, wantExits)
	}
	for _, st := range s.Status() {
		if want := map[string]int{"b": 1, "c": 1, "d": 1}[st.Name]; st.Restarts != want {
			t.Errorf("%s restarted %d times, want %d", st.Name, st.Restarts, want)
		}
	}
	if st := statusOf(t, s, "c"); st.LastError != "" {
		t.Errorf("c restarted along with b has LastError %q, want none of its own", st.LastError)
	}
}

func TestOnRestartOncePerLeafRestart(t *testing.T) {
	var mu sync.Mutex
	got := map[string][]error{}
	o := fast(RestForOne)
	o.OnRestart = func(stage string, err error) {
		mu.Lock()
		got[stage] = append(got[stage], err)
		mu.Unlock()
	}
	s := Tree("kpipe", o, Leaf("a", block), Leaf("b", block), Leaf("c", block))
	runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := s.Kill("b"); err != nil {
		t.Fatal(err)
	}
	restarted(t, s, "c", 1)

	mu.Lock()
	defer mu.Unlock()
	if len(got["a"]) != 0 || len(got["b"]) != 1 || len(got["c"]) != 1 {
		t.Fatalf("OnRestart calls = %v, want one each for b and c", got)
	}
	if !errors.Is(got["b"][0], errKilled) || !errors.Is(got["c"][0], errKilled) {
		t.Errorf("OnRestart causes = %v, want both to wrap killed", got)
	}
}

func TestStopInReverseOrderAndWait(t *testing.T) {
	exits := &lines{}
	var returned atomic.Int32
	slow := func(name string) Child {
		return Leaf(name, func(ctx context.Context) error {
			<-ctx.Done()
			exits.add("exit %s", name)
			time.Sleep(5 * time.Millisecond) // Run must wait for this
			returned.Add(1)
			return nil
		})
	}
	s := Tree("kpipe", fast(OneForOne),
		slow("a"), slow("b"),
		Tree("pipeline", fast(RestForOne), slow("c"), slow("d")),
		slow("e"),
	)
	stop, _ := runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if n := returned.Load(); n != 5 {
		t.Errorf("Run returned while %d of 5 children were still running", 5-n)
	}
	want := []string{"exit e", "exit d", "exit c", "exit b", "exit a"}
	if got := exits.get(); !slices.Equal(got, want) {
		t.Errorf("stop order:\n got %q\nwant %q", got, want)
	}
}

func TestBackoffResetsAfterStableRun(t *testing.T) {
	rec := &recorder{}
	o := rec.opts(OneForOne)
	// No jitter, so the reported delays are exact. A run counts as stable after Max.
	o.Backoff = Backoff{Initial: time.Millisecond, Max: 500 * time.Millisecond, Factor: 2, Jitter: -1}
	var runs atomic.Int32
	s := Tree("kpipe", o, Leaf("commit", func(ctx context.Context) error {
		switch runs.Add(1) {
		case 1, 2, 3: // fail fast: the backoff grows
			return errBoom
		case 4: // a stable run (longer than Max) before failing: the backoff starts over
			select {
			case <-time.After(600 * time.Millisecond):
				return errBoom
			case <-ctx.Done():
				return nil
			}
		default:
			return block(ctx)
		}
	}))
	runTree(t, s)
	restarted(t, s, "commit", 4)

	var got []time.Duration
	for _, ev := range rec.of(Failed) {
		got = append(got, ev.Delay)
	}
	want := []time.Duration{time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond, time.Millisecond}
	if !slices.Equal(got, want) {
		t.Errorf("restart delays = %v, want %v", got, want)
	}
}

func TestBudgetEscalatesThroughTwoLevels(t *testing.T) {
	rec := &recorder{}
	var mu sync.Mutex
	restarts := map[string]int{}
	onRestart := func(stage string, err error) {
		mu.Lock()
		restarts[stage]++
		mu.Unlock()
	}
	rootOpts := rec.opts(OneForOne)
	rootOpts.MaxRestarts = 2
	rootOpts.OnRestart = onRestart
	subOpts := rec.opts(RestForOne)
	subOpts.MaxRestarts = 1
	subOpts.OnRestart = onRestart
	s := Tree("kpipe", rootOpts,
		Tree("pipeline", subOpts,
			Leaf("watch", block),
			Leaf("render", func(ctx context.Context) error { return errBoom }),
		),
		Leaf("health", block),
	)

	stop, done := runTree(t, s)
	select {
	case <-done:
	case <-time.After(hang):
		t.Fatal("root Run did not give up")
	}
	err := stop()
	if err == nil {
		t.Fatal("root Run = nil, want an escalation error")
	}
	if !errors.Is(err, errBoom) || !strings.Contains(err.Error(), "pipeline") || !strings.Contains(err.Error(), "render") {
		t.Errorf("root Run = %q, want it to name pipeline, render and wrap boom", err)
	}

	// pipeline allows 1 restart, so each of its 3 runs sees render fail twice and
	// escalates; kpipe allows 2 restarts of pipeline and gives up at the third failure.
	if n := rec.count("escalate render"); n != 3 {
		t.Errorf("pipeline escalated %d times, want 3", n)
	}
	if n := rec.count("escalate pipeline"); n != 1 {
		t.Errorf("kpipe escalated %d times, want 1", n)
	}
	for _, ev := range rec.of(Escalated) {
		wantSup := map[string]string{"render": "pipeline", "pipeline": "kpipe"}[ev.Stage]
		if ev.Supervisor != wantSup || !errors.Is(ev.Err, errBoom) {
			t.Errorf("escalation %+v: want supervisor %q and an error wrapping boom", ev, wantSup)
		}
	}
	want := map[string]int{"render": 5, "watch": 2, "health": 0}
	for _, st := range s.Status() {
		if st.Restarts != want[st.Name] || st.State != stateStopped {
			t.Errorf("%+v: want %d restarts and stopped", st, want[st.Name])
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if restarts["render"] != 5 || restarts["watch"] != 2 || restarts["health"] != 0 || len(restarts) != 2 {
		t.Errorf("OnRestart calls = %v, want render:5 watch:2", restarts)
	}
}

func TestParentRestartsEscalatedSubtreePerItsStrategy(t *testing.T) {
	rec := &recorder{}
	sub := rec.opts(OneForOne)
	sub.MaxRestarts = 1
	s := Tree("kpipe", rec.opts(RestForOne),
		Tree("pipeline", sub, Leaf("watch", block), Leaf("render", block)),
		Leaf("after", block),
	)
	stop, _ := runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := s.Kill("render"); err != nil {
		t.Fatal(err)
	}
	restarted(t, s, "render", 1)
	if err := s.Kill("render"); err != nil { // over pipeline's budget
		t.Fatal(err)
	}
	restarted(t, s, "after", 1)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil: kpipe's budget was not exhausted", err)
	}

	want := []string{
		// A subtree is started depth-first before the next sibling.
		"start pipeline", "start watch", "start render", "start after",
		"fail render", "start render",
		"escalate render", "stop watch", // pipeline gives up and stops its children
		// kpipe restarts pipeline per RestForOne: "after" stops and starts again after it.
		"fail pipeline", "stop after", "start pipeline", "start watch", "start render", "start after",
		"stop after", "stop render", "stop watch", "stop pipeline",
	}
	if got := rec.take(); !slices.Equal(got, want) {
		t.Errorf("events:\n got %q\nwant %q", got, want)
	}
	wantRestarts := map[string]int{"watch": 1, "render": 2, "after": 1}
	for _, st := range s.Status() {
		if st.Restarts != wantRestarts[st.Name] {
			t.Errorf("%s restarted %d times, want %d", st.Name, st.Restarts, wantRestarts[st.Name])
		}
	}
}

func TestNoGoroutineLeak(t *testing.T) {
	base := runtime.NumGoroutine()
	var restarts atomic.Int32
	o := fast(OneForOne)
	o.OnRestart = func(string, error) { restarts.Add(1) }
	sub := fast(RestForOne)
	sub.OnRestart = o.OnRestart
	s := Tree("kpipe", o,
		Leaf("steady", block),
		Leaf("flaky", func(ctx context.Context) error { return errBoom }),
		Tree("pipeline", sub,
			Leaf("watch", block),
			Leaf("panicky", func(ctx context.Context) error { panic("again") }),
			Leaf("after", block),
		),
	)
	stop, _ := runTree(t, s)
	bustest.Eventually(t, func() bool { return restarts.Load() >= 200 }, "200 restarts")
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, func() bool { return runtime.NumGoroutine() <= base }, "goroutines to settle")
}

func TestStatusConcurrentWithRestarts(t *testing.T) {
	var restarts atomic.Int32
	o := fast(OneForOne)
	o.OnRestart = func(string, error) { restarts.Add(1) }
	s := Tree("kpipe", o,
		Leaf("flaky", func(ctx context.Context) error { return errBoom }),
		Tree("pipeline", fast(RestForOne), Leaf("watch", block), Leaf("render", block)),
	)
	stop, _ := runTree(t, s)

	var wg sync.WaitGroup
	quit := make(chan struct{})
	for range 3 {
		wg.Go(func() {
			last := map[string]int{}
			for {
				select {
				case <-quit:
					return
				default:
				}
				sts := s.Status()
				if _, err := json.Marshal(sts); err != nil {
					t.Error(err)
					return
				}
				for _, st := range sts {
					if st.Restarts < last[st.Name] {
						t.Errorf("%s: Restarts went down from %d to %d", st.Name, last[st.Name], st.Restarts)
					}
					last[st.Name] = st.Restarts
				}
				_ = s.Kill("watch") // may find it restarting: that's fine
				time.Sleep(100 * time.Microsecond)
			}
		})
	}
	bustest.Eventually(t, func() bool { return restarts.Load() >= 50 }, "50 restarts")
	close(quit)
	wg.Wait()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	st := statusOf(t, s, "flaky")
	if st.Restarts < 50 || st.LastError != "boom" {
		t.Errorf("flaky: %+v, want >= 50 restarts and LastError boom", st)
	}
}

func TestStatus(t *testing.T) {
	s := Tree("kpipe", fast(OneForOne),
		Tree("pipeline", fast(RestForOne), Leaf("watch", block), Leaf("render", block)),
		Leaf("health", block),
	)
	want := []Status{
		{Name: "watch", Path: "kpipe/pipeline/watch", State: stateStopped},
		{Name: "render", Path: "kpipe/pipeline/render", State: stateStopped},
		{Name: "health", Path: "kpipe/health", State: stateStopped},
	}
	if got := s.Status(); !slices.Equal(got, want) {
		t.Errorf("before Run:\n got %+v\nwant %+v", got, want)
	}
	before := time.Now()
	runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	for _, st := range s.Status() {
		if st.LastStart.Before(before) {
			t.Errorf("%s: LastStart %v is before Run", st.Name, st.LastStart)
		}
	}
}

func TestRunTwiceAtOnce(t *testing.T) {
	s := Tree("kpipe", fast(OneForOne), Leaf("render", block))
	runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "running")
	if err := s.Run(context.Background()); err == nil {
		t.Error("second concurrent Run = nil, want an error")
	}
}

func TestTreeRejectsBadNames(t *testing.T) {
	for name, build := range map[string]func(){
		"duplicate leaf": func() {
			Tree("kpipe", Options{}, Leaf("render", block),
				Tree("side", Options{}, Leaf("render", block)))
		},
		"empty":     func() { Tree("kpipe", Options{}, Leaf("", block)) },
		"slash":     func() { Tree("kpipe", Options{}, Leaf("a/b", block)) },
		"tree name": func() { Tree("", Options{}) },
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("Tree did not panic")
				}
			}()
			build()
		})
	}
}

func TestOptionsDefaults(t *testing.T) {
	o := Options{}.withDefaults()
	if o.MaxRestarts != 10 || o.Window != time.Minute || o.Logger != slog.Default() {
		t.Errorf("defaults = %+v", o)
	}
	if o := (Options{MaxRestarts: -1}).withDefaults(); o.MaxRestarts != 0 {
		t.Errorf("MaxRestarts -1 -> %d, want 0 (no restarts)", o.MaxRestarts)
	}
}

// TestNeverEscalateRestartsForever: a supervisor with NeverEscalate keeps
// restarting a child that always fails, long past the restart budget, and never
// fails itself (side stages must not stop the process).
func TestNeverEscalateRestartsForever(t *testing.T) {
	var runs atomic.Int32
	opts := Options{Strategy: OneForOne, MaxRestarts: 2, Window: time.Hour, NeverEscalate: true,
		Backoff: Backoff{Initial: time.Millisecond, Max: 2 * time.Millisecond, Jitter: -1}, Logger: slog.New(slog.DiscardHandler)}
	s := Tree("side", opts, Leaf("flaky", func(ctx context.Context) error {
		runs.Add(1)
		return errors.New("broken")
	}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	deadline := time.Now().Add(5 * time.Second)
	for runs.Load() < 20 {
		select {
		case err := <-done:
			t.Fatalf("supervisor gave up after %d runs: %v", runs.Load(), err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("only %d runs in 5s", runs.Load())
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v after cancel; want nil", err)
	}
}

// TestEventFields: each supervisor reports its own children's events, with who,
// why and when: a first start without cause, a failure with its error and backoff,
// a restart with the failure as its cause.
func TestEventFields(t *testing.T) {
	root, sub := &recorder{}, &recorder{}
	s := Tree("kpipe", root.opts(OneForOne),
		Tree("pipeline", sub.opts(RestForOne), Leaf("render", block)),
		Leaf("health", block),
	)
	before := time.Now()
	stop, _ := runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	if err := s.Kill("render"); err != nil {
		t.Fatal(err)
	}
	restarted(t, s, "render", 1)
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	if got, want := root.take(), []string{"start pipeline", "start health", "stop health", "stop pipeline"}; !slices.Equal(got, want) {
		t.Errorf("kpipe's events:\n got %q\nwant %q", got, want)
	}
	if got, want := sub.take(), []string{"start render", "fail render", "start render", "stop render"}; !slices.Equal(got, want) {
		t.Errorf("pipeline's events:\n got %q\nwant %q", got, want)
	}
	for _, ev := range root.all {
		if ev.Supervisor != "kpipe" {
			t.Errorf("%+v: want supervisor kpipe", ev)
		}
	}
	evs := sub.all // Run has returned: no more events
	last := before
	for _, ev := range evs {
		if ev.Supervisor != "pipeline" {
			t.Errorf("%+v: want supervisor pipeline", ev)
		}
		if ev.At.Before(last) || ev.At.After(time.Now()) {
			t.Errorf("%+v: At is not the time of the event (previous %v)", ev, last)
		}
		last = ev.At
	}
	first, failed, again := evs[0], evs[1], evs[2]
	if first.Restart || first.Err != nil {
		t.Errorf("first start %+v: want no restart and no cause", first)
	}
	if !errors.Is(failed.Err, errKilled) || failed.Attempt != 1 || failed.Delay <= 0 || failed.Delay > fast(OneForOne).Backoff.Max {
		t.Errorf("failure %+v: want killed, attempt 1, a delay within the backoff", failed)
	}
	if !again.Restart || !errors.Is(again.Err, errKilled) || again.At.Before(failed.At.Add(failed.Delay)) {
		t.Errorf("restart %+v after %+v: want a restart caused by killed, after the delay", again, failed)
	}
}

func TestEventKindString(t *testing.T) {
	for k, want := range map[EventKind]string{Started: "started", Stopped: "stopped", Failed: "failed",
		Panicked: "panicked", Escalated: "escalated", 0: "unknown"} {
		if got := k.String(); got != want {
			t.Errorf("EventKind(%d) = %q, want %q", int(k), got, want)
		}
	}
}
