package canary

import (
	"context"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Changes are another writer's changes to one family's tables, as they happen
// (nf.Subscription).
type Changes interface {
	// Next waits for changes; nf.ErrLost says some were lost.
	Next(ctx context.Context) ([]nf.Change, error)
	Close() error
}

// Subscribe starts receiving a family's changes; nf.ErrNotNFTables (the legacy
// backend) or any other error: the family is polled instead.
type Subscribe func(ctx context.Context) (Changes, error)

// subscribeTool subscribes with the real nf_tables notifications.
func subscribeTool(t nf.Tool) Subscribe {
	return func(ctx context.Context) (Changes, error) {
		sub, err := t.Subscribe(ctx)
		if err != nil {
			return nil, err
		}
		return sub, nil
	}
}

// Debouncing: a repair waits until no change came for quiet, but never longer
// than patience after the first change. One tamper is often several iptables
// runs (-F, then -X): a repair between them makes the -X fail (the chain is in
// use again, or holds its rules again); 50 ms was too short for two runs of
// `ip netns exec … iptables` on a loaded host (TestCanaryRepairsFlushedNAT).
// Both stay inside the 1 s a repair may take.
const (
	quiet    = 200 * time.Millisecond
	patience = 500 * time.Millisecond
)

// tamper collects one family's changes until they are handed to commit.
type tamper struct {
	changes []nf.Change // each once: a write of kpipe's sends one per rule
	seen    map[nf.Change]bool
	// overflowed: notifications were lost (kpipe's own full syncs can send more
	// than the socket holds); lost: a canary is gone as well, so everything is
	// rewritten.
	overflowed, lost bool
	since            time.Time
}

// add collects changes not collected yet.
func (t *tamper) add(cs []nf.Change) {
	if t.seen == nil {
		t.seen = map[nf.Change]bool{}
	}
	for _, c := range cs {
		if !t.seen[c] {
			t.seen[c] = true
			t.changes = append(t.changes, c)
		}
	}
}

// jumpChains are the built-in chains kpipe puts jumps in, by table.
var jumpChains = func() map[string]map[string]bool {
	out := map[string]map[string]bool{}
	for _, j := range nf.Jumps(true) {
		if out[j.Table] == nil {
			out[j.Table] = map[string]bool{}
		}
		out[j.Table][j.From] = true
	}
	return out
}()

// ruleTables are the tables holding kpipe's chains (mangle holds only a canary).
var ruleTables = map[string]bool{nf.TableNAT: true, nf.TableFilter: true}

// repairFor says what of kpipe's was changed: the chains to check (kpipe's own
// writes are among them; commit rewrites those unlike what it wrote),
// the tables whose built-in chains may have lost a jump of kpipe's, whether
// everything must be rewritten (a table deleted or flushed, as a canary gone
// tells), and whether a canary must be put back (canaries). Lost notifications
// only have the jumps checked: a flush among them shows as a canary gone (see
// Stage.repair), rules changed in place are left to the periodic and hourly
// syncs. A rule added to a built-in chain asks for nothing: it cannot take a
// jump of kpipe's away, and where another agent puts its rules is its own
// business (kpipe never moves its jumps back in front of them, as kube-proxy
// never does). Changes to anything else (other agents' chains, other tables)
// ask for nothing.
func repairFor(t tamper) (rep bus.Repair, canaries bool) {
	rep = bus.Repair{Chains: map[string]map[string]bool{}, Jumps: map[string]bool{}, Lost: t.lost, Since: t.since}
	if t.overflowed || t.lost {
		for table := range ruleTables {
			rep.Jumps[table] = true
		}
		canaries = t.lost
	}
	for _, c := range t.changes {
		if c.Table != nf.TableMangle && !ruleTables[c.Table] {
			continue
		}
		switch {
		case c.Kind == nf.TableDeleted:
			canaries = true
			if ruleTables[c.Table] {
				rep.Lost, rep.Jumps[c.Table] = true, true
			}
		case c.Kind == nf.TableAdded:
		case c.Chain == nf.ChainCanary:
			// A canary gone means what it means to kube-proxy (and to the
			// legacy poll): the table was flushed; rewrite everything.
			if c.Kind == nf.RuleDeleted || c.Kind == nf.ChainDeleted {
				canaries, rep.Lost = true, true
			}
		case !ruleTables[c.Table]:
		case nf.KindOf(c.Chain) != nf.KindOther:
			if rep.Chains[c.Table] == nil {
				rep.Chains[c.Table] = map[string]bool{}
			}
			rep.Chains[c.Table][c.Chain] = true
		case jumpChains[c.Table][c.Chain] && (c.Kind == nf.RuleDeleted || c.Kind == nf.ChainDeleted):
			rep.Jumps[c.Table] = true
		}
	}
	return rep, canaries
}
