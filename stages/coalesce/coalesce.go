// Package coalesce holds the desired state and decides when render gets a new
// snapshot: at most one in flight per family, rate-limited the way kube-proxy's
// BoundedFrequencyRunner limits syncs (a burst, then one per min-sync-period).
package coalesce

import (
	"context"
	"log/slog"
	"maps"
	"math"
	"sync"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/supervise"
)

// Config sets the sync timing (kube-proxy's --iptables-min-sync-period,
// --iptables-sync-period and burst).
type Config struct {
	MinSyncPeriod time.Duration
	SyncPeriod    time.Duration
	Burst         int
	// FullSyncPeriod is how often a periodic sync rewrites every chain even though
	// nothing changed (kube-proxy: one hour); the other periodic syncs, every
	// SyncPeriod, rewrite only the top-level chains.
	FullSyncPeriod time.Duration
}

// Pipeline is the mailboxes and flags that connect coalesce to one family's
// render and commit.
type Pipeline struct {
	Family  bus.Family
	Out     *bus.Mailbox[*bus.Snapshot]
	Results *bus.Mailbox[bus.Result]
	Resync  *bus.ResyncFlag // a full sync is wanted (the tables were flushed)
	Resend  *bus.ResendFlag // a restarted render or commit lost the snapshot in flight
}

// Params wire the coalesce stage.
type Params struct {
	Config   Config
	In       *bus.ChangeQueue
	Replay   *bus.ReplayFlag // raised on every start: watch sends the whole state
	Families []Pipeline      // one per family kpipe programs
	// Env reports each family's pending changes under Coalesce.Of(family).
	Env bus.Env
}

// Stage is the coalesce stage.
type Stage struct {
	cfg      Config
	in       *bus.ChangeQueue
	replay   *bus.ReplayFlag
	families []Pipeline
	status   bus.Reporter
	metrics  *metrics.Metrics
	log      *slog.Logger
	now      func() time.Time
	started  time.Time // trigger times before this are from before kpipe watched
	// settle is how long a snapshot that takes a service's last endpoints
	// away waits for the change to be undone (outage.go).
	settle time.Duration
	// retry spaces the retries of a family whose commits fail: from the min sync
	// period (at least 100 ms) doubling up to the sync period.
	retry supervise.Backoff
	// gen numbers snapshots and seq changes. Both outlive a restart of Run: the
	// mailboxes keep values from before it, and a stale Result must never be
	// taken for the answer to a new snapshot.
	gen, seq uint64
}

// NewStage makes the coalesce stage.
func NewStage(p Params) *Stage {
	cfg := p.Config
	if cfg.Burst < 1 {
		cfg.Burst = 1
	}
	if cfg.FullSyncPeriod == 0 {
		cfg.FullSyncPeriod = time.Hour
	}
	retry := supervise.Backoff{Initial: max(cfg.MinSyncPeriod, 100*time.Millisecond), Max: max(cfg.SyncPeriod, 100*time.Millisecond), Factor: 2, Jitter: -1}
	return &Stage{cfg: cfg, retry: retry, settle: min(maxSettle, cfg.MinSyncPeriod), in: p.In, replay: p.Replay, families: p.Families, status: p.Env.Status, metrics: p.Env.Metrics,
		log: p.Env.Log, now: time.Now}
}

// pendingChange is a change not yet known to be committed.
type pendingChange struct {
	seq uint64
	at  time.Time
	// service and endpoints say what changed, for the pending-changes gauges.
	service, endpoints bool
	// triggers are the EndpointSlice trigger times of the changes folded in, for
	// kubeproxy_network_programming_duration_seconds.
	triggers []time.Time
}

// maxTriggers bounds the trigger times a pending service keeps, so that a service
// whose slices change without end while its commit is slow holds a bounded
// amount: the earliest are kept (they are the largest latencies), the last slot
// holds the latest.
const maxTriggers = 16

func (p *pendingChange) addTrigger(t time.Time) {
	if len(p.triggers) < maxTriggers {
		p.triggers = append(p.triggers, t)
		return
	}
	p.triggers[maxTriggers-1] = t
}

// familyState is what coalesce tracks for one family's pipeline.
type familyState struct {
	Pipeline
	status  bus.Reporter // this family's entry on the board
	pending map[bus.ServiceKey]pendingChange
	oldest  time.Time // the oldest pending change's time (zero: none)
	// pendingServices and pendingEndpoints count pending entries with a service
	// or an endpoint change, for the pending-changes gauges.
	pendingServices, pendingEndpoints int
	dirty                             bool // something changed that is not yet in a snapshot
	// full and refresh are wanted until a commit of a snapshot numbered
	// fullSince (refreshSince) or later succeeds: a snapshot lost to a restart
	// of render or commit, or answered by a failure, does not count.
	full, refresh           bool
	fullSince, refreshSince uint64
	inflight                uint64 // generation sent and not yet answered; 0: none
	sentSeq                 uint64 // change sequence number the in-flight snapshot includes
	failures                int
	retryAt                 time.Time
	lastFull                time.Time
	limiter                 *limiter
	outages                 outages // services losing or gaining all their endpoints (outage.go)
}

// wantFull asks for a full sync in a snapshot not sent yet.
func (f *familyState) wantFull(nextGen uint64) { f.full, f.fullSince = true, nextGen }

// wantRefresh asks for a periodic sync in a snapshot not sent yet.
func (f *familyState) wantRefresh(nextGen uint64) {
	if !f.refresh {
		f.refresh, f.refreshSince = true, nextGen
	}
}

// Run coalesces until ctx ends. It starts with nothing and asks watch for a
// replay; no snapshot goes out before that replay, so a restart never programs an
// empty state over working rules.
func (s *Stage) Run(ctx context.Context) error {
	if s.started.IsZero() {
		s.started = s.now()
	}
	l := s.newLoop()
	s.replay.Raise()
	return l.run(ctx)
}

// loop is one Run of the stage: the desired state and what it tracks per
// family. Nothing of it outlives the Run (the Stage keeps what must).
type loop struct {
	*Stage
	state  bus.State
	synced bool // the replay arrived: snapshots may go
	fams   []*familyState
}

func (s *Stage) newLoop() *loop {
	l := &loop{Stage: s,
		state: bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}}}
	for _, p := range s.families {
		// The first snapshot is not forced to be a full sync: commit's ledger knows
		// whether the kernel holds what it wrote (a restart of coalesce alone costs
		// no rewrite; a new process's first commit is a full one anyway). The
		// hourly full sync counts from now.
		l.fams = append(l.fams, &familyState{Pipeline: p, status: s.status.Of(p.Family), pending: map[bus.ServiceKey]pendingChange{},
			lastFull: s.now(), limiter: newLimiter(s.cfg.MinSyncPeriod, s.cfg.Burst, s.now()), outages: newOutages()})
	}
	return l
}

// signalKind says which of its pipeline's signals a family raised.
type signalKind int

const (
	resyncWanted signalKind = iota // the Resync flag: the tables were flushed
	resendWanted                   // the Resend flag: the snapshot in flight was lost
	resultReady                    // the Results mailbox: commit answered
)

// familySignal is one signal of family f's pipeline.
type familySignal struct {
	f    *familyState
	kind signalKind
}

func (l *loop) run(ctx context.Context) error {
	// The forwarders end with the Run, even one that panics.
	ctx, cancel := context.WithCancel(ctx)
	var forwarders sync.WaitGroup
	defer forwarders.Wait()
	defer cancel()
	signals := make(chan familySignal)
	for _, f := range l.fams {
		forwarders.Go(func() { forward(ctx, f, signals) })
	}
	periodic := time.NewTicker(l.cfg.SyncPeriod)
	defer periodic.Stop()
	due := time.NewTimer(time.Hour)
	defer due.Stop()
	for {
		// Arm the timer for the next moment a snapshot may go out.
		now := l.now()
		if at, ok := l.nextRun(now); ok {
			resetTimer(due, at.Sub(now))
		} else {
			resetTimer(due, time.Hour)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-l.in.Ready():
			l.take()
		case <-periodic.C:
			l.periodicSync()
		case <-due.C:
			l.sendDue()
		case sig := <-signals:
			switch sig.kind {
			case resyncWanted:
				l.resync(sig.f)
			case resendWanted:
				l.resend(sig.f)
			case resultReady:
				l.result(sig.f)
			}
		}
	}
}

// forward hands f's signals to the loop until ctx ends, one at a time, so
// that one plain select serves any number of families. It loses none, and
// reorders none in a way a select over every family's channels could not:
//   - it takes a signal only to hand it on; one it cannot hand on because
//     the Run ends goes back (a flag is raised again for the next Run; a
//     Result stays in its mailbox, and a new Run, with nothing in flight,
//     ignores any Result from before it anyway);
//   - a family's signals reach the loop in the order its one forwarder took
//     them, and a family's signals touch only its own familyState;
//   - while a signal waits to be handed on its flag is down, so a raise
//     meanwhile is handled once more, as a raise just after the loop took
//     the flag would be (resync and resend only set wishes again; a second
//     Result signal finds the mailbox empty);
//   - a signal waiting to be handed on is one more ready case of the loop's
//     select, which picks at random among them, as a select over every
//     family's channels would.
func forward(ctx context.Context, f *familyState, signals chan<- familySignal) {
	for {
		var kind signalKind
		select {
		case <-ctx.Done():
			return
		case <-f.Resync.C():
			kind = resyncWanted
		case <-f.Resend.C():
			kind = resendWanted
		case <-f.Results.Ready():
			kind = resultReady
		}
		select {
		case signals <- familySignal{f, kind}:
		case <-ctx.Done():
			switch kind {
			case resyncWanted:
				f.Resync.Raise()
			case resendWanted:
				f.Resend.Raise()
			}
			return
		}
	}
}

// periodicSync asks every family for a periodic sync, or a full one if the
// last was FullSyncPeriod ago.
func (l *loop) periodicSync() {
	for _, f := range l.fams {
		if l.now().Sub(f.lastFull) >= l.cfg.FullSyncPeriod {
			f.wantFull(l.gen + 1)
		} else {
			f.wantRefresh(l.gen + 1)
		}
	}
}

// sendDue sends a snapshot to every family that needs one and may have it now.
func (l *loop) sendDue() {
	now := l.now()
	for _, f := range l.fams {
		if l.synced && f.due(now) && l.mayGo(f, now) {
			l.send(f, now)
		}
	}
}

func resetTimer(t *time.Timer, d time.Duration) {
	t.Stop()
	select {
	case <-t.C:
	default:
	}
	t.Reset(max(d, 0))
}

// due says whether f needs a snapshot now.
func (f *familyState) due(now time.Time) bool {
	return f.inflight == 0 && (f.dirty || f.full || f.refresh) && !now.Before(f.retryAt)
}

// nextRun is when the next snapshot may go out, if any is wanted.
func (l *loop) nextRun(now time.Time) (time.Time, bool) {
	if !l.synced {
		return time.Time{}, false
	}
	var best time.Time
	found := false
	for _, f := range l.fams {
		if f.inflight != 0 || !(f.dirty || f.full || f.refresh) {
			continue
		}
		at := l.goesAt(f, now)
		if !found || at.Before(best) {
			best, found = at, true
		}
	}
	return best, found
}

// goesAt is when f's next snapshot may go, from now on: after the retry
// backoff, a loss has settled, and a token (or a bypass) is there.
func (s *Stage) goesAt(f *familyState, now time.Time) time.Time {
	at := now
	if !f.outages.mayBypass() {
		at = f.limiter.next(now)
	}
	if settled, ok := f.outages.settledAt(s.settle); ok && settled.After(at) {
		at = settled
	}
	if f.retryAt.After(at) {
		at = f.retryAt
	}
	return at
}

// mayGo says whether f's next snapshot may go now, and if so spends what it
// takes: a token, or else the bypass of a snapshot that ends an outage.
func (s *Stage) mayGo(f *familyState, now time.Time) bool {
	if now.Before(s.goesAt(f, now)) {
		return false
	}
	// goesAt said now: a token is there, or else the bypass is.
	f.outages.bypassed = !f.limiter.take(now)
	return true
}

// take applies everything watch queued: the replay first, then the latest change
// of each object.
func (l *loop) take() {
	cs, ok := l.in.TryTake()
	if !ok {
		return
	}
	if cs.Replay != nil {
		l.seq++
		l.apply(bus.Change{Kind: bus.Replayed, Replay: cs.Replay}, l.seq)
	}
	for _, c := range cs.Objects {
		l.seq++
		l.apply(c, l.seq)
	}
}

// apply folds change number seq into the state and marks the families it
// touches pending.
func (l *loop) apply(c bus.Change, seq uint64) {
	now := l.now()
	st := &l.state
	fams := touched(st, c, l.fams)
	mark := func(key bus.ServiceKey) {
		for _, f := range fams {
			f.dirty = true
			if key != (bus.ServiceKey{}) {
				p, ok := f.pending[key]
				if !ok {
					p.at = now
					if f.oldest.IsZero() {
						f.oldest = now
					}
				}
				p.seq = seq
				if c.Kind == bus.ServiceChanged && !p.service {
					p.service = true
					f.pendingServices++
				}
				if c.Kind == bus.SliceChanged && !p.endpoints {
					p.endpoints = true
					f.pendingEndpoints++
				}
				// A slice programs only its own family's rules (kube-proxy's per-family
				// proxiers each see only their slices).
				if c.Kind == bus.SliceChanged && c.Slice != nil && c.Slice.Family == f.Family {
					for _, t := range []time.Time{c.EarlierTrigger, c.Slice.TriggerTime} {
						if t.After(l.started) {
							p.addTrigger(t)
						}
					}
				}
				f.pending[key] = p
			}
		}
	}
	switch c.Kind {
	case bus.ServiceChanged:
		if c.Service == nil {
			delete(st.Services, c.Key)
		} else {
			st.Services[c.Key] = c.Service
		}
		mark(c.Key)
		noteOutage(st, c.Key, fams, now)
	case bus.SliceChanged:
		// Copy on write: snapshots already sent share the old inner map.
		inner := maps.Clone(st.Slices[c.Key])
		if inner == nil {
			inner = map[string]*bus.EndpointSlice{}
		}
		if c.Slice == nil {
			delete(inner, c.SliceName)
		} else {
			inner[c.SliceName] = c.Slice
		}
		if len(inner) == 0 {
			delete(st.Slices, c.Key)
		} else {
			st.Slices[c.Key] = inner
		}
		mark(c.Key)
		noteOutage(st, c.Key, fams, now)
	case bus.NodeChanged:
		st.Node = c.Node
		mark(bus.ServiceKey{})
	case bus.LocalAddrsChanged:
		st.LocalAddrs = c.Addrs
		mark(bus.ServiceKey{})
	case bus.Replayed:
		// Every service the replay may change is pending until a commit carries it,
		// as kube-proxy queues an update for each object its informers add: a first
		// commit that keeps failing must show in /healthz.
		keys := map[bus.ServiceKey]bool{}
		for _, state := range []bus.State{*st, *c.Replay} {
			for k := range state.Services {
				keys[k] = true
			}
			for k := range state.Slices {
				keys[k] = true
			}
		}
		*st = *c.Replay
		if st.Services == nil {
			st.Services = map[bus.ServiceKey]*bus.Service{}
		}
		if st.Slices == nil {
			st.Slices = map[bus.ServiceKey]map[string]*bus.EndpointSlice{}
		}
		l.synced = true
		for k := range keys {
			mark(k)
			noteOutage(st, k, fams, now)
		}
		mark(bus.ServiceKey{})
		l.log.Info("state replayed from watch", "services", len(st.Services))
	}
	for _, f := range fams {
		l.metrics.LastQueued.WithLabelValues(f.Family.String()).SetToCurrentTime()
	}
	l.publish(fams, now)
}

// noteOutage records, for each family in fams, whether key, as st has it,
// loses or gains all its endpoints. (A Node change is not looked at: its
// name, what reach depends on, never changes.)
func noteOutage(st *bus.State, key bus.ServiceKey, fams []*familyState, now time.Time) {
	for _, f := range fams {
		f.outages.note(st, key, f.Family, now)
	}
}

// touched returns the families whose rules change c, applied to st (which
// does not hold it yet), can change. A Service is a family's when it has a
// ClusterIP of it, before or after; an EndpointSlice is its address family's;
// the Node and the local addresses, and a replay, are everyone's. So a
// family's pipeline is not handed a snapshot, nor counted queued, for changes
// it renders nothing from: the IPv6 pipeline of an IPv4 cluster stays idle
// through an IPv4 churn. kube-proxy's per-family proxiers see the same: a
// Service without a ClusterIP of the proxier's family is no change to it.
func touched(st *bus.State, c bus.Change, all []*familyState) []*familyState {
	var has func(bus.Family) bool
	switch c.Kind {
	case bus.ServiceChanged:
		old := st.Services[c.Key]
		has = func(f bus.Family) bool {
			_, before := old.ClusterIPOf(f)
			_, after := c.Service.ClusterIPOf(f)
			return before || after
		}
	case bus.SliceChanged:
		old := st.Slices[c.Key][c.SliceName]
		has = func(f bus.Family) bool { return old != nil && old.Family == f || c.Slice != nil && c.Slice.Family == f }
	default:
		return all
	}
	var out []*familyState
	for _, f := range all {
		if has(f.Family) {
			out = append(out, f)
		}
	}
	return out
}

// resend sends the current state again: a restarted render or commit lost the
// snapshot in flight, which will never be answered. A full or periodic sync it
// carried is still wanted (see familyState.full); commit's ledger knows which
// chains the lost write may have left half-way.
func (s *Stage) resend(f *familyState) {
	f.dirty, f.inflight = true, 0
}

// resync asks for a full sync after the tables were flushed: one sent from now on,
// since a snapshot already in flight may have been written before the flush.
func (s *Stage) resync(f *familyState) {
	f.wantFull(s.gen + 1)
	f.inflight = 0 // repair now rather than after the snapshot in flight
}

func (s *Stage) result(f *familyState) {
	res, ok := f.Results.TryTake()
	if !ok || res.Generation != f.inflight {
		return // an answer to a snapshot abandoned by a resync
	}
	f.inflight = 0
	now := s.now()
	if !res.OK {
		f.failures++
		backoff := s.retry.Delay(f.failures, nil)
		f.retryAt = now.Add(backoff)
		f.wantFull(s.gen + 1)
		s.log.Warn("commit failed; retrying with a full sync", "family", f.Family, "in", backoff, "failures", f.failures, "err", res.Err)
		return
	}
	f.failures, f.retryAt = 0, time.Time{}
	if res.Full {
		f.lastFull = res.At
		if res.Generation >= f.fullSince {
			f.full = false
		}
	}
	if (res.Full || res.Refresh) && res.Generation >= f.refreshSince {
		f.refresh = false
	}
	f.oldest = time.Time{}
	for k, p := range f.pending {
		if p.seq > f.sentSeq {
			if f.oldest.IsZero() || p.at.Before(f.oldest) {
				f.oldest = p.at
			}
			continue
		}
		for _, t := range p.triggers {
			s.metrics.NetworkProgramming.WithLabelValues(f.Family.String()).Observe(res.At.Sub(t).Seconds())
		}
		if p.service {
			f.pendingServices--
		}
		if p.endpoints {
			f.pendingEndpoints--
		}
		delete(f.pending, k)
	}
	s.publish([]*familyState{f}, time.Time{})
}

// send numbers f's next snapshot of the state and sends it.
func (l *loop) send(f *familyState, now time.Time) {
	l.gen++
	changed := make(map[bus.ServiceKey]bool, len(f.pending))
	queued := time.Time{}
	for k, p := range f.pending {
		changed[k] = true
		if queued.IsZero() || p.at.Before(queued) {
			queued = p.at
		}
	}
	st := l.state
	snap := &bus.Snapshot{
		Generation: l.gen,
		State: bus.State{Services: maps.Clone(st.Services), Slices: maps.Clone(st.Slices), Node: st.Node,
			LocalAddrs: st.LocalAddrs},
		Changed: changed, Full: f.full, Refresh: f.refresh, QueuedAt: queued,
	}
	f.inflight, f.sentSeq, f.dirty = l.gen, l.seq, false
	f.outages.sentAll()
	f.Out.Put(snap)
}

// publish reports pending changes for /healthz and the pending metrics.
// queued, unless zero, is when a change was queued for them.
func (s *Stage) publish(fams []*familyState, queued time.Time) {
	for _, f := range fams {
		f.status.Update(func(r *bus.Report) {
			r.PendingSince, r.PendingServices, r.PendingEndpoints = f.oldest, f.pendingServices, f.pendingEndpoints
			if !queued.IsZero() {
				r.LastQueued = queued
			}
		})
	}
	if len(fams) > 0 && fams[0].Family == s.families[0].Family {
		s.metrics.ServicesPending.Set(float64(fams[0].pendingServices))
		s.metrics.EndpointsPending.Set(float64(fams[0].pendingEndpoints))
	}
}

// limiter is a token bucket: burst tokens, refilled at one per interval.
type limiter struct {
	interval time.Duration
	burst    float64
	tokens   float64
	last     time.Time
}

func newLimiter(interval time.Duration, burst int, now time.Time) *limiter {
	return &limiter{interval: interval, burst: float64(burst), tokens: float64(burst), last: now}
}

func (l *limiter) refill(now time.Time) {
	if l.interval <= 0 {
		l.tokens = l.burst
		return
	}
	l.tokens = min(l.burst, l.tokens+float64(now.Sub(l.last))/float64(l.interval))
	l.last = now
}

// whole is as good as one token: the refill's float arithmetic may leave
// 0.999… at the very time next promised a token, and a limiter that says "now"
// but refuses would spin.
const whole = 1 - 1e-9

// next is when a token will be available.
func (l *limiter) next(now time.Time) time.Time {
	l.refill(now)
	if l.tokens >= whole {
		return now
	}
	return now.Add(max(time.Duration(math.Ceil((1-l.tokens)*float64(l.interval))), 1))
}

// take spends a token if one is available.
func (l *limiter) take(now time.Time) bool {
	l.refill(now)
	if l.tokens < whole {
		return false
	}
	l.tokens = max(l.tokens-1, 0)
	return true
}
