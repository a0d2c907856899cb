// Package supervise runs kpipe's stages under a supervisor tree: a failed stage is
// restarted with backoff, alone (OneForOne) or with the stages after it
// (RestForOne), and too many restarts in a window escalate to the parent.
package supervise

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Strategy says which children a supervisor restarts when one fails.
type Strategy int

const (
	OneForOne  Strategy = iota // a failed child restarts alone
	RestForOne                 // a failed child restarts together with every child after it (in order)
)

// Child is a stage or a sub-tree.
type Child interface {
	Name() string
	Run(ctx context.Context) error
}

type leaf struct {
	name string
	run  func(ctx context.Context) error
}

func (l leaf) Name() string                  { return l.name }
func (l leaf) Run(ctx context.Context) error { return l.run(ctx) }

// Leaf makes a Child from a stage's name and Run method.
func Leaf(name string, run func(ctx context.Context) error) Child { return leaf{name, run} }

// Options configure one supervisor; zero fields take their defaults.
type Options struct {
	Strategy Strategy
	Backoff  Backoff
	// MaxRestarts is how many restarts (of any child) are allowed in Window before the
	// supervisor gives up and fails itself; default 10, negative for none.
	MaxRestarts int
	Window      time.Duration // default 1 minute
	// NeverEscalate restarts failed children for ever (with backoff) instead of
	// giving up when the budget is spent: for stages whose failures must not stop
	// the ones that keep the rules in sync.
	NeverEscalate bool
	Logger        *slog.Logger // default slog.Default()
	// OnRestart, if set, is called once per restart of a leaf of this supervisor
	// (including leaves restarted along with a sibling or with their whole subtree),
	// with the failure that caused it. It runs on the supervising goroutine: keep it quick.
	OnRestart func(stage string, err error)
	// OnEvent, if set, is called for every Event about this supervisor's children
	// (not those of its subtrees, which have their own Options), in the order the
	// supervisor decided them, after the event is logged. It runs synchronously on
	// the supervising goroutine, which waits for it: keep it quick and do not call
	// back into the supervisor.
	OnEvent func(Event)
}

func (o Options) withDefaults() Options {
	o.Backoff = o.Backoff.withDefaults()
	switch {
	case o.MaxRestarts == 0:
		o.MaxRestarts = 10
	case o.MaxRestarts < 0:
		o.MaxRestarts = 0
	}
	if o.Window <= 0 {
		o.Window = time.Minute
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o
}

// Leaf states, as shown by Status.
const (
	stateStarting = "starting"
	stateRunning  = "running"
	stateBackoff  = "backoff"
	stateStopped  = "stopped"
)

var (
	errKilled     = errors.New("killed")
	errReturned   = errors.New("returned while its supervisor was running")
	errStopped    = errors.New("stopped by its supervisor")
	errUnknown    = errors.New("unknown stage")
	errNotRunning = errors.New("stage is not running")
)

// Status describes one leaf of the tree.
type Status struct {
	Name      string    `json:"name"`
	Path      string    `json:"path"`  // e.g. "kpipe/pipeline/render"
	State     string    `json:"state"` // "starting" | "running" | "backoff" | "stopped"
	Restarts  int       `json:"restarts"`
	LastError string    `json:"lastError,omitempty"`
	LastStart time.Time `json:"lastStart"`
}

// Supervisor runs its children and restarts them when they fail. It is itself a
// Child, so trees nest.
type Supervisor struct {
	name     string
	opts     Options
	children []*child // fixed by Tree
	running  atomic.Bool
}

// child is a Supervisor's record of one of its children.
type child struct {
	Child
	sub *Supervisor // non-nil when the child is a subtree

	mu        sync.Mutex // guards the fields below, read by Status and Kill
	state     string
	restarts  int
	lastErr   string
	lastStart time.Time
	cancel    context.CancelCauseFunc // set while the child's goroutine is live

	// The fields below belong to the goroutine running Supervisor.Run.
	started   bool      // it has run before, so its next start is a restart
	live      bool      // its goroutine has not been reaped yet
	stopping  bool      // the supervisor asked it to stop: its exit is no failure
	startedAt time.Time // copy of lastStart, for the stable-run check
	due       time.Time // when to start it again; zero if not scheduled
	attempt   int       // backoff attempt, back to 0 after a stable run
	failure   error     // an exit that was a failure, not yet handled
	cause     error     // why it will be started next time
}

func (c *child) set(f func(c *child)) {
	c.mu.Lock()
	f(c)
	c.mu.Unlock()
}

// Tree makes a supervisor; it is itself a Child, so trees nest. It panics if a
// name is empty or contains "/", or if two leaves in the tree share a name: Kill,
// Status paths and the restart metrics address leaves by name.
func Tree(name string, opts Options, children ...Child) *Supervisor {
	s := &Supervisor{name: name, opts: opts.withDefaults()}
	for _, ch := range children {
		c := &child{Child: ch, state: stateStopped}
		c.sub, _ = ch.(*Supervisor)
		s.children = append(s.children, c)
	}
	seen := map[string]bool{}
	s.walk(func(c *child) {
		if seen[c.Name()] {
			panic(fmt.Sprintf("supervise: tree %q: two stages named %q", name, c.Name()))
		}
		seen[c.Name()] = true
	})
	for _, n := range append([]string{name}, s.names()...) {
		if n == "" || strings.Contains(n, "/") {
			panic(fmt.Sprintf("supervise: tree %q: bad name %q", name, n))
		}
	}
	return s
}

// walk calls f for every leaf, depth-first in start order.
func (s *Supervisor) walk(f func(c *child)) {
	for _, c := range s.children {
		if c.sub != nil {
			c.sub.walk(f)
		} else {
			f(c)
		}
	}
}

func (s *Supervisor) names() []string {
	var out []string
	for _, c := range s.children {
		out = append(out, c.Name())
	}
	return out
}

// Name returns the supervisor's name.
func (s *Supervisor) Name() string { return s.name }

// Run starts the children in order and supervises them until ctx ends (then stops
// them in reverse order, waits for them, and returns nil) or until the restart
// budget is exhausted (then stops all children and returns an error naming the
// child and its last error). Each child gets its own context carrying ctx's values;
// the supervisor cancels it to stop the child (so children stop one by one, in
// reverse order, rather than all at once when ctx ends). A supervisor runs once at
// a time: a concurrent Run returns an error.
func (s *Supervisor) Run(ctx context.Context) error { return s.run(ctx, nil, func() {}) }

// run is Run for a supervisor started by its parent: cause is why (nil for a first
// start), and ready is called once every child has been started, so that a parent
// starts its next child only after the whole subtree (depth-first start order).
func (s *Supervisor) run(ctx context.Context, cause error, ready func()) error {
	if !s.running.CompareAndSwap(false, true) {
		return fmt.Errorf("supervisor %s: already running", s.name)
	}
	defer s.running.Store(false)
	r := &runner{
		s:   s,
		ctx: ctx,
		// Each child has at most one live goroutine, which sends one exit: sends never block.
		exits: make(chan exit, len(s.children)),
		log:   s.opts.Logger.With("supervisor", s.name),
	}
	for _, c := range s.children {
		c.attempt, c.failure, c.due = 0, nil, time.Time{}
		r.start(c, cause)
	}
	ready()
	return r.loop()
}

// runner is the state of one Run of a supervisor.
type runner struct {
	s      *Supervisor
	ctx    context.Context
	exits  chan exit
	log    *slog.Logger
	budget []time.Time // times of the restarts within the window
}

type exit struct {
	c     *child
	ctx   context.Context
	err   error
	stack string // set if the child panicked
}

func (r *runner) loop() error {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		if r.ctx.Err() != nil {
			r.stopAll()
			return nil
		}
		if err := r.handleFailures(); err != nil {
			r.stopAll()
			return err
		}
		var wake <-chan time.Time
		if next, ok := r.nextDue(); ok {
			timer.Reset(time.Until(next))
			wake = timer.C
		} else {
			timer.Stop()
		}
		select {
		case <-r.ctx.Done():
		case e := <-r.exits:
			r.reap(e)
		case <-wake:
			r.startDue()
		}
	}
}

// start launches c in its own goroutine.
func (r *runner) start(c *child, cause error) {
	// The child's context keeps ctx's values but not its cancellation: the
	// supervisor cancels each child itself, so that it can stop them in reverse order.
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(r.ctx))
	now := time.Now()
	restart := c.started
	c.started, c.live, c.stopping, c.startedAt = true, true, false, now
	c.due, c.cause = time.Time{}, nil
	c.set(func(c *child) {
		c.cancel, c.state, c.lastStart = cancel, stateStarting, now
		if restart {
			c.restarts++
		}
	})
	r.emit(c, Event{Kind: Started, Restart: restart, Err: cause})

	ready := make(chan struct{})
	go r.s.runChild(ctx, c, cause, sync.OnceFunc(func() { close(ready) }), r.exits)
	if c.sub != nil {
		<-ready
	}
}

// runChild runs c until it returns or panics, and reports its exit.
func (s *Supervisor) runChild(ctx context.Context, c *child, cause error, ready func(), exits chan<- exit) {
	var err error
	var stack string
	defer func() { exits <- exit{c: c, ctx: ctx, err: err, stack: stack} }()
	defer ready() // in case a subtree failed before it was ready
	defer func() {
		if v := recover(); v != nil {
			stack = string(debug.Stack()) // reported by the supervising goroutine
			if e, ok := v.(error); ok {
				err = fmt.Errorf("panic: %w", e)
			} else {
				err = fmt.Errorf("panic: %v", v)
			}
		}
	}()
	c.set(func(c *child) { c.state = stateRunning })
	if c.sub != nil {
		err = c.sub.run(ctx, cause, ready)
		return
	}
	// The label lets CPU profiles be filtered with -tagfocus stage=<name>.
	pprof.Do(ctx, pprof.Labels("stage", c.Name()), func(ctx context.Context) {
		err = c.Run(ctx)
	})
}

// reap records the exit of a child's goroutine and decides whether it was a failure.
func (r *runner) reap(e exit) {
	c := e.c
	c.live = false
	var cancel context.CancelCauseFunc
	var cause error
	c.set(func(c *child) {
		// Read under the lock so that a concurrent Kill either counts or reports "not running".
		cause = context.Cause(e.ctx)
		cancel, c.cancel = c.cancel, nil
		c.state = stateStopped
	})
	cancel(errStopped) // release the context
	if e.stack != "" {
		r.emit(c, Event{Kind: Panicked, Err: e.err, Stack: e.stack})
	}
	if c.stopping || r.ctx.Err() != nil {
		// Asked to stop, or the whole supervisor is stopping: not a failure.
		return
	}
	err := e.err
	switch {
	case errors.Is(cause, errKilled):
		err = errKilled
	case err == nil:
		err = errReturned
	}
	c.failure = err
	c.set(func(c *child) { c.lastErr = err.Error() })
}

// handleFailures restarts failed children per the strategy, or returns an error
// when the restart budget is exhausted. Lower children go first: under RestForOne
// their restart covers the later ones.
func (r *runner) handleFailures() error {
	for {
		i := -1
		for j, c := range r.s.children {
			if c.failure != nil {
				i = j
				break
			}
		}
		if i < 0 {
			return nil
		}
		c := r.s.children[i]
		err := c.failure
		c.failure = nil
		now := time.Now()
		if !r.spend(now) {
			o := r.s.opts
			r.emit(c, Event{Kind: Escalated, Err: err})
			return fmt.Errorf("supervisor %s: %s failed too often (more than %d restarts in %s): %w",
				r.s.name, c.Name(), o.MaxRestarts, o.Window, err)
		}
		b := r.s.opts.Backoff
		if now.Sub(c.startedAt) > b.Max {
			c.attempt = 0 // a stable run: start the backoff over
		}
		c.attempt++
		delay := b.Delay(c.attempt, nil)
		r.emit(c, Event{Kind: Failed, Err: err, Delay: delay, Attempt: c.attempt, At: now})
		if r.s.opts.Strategy == RestForOne {
			later := r.s.children[i+1:]
			for k := len(later) - 1; k >= 0; k-- {
				r.stop(later[k])
				later[k].cause = fmt.Errorf("restarted after %s failed: %w", c.Name(), err)
			}
		}
		c.due, c.cause = now.Add(delay), err
		c.set(func(c *child) { c.state = stateBackoff })
	}
}

// spend takes one restart from the budget, or says there is none left.
func (r *runner) spend(now time.Time) bool {
	if r.s.opts.NeverEscalate {
		return true
	}
	cutoff := now.Add(-r.s.opts.Window)
	for len(r.budget) > 0 && !r.budget[0].After(cutoff) {
		r.budget = r.budget[1:]
	}
	if len(r.budget) >= r.s.opts.MaxRestarts {
		return false
	}
	r.budget = append(r.budget, now)
	return true
}

func (r *runner) nextDue() (time.Time, bool) {
	var next time.Time
	for _, c := range r.s.children {
		if !c.due.IsZero() && (next.IsZero() || c.due.Before(next)) {
			next = c.due
		}
	}
	return next, !next.IsZero()
}

// startDue starts the children whose backoff is over and, under RestForOne, the
// children after them, in order.
func (r *runner) startDue() {
	now := time.Now()
	for i, c := range r.s.children {
		if c.due.IsZero() || c.due.After(now) {
			continue
		}
		r.start(c, c.cause)
		if r.s.opts.Strategy == RestForOne {
			for _, later := range r.s.children[i+1:] {
				if !later.live && later.due.IsZero() {
					r.start(later, later.cause)
				}
			}
		}
	}
}

// stop cancels c, if it is live, and waits for it; exits of other children that
// arrive meanwhile are reaped and handled later. A pending restart of c is dropped.
func (r *runner) stop(c *child) {
	c.due, c.failure = time.Time{}, nil
	if c.live {
		c.stopping = true
		c.mu.Lock()
		c.cancel(errStopped)
		c.mu.Unlock()
		for c.live {
			r.reap(<-r.exits)
		}
		r.emit(c, Event{Kind: Stopped})
	}
	c.set(func(c *child) { c.state = stateStopped })
}

// stopAll stops every child in reverse start order.
func (r *runner) stopAll() {
	for i := len(r.s.children) - 1; i >= 0; i-- {
		r.stop(r.s.children[i])
	}
}

// Kill makes the named leaf (searched through the whole tree) fail as if it had
// returned the error "killed", for fault-injection tests. It fails for an unknown
// name and for a leaf that is not running (waiting out a backoff, or stopped).
func (s *Supervisor) Kill(name string) error {
	var found *child
	s.walk(func(c *child) {
		if found == nil && c.Name() == name {
			found = c
		}
	})
	if found == nil {
		return fmt.Errorf("kill %q: %w", name, errUnknown)
	}
	found.mu.Lock()
	defer found.mu.Unlock()
	if found.cancel == nil {
		return fmt.Errorf("kill %q: %w", name, errNotRunning)
	}
	found.cancel(errKilled)
	return nil
}

// Status lists every leaf in the tree, depth-first in start order.
func (s *Supervisor) Status() []Status {
	return s.status(s.name, []Status{})
}

func (s *Supervisor) status(path string, out []Status) []Status {
	for _, c := range s.children {
		p := path + "/" + c.Name()
		if c.sub != nil {
			out = c.sub.status(p, out)
			continue
		}
		c.mu.Lock()
		out = append(out, Status{
			Name:      c.Name(),
			Path:      p,
			State:     c.state,
			Restarts:  c.restarts,
			LastError: c.lastErr,
			LastStart: c.lastStart,
		})
		c.mu.Unlock()
	}
	return out
}
