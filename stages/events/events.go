// Package events is the events stage: it records kube-proxy's events on this
// node's Node (events.k8s.io/v1, in namespace "default", reported by "kube-proxy"
// so dashboards and `kubectl events` filters made for kube-proxy match): a Normal
// "Starting" event when the process starts, a Warning for each node set-up step
// that failed before the client existed, and a Warning when a family's rules
// keep failing to sync. It also holds kube-proxy's Warnings other parts of kpipe
// record: a healthz or metrics port bindAddressHardFail requires (on the Node),
// a healthCheckNodePort that cannot be bound (on the Service).
package events

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"

	"github.com/kpipe/kpipe/bus"
)

// Name is the stage's name (supervisor leaf, log attribute, board entry).
const Name bus.StageName = "events"

// The reasons and actions of the events, as kube-proxy spells them where it has one.
const (
	ReportingController = "kube-proxy"
	ReasonStarting      = "Starting" // kube-proxy's start event
	ActionStart         = "StartKubeProxy"
	// ReasonSyncFailed has no kube-proxy counterpart (kube-proxy only logs failed
	// syncs): a Warning after FailedSyncs commits of a family failed in a row.
	ReasonSyncFailed = "SyncProxyRulesFailed"
	ActionSync       = "SyncProxyRules"
	// ReasonSetupFailed: a node set-up step failed (see RecordSetupFailure).
	// kube-proxy's one set-up Warning is "readOnlySysFS" (it cannot size the
	// conntrack table); it exits on other sysctl failures and only logs a failed
	// OOM score, where kpipe goes on and warns.
	ReasonSetupFailed = "NodeSetupFailed"
	// kube-proxy's Warnings on the Node when, with bindAddressHardFail, its healthz
	// or metrics server cannot start (it exits after), with action ActionStart.
	ReasonHealthzFailed = "FailedToStartProxierHealthcheck"
	ReasonMetricsFailed = "FailedToStartMetricServer"
	// ReasonServiceHealthcheckFailed: kube-proxy's Warning on a Service whose
	// healthCheckNodePort cannot be bound.
	ReasonServiceHealthcheckFailed = "FailedToStartServiceHealthcheck"
	ActionListen                   = "Listen"
	// ReasonReloadFailed: the config file changed into one kpipe rejects; it keeps
	// running on the previous configuration (kube-proxy would exit instead).
	ReasonReloadFailed = "ConfigReloadFailed"
	ActionReload       = "ReloadConfig"
)

const (
	// FailedSyncs is how many failed commits in a row make a Warning.
	FailedSyncs = 3
	// pollInterval is how often the board is read for failing commits.
	pollInterval = time.Second
)

// NewRecorder makes kube-proxy's recorder: an events.k8s.io/v1 broadcaster writing
// to client, a recorder reporting as "kube-proxy", and what the broadcaster has
// written. The broadcaster sends nothing until the stage's Run starts it.
func NewRecorder(client kubernetes.Interface) (events.EventBroadcaster, events.EventRecorder, *Written) {
	w := &Written{reasons: map[string]bool{}, changed: make(chan struct{})}
	b := events.NewBroadcaster(writtenSink{events.EventSinkImpl{Interface: client.EventsV1()}, w})
	return b, b.NewRecorder(scheme.Scheme, ReportingController), w
}

// Written follows the events a broadcaster wrote to the apiserver, by reason: a
// process about to exit waits for its last event there, as the broadcaster writes
// in the background.
type Written struct {
	mu      sync.Mutex
	reasons map[string]bool
	changed chan struct{} // closed, and replaced, at each write
}

// Wait waits until an event with reason has been written; false if ctx ended first.
func (w *Written) Wait(ctx context.Context, reason string) bool {
	for {
		w.mu.Lock()
		done, changed := w.reasons[reason], w.changed
		w.mu.Unlock()
		if done {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-changed:
		}
	}
}

func (w *Written) add(ev *eventsv1.Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.reasons[ev.Reason] = true
	close(w.changed)
	w.changed = make(chan struct{})
}

// writtenSink is the apiserver's sink, telling Written of each event it wrote.
type writtenSink struct {
	events.EventSinkImpl
	written *Written
}

func (s writtenSink) Create(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	return s.wrote(s.EventSinkImpl.Create(ctx, ev))
}

func (s writtenSink) Update(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	return s.wrote(s.EventSinkImpl.Update(ctx, ev))
}

func (s writtenSink) Patch(ctx context.Context, ev *eventsv1.Event, patch []byte) (*eventsv1.Event, error) {
	return s.wrote(s.EventSinkImpl.Patch(ctx, ev, patch))
}

func (s writtenSink) wrote(ev *eventsv1.Event, err error) (*eventsv1.Event, error) {
	if err == nil && ev != nil {
		s.written.add(ev)
	}
	return ev, err
}

// NodeRef is the object kube-proxy's events are about: the Node, with its name as
// UID, as kube-proxy refers to it.
func NodeRef(node string) *corev1.ObjectReference {
	return &corev1.ObjectReference{Kind: "Node", Name: node, UID: types.UID(node)}
}

// RecordServerFailure records kube-proxy's Warning reason (ReasonHealthzFailed or
// ReasonMetricsFailed) on the Node, err's text as its note.
func RecordServerFailure(rec events.EventRecorder, node, reason string, err error) {
	rec.Eventf(NodeRef(node), nil, corev1.EventTypeWarning, reason, ActionStart, "%s", err)
}

// RecordServiceHealthcheckFailure records kube-proxy's Warning on the Service
// (referred to as kube-proxy does, "namespace/name" as UID) whose
// healthCheckNodePort port could not be bound on node.
func RecordServiceHealthcheckFailure(rec events.EventRecorder, node, namespace, name string, port int32, err error) {
	nsn := namespace + "/" + name
	ref := &corev1.ObjectReference{Kind: "Service", Namespace: namespace, Name: name, UID: types.UID(nsn)}
	rec.Eventf(ref, nil, corev1.EventTypeWarning, ReasonServiceHealthcheckFailed, ActionListen,
		"node %s failed to start healthcheck %q on port %d: %v", node, nsn, port, err)
}

// SetupFailure is a node set-up step that failed.
type SetupFailure struct {
	// Step names the step, machine-readable ("SetSysctl/net/netfilter/nf_conntrack_max"):
	// the event's action. One per step, as the recorder merges events that differ
	// only in their note into one event's series.
	Step string
	// Note says what was tried and why it failed.
	Note string
}

// RecordSetupFailure records a Warning that the node set-up step failed.
func RecordSetupFailure(rec events.EventRecorder, node string, f SetupFailure) {
	rec.Eventf(NodeRef(node), nil, corev1.EventTypeWarning, ReasonSetupFailed, f.Step, "%s", f.Note)
}

// RecordReloadFailure records a Warning that the config file at path was
// rejected.
func RecordReloadFailure(rec events.EventRecorder, node, path string, err error) {
	rec.Eventf(NodeRef(node), nil, corev1.EventTypeWarning, ReasonReloadFailed, ActionReload,
		"%s rejected, previous configuration kept: %v", path, err)
}

// Params wire the events stage.
type Params struct {
	Broadcaster events.EventBroadcaster
	Recorder    events.EventRecorder
	Node        string
	// SetupFailures are the node set-up steps that failed before the client
	// existed: the first Run records a Warning for each.
	SetupFailures []SetupFailure
	// Families are the families whose commit stages are watched on Board.
	Families []bus.Family
	Board    *bus.Board // required
	Env      bus.Env
}

// Stage is the events stage. Run may be called again after it returns (the
// supervisor's restart); the Starting event is recorded by the first Run only.
type Stage struct {
	p       Params
	log     *slog.Logger
	started bool
	streaks map[bus.Family]*streak
	poll    time.Duration
}

// streak follows one family's failed commits since its last successful one.
type streak struct {
	lastSync     time.Time
	errorsAtSync uint64 // the commit stage's error count when lastSync was seen
	warned       bool   // a Warning was recorded for this streak
}

// NewStage makes the events stage.
func NewStage(p Params) *Stage {
	log := p.Env.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	bus.MustBoard(p.Board, "the events stage")
	s := &Stage{p: p, log: log, streaks: map[bus.Family]*streak{}, poll: pollInterval}
	for _, f := range p.Families {
		s.streaks[f] = &streak{}
	}
	return s
}

// Run sends the recorded events to the apiserver until ctx ends, records Starting
// and the set-up failures (first Run), and warns of families whose commits keep failing.
func (s *Stage) Run(ctx context.Context) error {
	if err := s.p.Broadcaster.StartRecordingToSinkWithContext(ctx); err != nil {
		return fmt.Errorf("start recording events: %w", err)
	}
	if !s.started {
		s.started = true
		s.p.Recorder.Eventf(NodeRef(s.p.Node), nil, corev1.EventTypeNormal, ReasonStarting, ActionStart, "")
		for _, f := range s.p.SetupFailures {
			RecordSetupFailure(s.p.Recorder, s.p.Node, f)
		}
	}
	t := time.NewTicker(s.poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.checkSyncs()
		}
	}
}

// checkSyncs records a Warning for each family whose commits failed FailedSyncs
// times in a row, once per streak of failures.
func (s *Stage) checkSyncs() {
	reports := s.p.Board.Read()
	for _, f := range s.p.Families {
		r, st := reports[bus.Commit.Of(f)], s.streaks[f]
		if !r.LastSync.Equal(st.lastSync) {
			st.lastSync, st.errorsAtSync, st.warned = r.LastSync, r.Errors, false
		}
		failed := r.Errors - st.errorsAtSync
		if failed < FailedSyncs || st.warned {
			continue
		}
		st.warned = true
		s.log.Warn("rules keep failing to sync; recording a Warning event", "family", f, "failures", failed, "err", r.LastError)
		s.p.Recorder.Eventf(NodeRef(s.p.Node), nil, corev1.EventTypeWarning, ReasonSyncFailed, ActionSync,
			"%s rules failed to sync %d times in a row: %s", f, failed, r.LastError)
	}
}
