package supervise

import "time"

// EventKind says what happened to a child of a supervisor.
type EventKind int

const (
	// Started: the supervisor started the child (Restart says whether it ran before;
	// Err is then why it is restarted).
	Started EventKind = iota + 1
	// Stopped: the supervisor asked the child to stop and it returned. A child that
	// ends on its own reports Failed instead.
	Stopped
	// Failed: the child returned, panicked or was killed while its supervisor was
	// running (Err); it will be restarted after Delay (its Attempt-th backoff).
	Failed
	// Panicked: the child panicked (Err wraps the panic value, Stack is the
	// goroutine's stack). Unless its supervisor was stopping it, Failed follows.
	Panicked
	// Escalated: the child failed (Err) with the restart budget spent: the
	// supervisor stops all its children and fails itself.
	Escalated
)

var eventKindNames = map[EventKind]string{
	Started:   "started",
	Stopped:   "stopped",
	Failed:    "failed",
	Panicked:  "panicked",
	Escalated: "escalated",
}

func (k EventKind) String() string {
	if s, ok := eventKindNames[k]; ok {
		return s
	}
	return "unknown"
}

// Event is something a supervisor did with, or saw of, one of its children. A
// child that is a subtree is named by the subtree's name.
type Event struct {
	Kind       EventKind
	Supervisor string        // the supervisor's name
	Stage      string        // the child's name
	Err        error         // Failed, Panicked, Escalated: the failure; Started: why it restarts
	Restart    bool          // Started: the child ran before
	Delay      time.Duration // Failed: how long until the restart
	Attempt    int           // Failed: the backoff attempt (1 after a stable run)
	Stack      string        // Panicked: the stack of the panicking goroutine
	At         time.Time     // when it happened; for Failed the restart is due at At+Delay
}

// Log messages, for operators; programs subscribe to events (Options.OnEvent).
const (
	msgStarting  = "stage starting"
	msgStopped   = "stage stopped"
	msgFailed    = "stage failed"
	msgPanicked  = "stage panicked"
	msgEscalated = "restart budget exhausted"
)

// emit reports ev about child c: it logs it, then calls the OnRestart and OnEvent
// hooks. It runs on the supervising goroutine.
func (r *runner) emit(c *child, ev Event) {
	o := r.s.opts
	ev.Supervisor, ev.Stage = r.s.name, c.Name()
	if ev.At.IsZero() {
		ev.At = time.Now()
	}
	r.logEvent(ev)
	if ev.Kind == Started && ev.Restart && c.sub == nil && o.OnRestart != nil {
		o.OnRestart(ev.Stage, ev.Err)
	}
	if o.OnEvent != nil {
		o.OnEvent(ev)
	}
}

func (r *runner) logEvent(ev Event) {
	switch ev.Kind {
	case Started:
		r.log.Debug(msgStarting, "stage", ev.Stage, "restart", ev.Restart)
	case Stopped:
		r.log.Debug(msgStopped, "stage", ev.Stage)
	case Failed:
		r.log.Error(msgFailed, "stage", ev.Stage, "err", ev.Err, "restart_in", ev.Delay, "attempt", ev.Attempt)
	case Panicked:
		r.log.Error(msgPanicked, "stage", ev.Stage, "err", ev.Err, "stack", ev.Stack)
	case Escalated:
		o := r.s.opts
		r.log.Error(msgEscalated, "stage", ev.Stage, "err", ev.Err,
			"max_restarts", o.MaxRestarts, "window", o.Window)
	default:
		r.log.Error("unknown supervisor event", "kind", int(ev.Kind), "stage", ev.Stage)
	}
}
