package coalesce_test

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/stages/coalesce"
)

// within bounds how long a test waits for something that must happen; it is a
// hang guard, never a speed requirement.
const within = 5 * time.Second

// quiet is how long a test watches for something that must not happen.
const quiet = 250 * time.Millisecond

type harness struct {
	t      *testing.T
	in     *bus.ChangeQueue
	replay *bus.ReplayFlag
	fams   map[bus.Family]coalesce.Pipeline
	board  *bus.Board
	reg    *prometheus.Registry
	cancel context.CancelFunc
	done   chan error
}

func start(t *testing.T, cfg coalesce.Config, families ...bus.Family) *harness {
	t.Helper()
	if len(families) == 0 {
		families = []bus.Family{bus.IPv4}
	}
	if cfg.SyncPeriod == 0 {
		cfg.SyncPeriod = time.Hour
	}
	h := &harness{t: t, in: bus.NewChangeQueue(), replay: bus.NewReplayFlag(), fams: map[bus.Family]coalesce.Pipeline{},
		board: bus.NewBoard(), done: make(chan error, 1)}
	var fs []coalesce.Pipeline
	for _, f := range families {
		cf := coalesce.Pipeline{Family: f, Out: bus.NewMailbox[*bus.Snapshot](), Results: bus.NewMailbox[bus.Result](), Resync: bus.NewResyncFlag(), Resend: bus.NewResendFlag()}
		h.fams[f] = cf
		fs = append(fs, cf)
	}
	h.reg = prometheus.NewRegistry()
	env := bus.Envs{Metrics: metrics.New(h.reg), Board: h.board}.For(bus.Coalesce)
	s := coalesce.NewStage(coalesce.Params{Config: cfg, In: h.in, Replay: h.replay, Families: fs, Env: env})
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-h.done:
			if err != nil {
				t.Errorf("Run returned %v after cancel; want nil", err)
			}
		case <-time.After(within):
			t.Error("Run did not return after its context was cancelled")
		}
	})
	return h
}

// send queues c and waits until coalesce has taken it.
func (h *harness) send(c bus.Change) {
	h.t.Helper()
	sendTaken(h.t, h.in, c)
}

// sendTaken queues c on q and waits until coalesce has taken it.
func sendTaken(t testing.TB, q *bus.ChangeQueue, c bus.Change) {
	t.Helper()
	q.Put(c)
	deadline := time.Now().Add(within)
	for q.Len() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("coalesce did not take change %+v", c)
		}
		time.Sleep(time.Millisecond)
	}
}

// take waits for the next snapshot of family f.
func (h *harness) take(f bus.Family) *bus.Snapshot {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	s, err := h.fams[f].Out.Take(ctx)
	if err != nil {
		h.t.Fatalf("no %v snapshot: %v", f, err)
	}
	if s == nil {
		h.t.Fatalf("nil %v snapshot", f)
	}
	return s
}

// none checks that no snapshot of family f comes out for a while.
func (h *harness) none(f bus.Family, why string) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), quiet)
	defer cancel()
	if s, err := h.fams[f].Out.Take(ctx); err == nil {
		h.t.Fatalf("%s: got snapshot generation %d (full=%v); want none", why, s.Generation, s.Full)
	}
}

func (h *harness) answer(f bus.Family, s *bus.Snapshot, ok bool) {
	r := bus.Result{Family: f, Generation: s.Generation, OK: ok, Full: s.Full, Refresh: s.Refresh, At: time.Now()}
	if !ok {
		r.Err = context.DeadlineExceeded
	}
	h.fams[f].Results.Put(r)
}

// committedThenPartial sends a replay of service A and commits its full
// snapshot, then changes service B and returns the partial snapshot that
// follows (IPv4).
func (h *harness) committedThenPartial() *bus.Snapshot {
	h.t.Helper()
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	h.answer(bus.IPv4, h.take(bus.IPv4), true)
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	s2 := h.take(bus.IPv4)
	if s2.Full {
		h.t.Fatal("second snapshot is Full; the test needs a partial one")
	}
	return s2
}

var (
	keyA = bus.ServiceKey{Namespace: "default", Name: "a"}
	keyB = bus.ServiceKey{Namespace: "default", Name: "b"}
	keyC = bus.ServiceKey{Namespace: "kube-system", Name: "dns"}
)

func svc(key bus.ServiceKey, ip string) *bus.Service {
	return &bus.Service{ServiceKey: key, ClusterIPs: []netip.Addr{netip.MustParseAddr(ip)},
		Ports: []bus.Port{{Name: "http", Protocol: bus.TCP, Port: 80}}}
}

func slice(key bus.ServiceKey, name, ip string) *bus.EndpointSlice {
	return &bus.EndpointSlice{Service: key, Name: name, Family: bus.FamilyOf(netip.MustParseAddr(ip)),
		Ports: []bus.EndpointPort{{Name: "http", Protocol: bus.TCP, Port: 8080}},
		Items: []bus.Endpoint{{Addr: netip.MustParseAddr(ip), Ready: true, Serving: true}}}
}

func replayOf(services ...*bus.Service) bus.Change {
	st := &bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{},
		Node: &bus.Node{Name: "node-1"}}
	for _, s := range services {
		st.Services[s.ServiceKey] = s
	}
	return bus.Change{Kind: bus.Replayed, Replay: st}
}

func TestAsksForReplayAtStart(t *testing.T) {
	h := start(t, coalesce.Config{})
	select {
	case <-h.replay.C():
	case <-time.After(within):
		t.Fatal("coalesce did not raise the replay flag at start")
	}
}

func TestNoSnapshotBeforeReplay(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyB, SliceName: "b-1", Slice: slice(keyB, "b-1", "10.244.0.2")})
	h.send(bus.Change{Kind: bus.NodeChanged, Node: &bus.Node{Name: "node-1"}})
	h.none(bus.IPv4, "changes before the replay")

	a := svc(keyA, "10.96.0.1")
	h.send(replayOf(a))
	s := h.take(bus.IPv4)
	if len(s.State.Services) != 1 || s.State.Services[keyA] != a {
		t.Errorf("first snapshot services = %v; want exactly the replayed %v", s.State.Services, keyA)
	}
	if len(s.State.Slices) != 0 {
		t.Errorf("first snapshot slices = %v; want the replayed (none)", s.State.Slices)
	}
	if s.State.Node == nil || s.State.Node.Name != "node-1" {
		t.Errorf("first snapshot node = %v; want the replayed node-1", s.State.Node)
	}
	if s.Generation == 0 {
		t.Error("snapshot generation is 0")
	}
}

func TestLaterSnapshotsArePartial(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	s1 := h.take(bus.IPv4)
	h.answer(bus.IPv4, s1, true)

	b := svc(keyB, "10.96.0.2")
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: b})
	s2 := h.take(bus.IPv4)
	if s2.Full {
		t.Error("snapshot after an OK commit is Full; want partial")
	}
	if s2.Generation <= s1.Generation {
		t.Errorf("generation went from %d to %d; want it to grow", s1.Generation, s2.Generation)
	}
	if !s2.Changed[keyB] || len(s2.Changed) != 1 {
		t.Errorf("Changed = %v; want exactly %v", s2.Changed, keyB)
	}
	if s2.State.Services[keyB] != b || s2.State.Services[keyA] == nil {
		t.Errorf("services = %v; want a and b", s2.State.Services)
	}
	if s2.QueuedAt.IsZero() {
		t.Error("QueuedAt is zero for a snapshot carrying a change")
	}

	h.answer(bus.IPv4, s2, true)
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyA, Service: nil}) // deleted
	s3 := h.take(bus.IPv4)
	if s3.Full {
		t.Error("third snapshot is full; want partial")
	}
	if _, ok := s3.State.Services[keyA]; ok {
		t.Error("deleted service still in the snapshot")
	}
	if !s3.Changed[keyA] || s3.Changed[keyB] {
		t.Errorf("Changed = %v; want only the deleted %v (b was committed)", s3.Changed, keyA)
	}
}

func TestAtMostOneSnapshotInFlight(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(replayOf())
	s1 := h.take(bus.IPv4)
	for i, key := range []bus.ServiceKey{keyA, keyB, keyC} {
		h.send(bus.Change{Kind: bus.ServiceChanged, Key: key, Service: svc(key, netip.AddrFrom4([4]byte{10, 96, 0, byte(i + 1)}).String())})
	}
	h.none(bus.IPv4, "changes while a snapshot is in flight")

	// An answer to some other generation does not release the family.
	h.fams[bus.IPv4].Results.Put(bus.Result{Family: bus.IPv4, Generation: s1.Generation + 100, OK: true})
	h.none(bus.IPv4, "after an answer to a generation that is not in flight")

	h.answer(bus.IPv4, s1, true)
	s2 := h.take(bus.IPv4)
	if len(s2.State.Services) != 3 {
		t.Errorf("snapshot after the answer has %d services; want all 3 changes folded in", len(s2.State.Services))
	}
	if len(s2.Changed) != 3 {
		t.Errorf("Changed = %v; want the 3 services", s2.Changed)
	}
	h.none(bus.IPv4, "nothing changed since the second snapshot")
}

func TestResyncSendsFullSnapshotWhileOneIsInFlight(t *testing.T) {
	h := start(t, coalesce.Config{})
	s2 := h.committedThenPartial()

	h.fams[bus.IPv4].Resync.Raise()
	s3 := h.take(bus.IPv4)
	if !s3.Full {
		t.Error("snapshot after a resync request is not Full")
	}
	if len(s3.State.Services) != 2 {
		t.Errorf("full snapshot has %d services; want 2", len(s3.State.Services))
	}
	if s3.Generation <= s2.Generation {
		t.Errorf("generation %d after %d", s3.Generation, s2.Generation)
	}

	// The late answer to the abandoned snapshot does not count as the answer to s3:
	// a new change still waits for s3's answer.
	h.answer(bus.IPv4, s2, true)
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyC, Service: svc(keyC, "10.96.0.10")})
	h.none(bus.IPv4, "a change while the full snapshot is in flight")
	h.answer(bus.IPv4, s3, true)
	s4 := h.take(bus.IPv4)
	if s4.Full {
		t.Error("snapshot after the full one is full; want partial")
	}
}

func TestFailedCommitRetriesFullAfterBackoff(t *testing.T) {
	// On the bubble's clock (testing/synctest): timing without waiting.
	synctest.Test(t, func(t *testing.T) {
		const period = 300 * time.Millisecond
		h := start(t, coalesce.Config{MinSyncPeriod: period, Burst: 2})
		s2 := h.committedThenPartial()

		// Let the rate limiter refill, so that only the backoff can hold the retry back.
		time.Sleep(2 * period)
		failedAt := time.Now()
		h.answer(bus.IPv4, s2, false)
		s3 := h.take(bus.IPv4)
		if waited := time.Since(failedAt); waited < period*3/4 {
			t.Errorf("retry came %v after the failure; want a backoff of about %v", waited, period)
		}
		if !s3.Full {
			t.Error("retry after a failed commit is not Full")
		}
		if !s3.Changed[keyB] {
			t.Errorf("retry Changed = %v; want the uncommitted %v still there", s3.Changed, keyB)
		}
		if s3.State.Services[keyB] == nil {
			t.Error("retry lost the uncommitted service")
		}
	})
}

func TestFailedCommitIsNotRetriedImmediately(t *testing.T) {
	// On the bubble's clock (testing/synctest): timing without waiting.
	synctest.Test(t, func(t *testing.T) {
		// MinSyncPeriod 0: the rate limiter never holds anything back; the backoff does.
		h := start(t, coalesce.Config{})
		h.send(replayOf())
		s1 := h.take(bus.IPv4)
		failedAt := time.Now()
		h.answer(bus.IPv4, s1, false)
		s2 := h.take(bus.IPv4)
		if waited := time.Since(failedAt); waited < 50*time.Millisecond {
			t.Errorf("retry came %v after the failure; want a backoff", waited)
		}
		if !s2.Full {
			t.Error("retry is not Full")
		}
		// A second failure backs off longer than the first.
		failedAt = time.Now()
		h.answer(bus.IPv4, s2, false)
		s3 := h.take(bus.IPv4)
		if waited := time.Since(failedAt); waited < 150*time.Millisecond {
			t.Errorf("second retry came %v after the second failure; want the backoff to grow", waited)
		}
		// Success resets: the next change goes out at once (no backoff left over).
		h.answer(bus.IPv4, s3, true)
		h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyA, Service: svc(keyA, "10.96.0.1")})
		s4 := h.take(bus.IPv4)
		if s4.Full {
			t.Error("after a success the next snapshot is full; want partial")
		}
	})
}

func TestBurstOfTwoThenMinSyncPeriod(t *testing.T) {
	// On the bubble's clock (testing/synctest): timing without waiting.
	synctest.Test(t, func(t *testing.T) {
		// A period far beyond the test's length: only the burst can let snapshots out.
		h := start(t, coalesce.Config{MinSyncPeriod: time.Hour, SyncPeriod: 2 * time.Hour, Burst: 2})
		h.send(replayOf())
		s1 := h.take(bus.IPv4)
		h.answer(bus.IPv4, s1, true)
		h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyA, Service: svc(keyA, "10.96.0.1")})
		s2 := h.take(bus.IPv4)
		h.answer(bus.IPv4, s2, true)
		h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
		h.none(bus.IPv4, "a third sync within the min-sync-period")
	})
}

func TestMinSyncPeriodSpacesTheThirdSnapshot(t *testing.T) {
	// On the bubble's clock (testing/synctest): timing without waiting.
	synctest.Test(t, func(t *testing.T) {
		const period = 200 * time.Millisecond
		h := start(t, coalesce.Config{MinSyncPeriod: period, Burst: 2})
		begin := time.Now()
		h.send(replayOf())
		s1 := h.take(bus.IPv4)
		h.answer(bus.IPv4, s1, true)
		h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyA, Service: svc(keyA, "10.96.0.1")})
		s2 := h.take(bus.IPv4)
		h.answer(bus.IPv4, s2, true)
		h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
		h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyC, Service: svc(keyC, "10.96.0.10")})
		s3 := h.take(bus.IPv4)
		if waited := time.Since(begin); waited < period*3/4 {
			t.Errorf("third snapshot came %v after the first was due; want it held back about %v", waited, period)
		}
		if !s3.Changed[keyB] || !s3.Changed[keyC] || s3.Changed[keyA] {
			t.Errorf("third snapshot Changed = %v; want b and dns (a was committed)", s3.Changed)
		}
	})
}

func TestSnapshotsAreImmutable(t *testing.T) {
	h := start(t, coalesce.Config{})
	a := svc(keyA, "10.96.0.1")
	replay := replayOf(a)
	sl1 := slice(keyA, "a-1", "10.244.0.1")
	replay.Replay.Slices[keyA] = map[string]*bus.EndpointSlice{"a-1": sl1}
	h.send(replay)
	s1 := h.take(bus.IPv4)

	// Changes while s1 is in flight (sent, not yet answered).
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyA, Service: svc(keyA, "10.96.0.99")})
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: "a-2", Slice: slice(keyA, "a-2", "10.244.0.2")})
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: "a-1", Slice: nil})
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyB, SliceName: "b-1", Slice: slice(keyB, "b-1", "10.244.0.3")})
	h.send(bus.Change{Kind: bus.NodeChanged, Node: &bus.Node{Name: "node-1", Deleting: true}})
	h.send(bus.Change{Kind: bus.LocalAddrsChanged, Addrs: []netip.Addr{netip.MustParseAddr("192.168.1.1")}})

	h.answer(bus.IPv4, s1, true)
	s2 := h.take(bus.IPv4)
	// Every change was applied by now (s2 carries them all).
	// s1 is exactly what it was when it was sent.
	if len(s1.State.Services) != 1 || s1.State.Services[keyA] != a {
		t.Errorf("first snapshot services changed: %v", s1.State.Services)
	}
	if len(s1.State.Slices) != 1 || len(s1.State.Slices[keyA]) != 1 || s1.State.Slices[keyA]["a-1"] != sl1 {
		t.Errorf("first snapshot slices changed: %v", s1.State.Slices)
	}
	if s1.State.Node == nil || s1.State.Node.Deleting {
		t.Errorf("first snapshot node changed: %+v", s1.State.Node)
	}
	if len(s1.State.LocalAddrs) != 0 {
		t.Errorf("first snapshot local addresses changed: %v", s1.State.LocalAddrs)
	}

	// s2 has all of it.
	if got := s2.State.Services[keyA].ClusterIPs[0].String(); got != "10.96.0.99" || s2.State.Services[keyB] == nil {
		t.Errorf("second snapshot services = %v", s2.State.Services)
	}
	if got := s2.State.Slices[keyA]; len(got) != 1 || got["a-2"] == nil {
		t.Errorf("second snapshot slices of a = %v; want only a-2", got)
	}
	if s2.State.Slices[keyB]["b-1"] == nil || !s2.State.Node.Deleting || len(s2.State.LocalAddrs) != 1 {
		t.Errorf("second snapshot misses changes: slices %v node %+v addrs %v", s2.State.Slices, s2.State.Node, s2.State.LocalAddrs)
	}

	// And s2 stays as it is while more changes come.
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: "a-3", Slice: slice(keyA, "a-3", "10.244.0.4")})
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyB, SliceName: "b-1", Slice: nil})
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: nil})
	h.answer(bus.IPv4, s2, true)
	s3 := h.take(bus.IPv4)
	if got := s2.State.Slices[keyA]; len(got) != 1 || got["a-2"] == nil {
		t.Errorf("second snapshot slices of a changed after it was sent: %v", got)
	}
	if s2.State.Slices[keyB]["b-1"] == nil || s2.State.Services[keyB] == nil {
		t.Errorf("second snapshot lost b after it was sent: %v %v", s2.State.Services, s2.State.Slices)
	}
	if len(s3.State.Slices[keyA]) != 2 || s3.State.Slices[keyB] != nil || s3.State.Services[keyB] != nil {
		t.Errorf("third snapshot = services %v slices %v", s3.State.Services, s3.State.Slices)
	}
}

func TestBoardPendingSince(t *testing.T) {
	h := start(t, coalesce.Config{})
	pending := func() time.Time { return h.board.Read()["coalesce-ipv4"].PendingSince }
	h.send(replayOf())
	s1 := h.take(bus.IPv4)
	h.answer(bus.IPv4, s1, true)
	bustest.Eventually(t, func() bool {
		_, ok := h.board.Read()["coalesce-ipv4"]
		return ok && pending().IsZero()
	}, "PendingSince zero after the first OK commit")

	before := time.Now()
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyA, Service: svc(keyA, "10.96.0.1")})
	bustest.Eventually(t, func() bool { return !pending().IsZero() }, "PendingSince set for an uncommitted change")
	since := pending()
	if since.Before(before) {
		t.Errorf("PendingSince %v is before the change was sent (%v)", since, before)
	}
	s2 := h.take(bus.IPv4)
	// A second change while s2 is in flight: the oldest pending stays the first one.
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	if got := pending(); !got.Equal(since) {
		t.Errorf("PendingSince = %v after a newer change; want the oldest %v", got, since)
	}
	h.answer(bus.IPv4, s2, true)
	// a is committed; b is not (it came after s2 was sent).
	bustest.Eventually(t, func() bool {
		p := pending()
		return !p.IsZero() && p.After(since)
	}, "PendingSince moves to the change s2 did not carry")
	s3 := h.take(bus.IPv4)
	if !s3.Changed[keyB] || s3.Changed[keyA] {
		t.Errorf("Changed = %v; want only b", s3.Changed)
	}
	h.answer(bus.IPv4, s3, true)
	bustest.Eventually(t, func() bool { return pending().IsZero() }, "PendingSince zero once everything is committed")

	// A failed commit leaves the change pending.
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyC, Service: svc(keyC, "10.96.0.10")})
	s4 := h.take(bus.IPv4)
	h.answer(bus.IPv4, s4, false)
	time.Sleep(50 * time.Millisecond)
	if pending().IsZero() {
		t.Error("PendingSince zero after a failed commit; the change is not in the kernel")
	}
}

func TestBoardPendingSinceCoversReplayUntilFirstCommit(t *testing.T) {
	h := start(t, coalesce.Config{})
	pending := func() time.Time { return h.board.Read()["coalesce-ipv4"].PendingSince }
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	s1 := h.take(bus.IPv4)
	if pending().IsZero() {
		t.Error("PendingSince is zero while the replayed state has never been committed")
	}
	h.answer(bus.IPv4, s1, false)
	s2 := h.take(bus.IPv4)
	if pending().IsZero() {
		t.Error("PendingSince is zero after the first commit failed")
	}
	h.answer(bus.IPv4, s2, true)
	bustest.Eventually(t, func() bool { return pending().IsZero() }, "PendingSince zero after the first OK commit")
}

func TestFamiliesAreIndependent(t *testing.T) {
	h := start(t, coalesce.Config{}, bus.IPv4, bus.IPv6)
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	s4 := h.take(bus.IPv4)
	s6 := h.take(bus.IPv6)
	if s4 == s6 {
		t.Fatal("both families got the same snapshot value")
	}
	// IPv4 commits; IPv6 stays in flight.
	h.answer(bus.IPv4, s4, true)
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	n4 := h.take(bus.IPv4)
	if n4.Full {
		t.Error("IPv4 second snapshot is full; want partial")
	}
	h.none(bus.IPv6, "IPv6 snapshot still in flight")

	// IPv6 fails; IPv4 is unaffected.
	h.answer(bus.IPv6, s6, false)
	r6 := h.take(bus.IPv6)
	if !r6.Full || r6.State.Services[keyB] == nil {
		t.Errorf("IPv6 retry full=%v services=%v; want full with b", r6.Full, r6.State.Services)
	}
	h.answer(bus.IPv4, n4, true)
	h.none(bus.IPv4, "IPv4 has nothing new after IPv6 failed")

	// A resync of one family does not touch the other (idle) one.
	h.answer(bus.IPv6, r6, true)
	h.none(bus.IPv6, "IPv6 after its retry was committed")
	h.fams[bus.IPv4].Resync.Raise()
	f4 := h.take(bus.IPv4)
	if !f4.Full {
		t.Error("IPv4 resync snapshot is not Full")
	}
	h.none(bus.IPv6, "IPv6 after an IPv4 resync")
	if _, ok := h.board.Read()["coalesce-ipv6"]; !ok {
		t.Error("no coalesce-ipv6 report on the board")
	}
}

func TestPeriodicFullSync(t *testing.T) {
	// On the bubble's clock (testing/synctest): timing without waiting.
	synctest.Test(t, func(t *testing.T) {
		h := start(t, coalesce.Config{SyncPeriod: 50 * time.Millisecond, FullSyncPeriod: 300 * time.Millisecond})
		h.send(replayOf())
		s1 := h.take(bus.IPv4)
		h.answer(bus.IPv4, s1, true)
		// Nothing changes, yet every sync period brings a periodic (refresh) snapshot,
		// and after FullSyncPeriod a full one.
		refreshes := 0
		for {
			s := h.take(bus.IPv4)
			h.answer(bus.IPv4, s, true)
			if s.Full {
				break
			}
			if !s.Refresh {
				t.Fatalf("snapshot %d with nothing changed is neither periodic nor full", s.Generation)
			}
			refreshes++
		}
		if refreshes == 0 {
			t.Error("no periodic snapshot before the full one")
		}
	})
}

// TestNetworkProgrammingLatency: a slice's last-change-trigger-time is counted in
// kubeproxy_network_programming_duration_seconds once a commit carries it, and
// trigger times from before kpipe started watching are not.
func TestNetworkProgrammingLatency(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	h.answer(bus.IPv4, h.take(bus.IPv4), true)

	old := slice(keyA, "a-1", "10.244.0.1")
	old.TriggerTime = time.Now().Add(-time.Hour)
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: old.Name, Slice: old})
	h.answer(bus.IPv4, h.take(bus.IPv4), true)

	fresh := slice(keyA, "a-2", "10.244.0.2")
	fresh.TriggerTime = time.Now()
	time.Sleep(30 * time.Millisecond)
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: fresh.Name, Slice: fresh})
	snap := h.take(bus.IPv4)
	if n, _ := programming(h.reg); n != 0 {
		t.Fatalf("latency observed before the commit: %d samples", n)
	}
	h.answer(bus.IPv4, snap, true)
	bustest.Eventually(t, func() bool { n, _ := programming(h.reg); return n == 1 }, "one latency sample")
	if _, sum := programming(h.reg); sum < 0.03 || sum > 3600 {
		t.Errorf("latency %.3fs; want the time from the trigger (≥ 30 ms) to the commit, not the hour-old one", sum)
	}
}

// TestNetworkProgrammingLatencyOfFoldedChanges: a slice change in which the
// change queue folded earlier ones carries their earliest trigger time, and the
// latency counts from it as well as from the change's own.
func TestNetworkProgrammingLatencyOfFoldedChanges(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	h.answer(bus.IPv4, h.take(bus.IPv4), true)

	earlier := time.Now()
	time.Sleep(50 * time.Millisecond)
	sl := slice(keyA, "a-1", "10.244.0.1")
	sl.TriggerTime = time.Now()
	h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: sl.Name, Slice: sl, EarlierTrigger: earlier})
	h.answer(bus.IPv4, h.take(bus.IPv4), true)
	bustest.Eventually(t, func() bool { n, _ := programming(h.reg); return n == 2 }, "two latency samples")
	if _, sum := programming(h.reg); sum < 0.05 {
		t.Errorf("latency samples add up to %.3fs; want the earlier trigger's (≥ 50 ms) among them", sum)
	}
}

// TestNetworkProgrammingLatencyIsBounded: a service whose slice changes 100
// times while its commit is slow keeps at most 16 trigger times for the
// latency metric, the earliest (the largest latency) among them.
func TestNetworkProgrammingLatencyIsBounded(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	h.answer(bus.IPv4, h.take(bus.IPv4), true)

	change := func(i int) {
		sl := slice(keyA, "a-1", fmt.Sprintf("10.244.0.%d", i%250+1))
		sl.TriggerTime = time.Now()
		h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: sl.Name, Slice: sl})
	}
	change(0)
	inFlight := h.take(bus.IPv4) // the slow commit
	time.Sleep(100 * time.Millisecond)
	for i := 1; i < 100; i++ {
		change(i)
	}
	h.answer(bus.IPv4, inFlight, true)
	h.answer(bus.IPv4, h.take(bus.IPv4), true)
	bustest.Eventually(t, func() bool { n, _ := programming(h.reg); return n > 0 }, "latency samples")
	time.Sleep(quiet)
	n, sum := programming(h.reg)
	if n > 16 {
		t.Errorf("%d latency samples for one service's 100 changes; want at most 16", n)
	}
	if sum < 0.1 {
		t.Errorf("latency samples add up to %.3fs; want the first change's (≥ 100 ms) among them", sum)
	}
}

// programming is the IPv4 series of kubeproxy_network_programming_duration_seconds.
func programming(reg *prometheus.Registry) (uint64, float64) { return programmingOf(reg, "IPv4") }

// programmingOf is one family's series of kubeproxy_network_programming_duration_seconds.
func programmingOf(reg *prometheus.Registry, family string) (uint64, float64) {
	h := familySeries(reg, "kubeproxy_network_programming_duration_seconds", family).GetHistogram()
	return h.GetSampleCount(), h.GetSampleSum()
}

// familySeries is the ip_family=family series of the metric name (nil: none).
func familySeries(reg *prometheus.Registry, name, family string) *dto.Metric {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "ip_family" && l.GetValue() == family {
					return m
				}
			}
		}
	}
	return nil
}

// TestNetworkProgrammingLatencyPerFamily: on a dual-stack node each family
// observes the trigger times of its own slices only, in its own ip_family series,
// as kube-proxy's per-family proxiers do.
func TestNetworkProgrammingLatencyPerFamily(t *testing.T) {
	h := start(t, coalesce.Config{}, bus.IPv4, bus.IPv6)
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	commitBoth := func() {
		s4, s6 := h.take(bus.IPv4), h.take(bus.IPv6)
		h.answer(bus.IPv4, s4, true)
		h.answer(bus.IPv6, s6, true)
	}
	commitBoth()
	for _, ip := range []string{"10.244.0.1", "fd00:10:244::1"} {
		family := bus.FamilyOf(netip.MustParseAddr(ip))
		sl := slice(keyA, "a-"+family.String(), ip)
		sl.TriggerTime = time.Now()
		h.send(bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: sl.Name, Slice: sl})
		h.answer(family, h.take(family), true) // a slice is only its family's change
	}
	bustest.Eventually(t, func() bool {
		n4, _ := programmingOf(h.reg, "IPv4")
		n6, _ := programmingOf(h.reg, "IPv6")
		return n4 >= 1 && n6 >= 1
	}, "one latency sample per family")
	for deadline := time.Now().Add(quiet); time.Now().Before(deadline); time.Sleep(25 * time.Millisecond) {
		n4, _ := programmingOf(h.reg, "IPv4")
		n6, _ := programmingOf(h.reg, "IPv6")
		if n4 != 1 || n6 != 1 {
			t.Fatalf("latency samples IPv4 %d, IPv6 %d; want one each: a family observes only its own slice", n4, n6)
		}
	}
}

// TestResendKeepsPendingFullSync: a full sync lost to a restart of render or
// commit is still wanted: the resent snapshot is full again. (It used to come back
// partial, so a resync asked for by the canary after a flush was never written.)
func TestResendKeepsPendingFullSync(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	h.answer(bus.IPv4, h.take(bus.IPv4), true)
	h.fams[bus.IPv4].Resync.Raise()
	lost := h.take(bus.IPv4) // in flight, never answered
	if !lost.Full {
		t.Fatal("snapshot after a resync is not full")
	}
	h.fams[bus.IPv4].Resend.Raise()
	again := h.take(bus.IPv4)
	if !again.Full || again.Generation <= lost.Generation {
		t.Fatalf("resent snapshot gen %d full=%v; want a new full one after gen %d", again.Generation, again.Full, lost.Generation)
	}
	// Only the answer to a full snapshot ends the need for one.
	h.answer(bus.IPv4, again, true)
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	if next := h.take(bus.IPv4); next.Full {
		t.Error("snapshot after the full one was committed is still full")
	}
}

// TestResendKeepsPendingRefresh: the same for a periodic sync.
func TestResendKeepsPendingRefresh(t *testing.T) {
	// On the bubble's clock (testing/synctest): timing without waiting.
	synctest.Test(t, func(t *testing.T) {
		h := start(t, coalesce.Config{SyncPeriod: 100 * time.Millisecond})
		h.send(replayOf(svc(keyA, "10.96.0.1")))
		h.answer(bus.IPv4, h.take(bus.IPv4), true)
		lost := h.take(bus.IPv4)
		if !lost.Refresh {
			t.Fatal("snapshot with nothing changed is not periodic")
		}
		h.fams[bus.IPv4].Resend.Raise()
		if again := h.take(bus.IPv4); !again.Refresh {
			t.Error("resent snapshot lost the periodic sync")
		}
	})
}

// TestResendAfterRestartSendsTheState: when a restarted render or commit lost the
// snapshot in flight, coalesce sends the state again at once, with a new number.
func TestResendAfterRestartSendsTheState(t *testing.T) {
	h := start(t, coalesce.Config{})
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	h.answer(bus.IPv4, h.take(bus.IPv4), true)
	h.send(bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	lost := h.take(bus.IPv4) // in flight, never answered
	h.fams[bus.IPv4].Resend.Raise()
	again := h.take(bus.IPv4)
	if again.Full || again.Generation == lost.Generation {
		t.Fatalf("resent snapshot gen %d full=%v; want a new partial one", again.Generation, again.Full)
	}
	if _, ok := again.State.Services[keyB]; !ok {
		t.Error("the resent snapshot lacks the change that was in flight")
	}
}

// TestGenerationsOutliveARestart: a restarted coalesce must not number its
// snapshots from 1 again, or a Result left in a mailbox by the previous run (the
// mailboxes outlive it) is taken for the answer to a new snapshot.
func TestGenerationsOutliveARestart(t *testing.T) {
	in, replay := bus.NewChangeQueue(), bus.NewReplayFlag()
	fam := coalesce.Pipeline{Family: bus.IPv4, Out: bus.NewMailbox[*bus.Snapshot](), Results: bus.NewMailbox[bus.Result](),
		Resync: bus.NewResyncFlag(), Resend: bus.NewResendFlag()}
	s := coalesce.NewStage(coalesce.Params{Config: coalesce.Config{SyncPeriod: time.Hour}, In: in, Replay: replay,
		Families: []coalesce.Pipeline{fam}, Env: bus.Envs{Metrics: metrics.New(prometheus.NewRegistry()), Board: bus.NewBoard()}.For(bus.Coalesce)})
	run := func() (*bus.Snapshot, context.CancelFunc, chan error) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		sendTaken(t, in, replayOf(svc(keyA, "10.96.0.1")))
		tctx, tcancel := context.WithTimeout(context.Background(), within)
		defer tcancel()
		snap, err := fam.Out.Take(tctx)
		if err != nil {
			t.Fatal(err)
		}
		return snap, cancel, done
	}
	first, cancel, done := run()
	cancel()
	<-done
	// The first run's snapshot is answered late, after its coalesce restarted.
	fam.Results.Put(bus.Result{Family: bus.IPv4, Generation: first.Generation, OK: true, Full: true})
	second, cancel, done := run()
	defer func() { cancel(); <-done }()
	if second.Generation <= first.Generation {
		t.Fatalf("restarted coalesce numbered its snapshot %d after %d", second.Generation, first.Generation)
	}
	// The stale answer must not release the family: a change waits for the answer to second.
	sendTaken(t, in, bus.Change{Kind: bus.ServiceChanged, Key: keyB, Service: svc(keyB, "10.96.0.2")})
	ctx, c := context.WithTimeout(context.Background(), quiet)
	defer c()
	if s, err := fam.Out.Take(ctx); err == nil {
		t.Fatalf("snapshot %d sent while %d is in flight (a stale result was taken for its answer)", s.Generation, second.Generation)
	}
}

// TestAnyNumberOfFamilies: coalesce serves every family it is given, each on its
// own (it used to select on arrays of two).
func TestAnyNumberOfFamilies(t *testing.T) {
	third := bus.Family(5)
	h := start(t, coalesce.Config{}, bus.IPv4, bus.IPv6, third)
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6, third} {
		h.answer(f, h.take(f), true)
	}
	h.fams[third].Resync.Raise()
	if s := h.take(third); !s.Full {
		t.Error("the third family's resync brought no full snapshot")
	}
	h.none(bus.IPv4, "IPv4 after the third family's resync")
}

// TestFamilyIsHandedOnlyItsChanges: a family's pipeline gets a snapshot, and
// its queued time moves, only for a change it can render something from (as
// kube-proxy's per-family proxiers): a Service with a ClusterIP of the family,
// before or after, an EndpointSlice of the family, the Node. The IPv6 pipeline
// of an IPv4 cluster stays idle through an IPv4 churn.
func TestFamilyIsHandedOnlyItsChanges(t *testing.T) {
	h := start(t, coalesce.Config{}, bus.IPv4, bus.IPv6)
	h.send(replayOf(svc(keyA, "10.96.0.1")))
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		h.answer(f, h.take(f), true)
	}
	dual := svc(keyC, "10.96.0.10")
	dual.ClusterIPs = append(dual.ClusterIPs, netip.MustParseAddr("fd00:10:96::a"))
	steps := []struct {
		what   string
		change bus.Change
		want   []bus.Family
	}{
		{"an IPv4 service changed", bus.Change{Kind: bus.ServiceChanged, Key: keyA, Service: svc(keyA, "10.96.0.1")}, []bus.Family{bus.IPv4}},
		{"an IPv4 slice", bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: "a4", Slice: slice(keyA, "a4", "10.244.0.1")}, []bus.Family{bus.IPv4}},
		{"an IPv6 slice of that service", bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: "a6", Slice: slice(keyA, "a6", "fd00:10:244::1")}, []bus.Family{bus.IPv6}},
		{"a dual-stack service", bus.Change{Kind: bus.ServiceChanged, Key: keyC, Service: dual}, []bus.Family{bus.IPv4, bus.IPv6}},
		{"the dual-stack service made IPv4 only", bus.Change{Kind: bus.ServiceChanged, Key: keyC, Service: svc(keyC, "10.96.0.10")}, []bus.Family{bus.IPv4, bus.IPv6}},
		{"the IPv4 slice deleted", bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: "a4"}, []bus.Family{bus.IPv4}},
		{"the IPv6 slice deleted", bus.Change{Kind: bus.SliceChanged, Key: keyA, SliceName: "a6"}, []bus.Family{bus.IPv6}},
		{"the IPv4 service deleted", bus.Change{Kind: bus.ServiceChanged, Key: keyA}, []bus.Family{bus.IPv4}},
		{"a slice deleted that was never there", bus.Change{Kind: bus.SliceChanged, Key: keyB, SliceName: "b4"}, nil},
		{"the node changed", bus.Change{Kind: bus.NodeChanged, Node: &bus.Node{Name: "node-1", Zone: "b"}}, []bus.Family{bus.IPv4, bus.IPv6}},
	}
	for _, step := range steps {
		queued := map[bus.Family]float64{}
		for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
			queued[f] = lastQueuedOf(h.reg, f)
		}
		time.Sleep(2 * time.Millisecond) // a queued time set by this step is a later one
		h.send(step.change)
		for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
			if slices.Contains(step.want, f) {
				h.answer(f, h.take(f), true)
				continue
			}
			h.none(f, step.what)
			if got := lastQueuedOf(h.reg, f); got != queued[f] {
				t.Errorf("%s: %v last queued at %.3f, was %.3f; want unchanged", step.what, f, got, queued[f])
			}
		}
	}
}

// lastQueuedOf reads kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds
// of family (0: never set).
func lastQueuedOf(reg *prometheus.Registry, family bus.Family) float64 {
	return familySeries(reg, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", family.String()).GetGauge().GetValue()
}
