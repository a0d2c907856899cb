// Package canary notices when something else changed kpipe's rules. On the
// nf_tables backend it receives every change made to the tables (nf_tables
// notifications, kpipe's own writes among them: the kernel does not say who
// wrote in a way that survives pid reuse) and asks commit to repair what was
// kpipe's: the chains changed (commit rewrites those it finds unlike what it
// wrote), the jumps from built-in chains, everything when a table was deleted.
// On the legacy backend, which sends no notifications, it keeps a
// KUBE-PROXY-CANARY chain holding one rule in nat and filter (an empty one in
// mangle), checks it every interval, and asks for a full resync when a chain or
// its rule disappears (iptables -X or -F). The canaries are kept on both, as
// kube-proxy keeps them.
package canary

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

var tables = []string{nf.TableMangle, nf.TableNAT, nf.TableFilter}

// maxFailures is how many checks of a family in a row may fail (iptables did not
// answer) before the stage fails, so that the supervisor backs off and restarts it.
const maxFailures = 3

// Canaries is what the stage needs from netfilter (nf.Tool).
type Canaries interface {
	EnsureCanaries(ctx context.Context, tables []string) error
	// CanaryAlive is false, with no error, only when the chain or its rule is gone.
	CanaryAlive(ctx context.Context, table string) (bool, error)
}

// Params wire the canary stage.
type Params struct {
	Interval time.Duration
	// Resync holds the full-resync flag of each family the stage watches.
	Resync map[bus.Family]*bus.ResyncFlag
	// Tools check each family's canaries; nil: iptables (nf.Tool).
	Tools map[bus.Family]Canaries
	// Repairs go to each family's commit (nil: poll only). Subscribe gives the
	// families' changes as they happen; nil: nf_tables notifications for the
	// families whose tool is an nf.Tool.
	Repairs   map[bus.Family]*bus.Mailbox[bus.Repair]
	Subscribe map[bus.Family]Subscribe
	Env       bus.Env
}

// Stage watches the canary chains of every family.
type Stage struct {
	interval time.Duration
	resync   map[bus.Family]*bus.ResyncFlag
	log      *slog.Logger
	tools    map[bus.Family]Canaries
	failures map[bus.Family]int // checks failed in a row
	repairs  map[bus.Family]*bus.Mailbox[bus.Repair]
	subs     map[bus.Family]Subscribe
	started  bool // Run ran before: changes made while it was down went unseen
	// seen are the canaries (by family, then table) seen alive or made: only
	// those count as flushed when gone. noTable are the tables the kernel cannot
	// have (legacy without iptable_mangle): given up, not watched. Both outlive
	// Run, so a restarted stage neither resyncs for a canary that never was nor
	// asks again about a table that cannot be.
	seen, noTable map[bus.Family]map[string]bool
}

// NewStage makes the canary stage.
func NewStage(p Params) *Stage {
	tools := p.Tools
	if tools == nil {
		tools = map[bus.Family]Canaries{}
		for f := range p.Resync {
			tools[f] = nf.Tool{Family: f}
		}
	}
	subs := p.Subscribe
	if subs == nil && p.Repairs != nil {
		subs = map[bus.Family]Subscribe{}
		for f, tool := range tools {
			if t, ok := tool.(nf.Tool); ok {
				subs[f] = subscribeTool(t)
			}
		}
	}
	s := &Stage{interval: p.Interval, resync: p.Resync, log: p.Env.Log, tools: tools, failures: map[bus.Family]int{},
		repairs: p.Repairs, subs: subs, seen: map[bus.Family]map[string]bool{}, noTable: map[bus.Family]map[string]bool{}}
	for f := range tools {
		s.seen[f], s.noTable[f] = map[string]bool{}, map[string]bool{}
	}
	return s
}

// Run repairs what others change (nf_tables) or checks the canaries every
// interval (legacy) until ctx ends.
func (s *Stage) Run(ctx context.Context) error {
	clear(s.failures) // a restart starts the count again
	restarted := s.started
	s.started = true
	for f, tool := range s.tools {
		var err error
		if restarted {
			// Changes made while the stage was down went unseen: a flush shows
			// as a canary gone.
			err = s.check(ctx, f, tool)
		} else {
			err = s.ensure(ctx, f, tool)
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("put the %v canaries in place: %w", f, err)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	changes := make(chan familyChanges)
	polled := map[bus.Family]Canaries{}
	for f, tool := range s.tools {
		sub := s.subscribe(ctx, f)
		if sub == nil {
			polled[f] = tool
			continue
		}
		defer sub.Close()
		go receive(ctx, f, sub, changes)
	}
	var tick <-chan time.Time
	if len(polled) > 0 {
		ticker := time.NewTicker(s.interval)
		defer ticker.Stop()
		tick = ticker.C
	}
	pending := map[bus.Family]*tamper{}
	debounce := time.NewTimer(time.Hour)
	defer debounce.Stop()
	var first time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick:
			for f, tool := range polled {
				if err := s.check(ctx, f, tool); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
			}
		case c := <-changes:
			if c.err != nil && !errors.Is(c.err, nf.ErrLost) {
				return fmt.Errorf("receive the %v nf_tables changes: %w", c.family, c.err)
			}
			now := time.Now()
			if len(pending) == 0 {
				first = now
			}
			t := pending[c.family]
			if t == nil {
				t = &tamper{since: now}
				pending[c.family] = t
			}
			t.add(c.changes)
			t.overflowed = t.overflowed || c.err != nil
			debounce.Reset(min(quiet, first.Add(patience).Sub(now)))
		case <-debounce.C:
			for f, t := range pending {
				if err := s.repair(ctx, f, *t); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
			}
			clear(pending)
		}
	}
}

// familyChanges are changes (or an error) from one family's subscription.
type familyChanges struct {
	family  bus.Family
	changes []nf.Change
	err     error
}

// subscribe subscribes to f's changes, or says (nil) that f is polled.
func (s *Stage) subscribe(ctx context.Context, f bus.Family) Changes {
	if s.subs[f] == nil || s.repairs[f] == nil {
		return nil
	}
	sub, err := s.subs[f](ctx)
	if errors.Is(err, nf.ErrNotNFTables) {
		s.log.Info("legacy iptables: checking the canaries every interval", "family", f, "interval", s.interval)
		return nil
	}
	if err != nil {
		s.log.Warn("cannot receive nf_tables changes; checking the canaries every interval", "family", f, "interval", s.interval, "err", err)
		return nil
	}
	return sub
}

// receive passes f's changes on until ctx ends or the subscription fails.
func receive(ctx context.Context, f bus.Family, sub Changes, out chan<- familyChanges) {
	for {
		cs, err := sub.Next(ctx)
		if ctx.Err() != nil {
			return
		}
		select {
		case out <- familyChanges{family: f, changes: cs, err: err}:
		case <-ctx.Done():
			return
		}
		if err != nil && !errors.Is(err, nf.ErrLost) {
			return
		}
	}
}

// repair hands what another writer changed of kpipe's to commit, and puts the
// canaries back when they were touched (no resync: commit repairs the rest).
//
// When notifications were lost it cannot know what changed: rewriting everything
// would be wrong (kpipe's own large writes overflow the socket, and a full sync
// would overflow it again), so it looks at the canaries, as the legacy poll
// does: one gone means a flush, and everything is rewritten.
func (s *Stage) repair(ctx context.Context, f bus.Family, t tamper) error {
	if t.overflowed {
		for _, table := range s.watched(f) {
			alive, err := s.tools[f].CanaryAlive(ctx, table)
			if err != nil {
				s.log.Warn("nf_tables changes lost, and cannot check the canary", "family", f, "table", table, "err", err)
				break
			}
			if !alive && s.seen[f][table] {
				t.lost = true
				break
			}
		}
	}
	rep, canaries := repairFor(t)
	if !rep.Empty() {
		// Debug: kpipe's own writes are among the changes, and commit says
		// what it found to repair.
		s.log.Debug("kpipe's rules changed; asking commit to check them", "family", f, "changes", len(t.changes), "lost", rep.Lost)
		s.repairs[f].Put(rep)
	}
	if canaries {
		if err := s.ensure(ctx, f, s.tools[f]); err != nil {
			return fmt.Errorf("put the %v canaries back: %w", f, err)
		}
	}
	return nil
}

// check asks for a full resync of family f when a canary seen alive before is
// gone, and puts the canaries back. An iptables error is not a flush (a resync
// would rewrite every rule for nothing): it is logged and counted, and only
// after maxFailures in a row does check fail.
func (s *Stage) check(ctx context.Context, f bus.Family, tool Canaries) error {
	for _, t := range s.watched(f) {
		alive, err := tool.CanaryAlive(ctx, t)
		if s.giveUp(f, t, err) {
			continue
		}
		if err != nil {
			s.failures[f]++
			if s.failures[f] >= maxFailures {
				return fmt.Errorf("check the %v canary in %s (%d failures in a row): %w", f, t, s.failures[f], err)
			}
			s.log.Warn("cannot check the canary; trying again at the next tick", "family", f, "table", t,
				"failures_in_a_row", s.failures[f], "err", err)
			return nil
		}
		if alive {
			s.seen[f][t] = true
			continue
		}
		// A canary never seen (its making failed) is made, not taken for a flush.
		if s.seen[f][t] {
			s.log.Warn("canary gone: the tables were flushed; resyncing", "family", f, "table", t)
			s.resync[f].Raise() // first: a failure to put the canary back must not lose it
		}
		if err := s.ensure(ctx, f, tool); err != nil {
			return fmt.Errorf("put the %v canaries back: %w", f, err)
		}
		break
	}
	s.failures[f] = 0
	return nil
}

// ensure puts f's canaries in place, table by table, giving up the tables the
// kernel cannot have.
func (s *Stage) ensure(ctx context.Context, f bus.Family, tool Canaries) error {
	for _, t := range s.watched(f) {
		err := tool.EnsureCanaries(ctx, []string{t})
		if s.giveUp(f, t, err) {
			continue
		}
		if err != nil {
			return err
		}
		s.seen[f][t] = true
	}
	return nil
}

// giveUp stops watching table t of family f when err says the kernel cannot
// have it (kube-proxy keeps retrying such a canary every interval and never
// watches the others).
func (s *Stage) giveUp(f bus.Family, t string, err error) bool {
	if !errors.Is(err, nf.ErrNoTable) {
		return false
	}
	s.noTable[f][t] = true
	s.log.Warn("no canary in a table the kernel does not have; watching the other tables", "family", f, "table", t, "err", err)
	return true
}

// watched are f's tables that can hold a canary.
func (s *Stage) watched(f bus.Family) []string {
	var out []string
	for _, t := range tables {
		if !s.noTable[f][t] {
			out = append(out, t)
		}
	}
	return out
}
