package commit

import (
	"net/netip"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Ledger is commit's record of what it left in the kernel, so that a plan is
// written as the difference from the kernel, not from the last plan that was
// acknowledged. It outlives the commit stage (serve makes it): a commit killed in
// the middle of a write leaves those chains "in doubt", and the restarted stage
// rewrites them (or deletes them, if they are no longer wanted), whatever the
// plan it was writing did to them. One commit Run uses it at a time.
type Ledger struct {
	// synced: a full sync completed since the ledger was made, so chains
	// describes the kernel (before it, every plan is written as a full sync).
	synced bool
	chains map[chainKey]known
	unsure map[chainKey]bool // a write to these began and was not confirmed
	// tried holds, for filter chains in doubt, the rules of the writes that
	// began and were not confirmed: the kernel may hold them (see oldRules).
	tried map[chainKey]string
	// udp is the UDP front-end map of the last successful commit (haveUDP), for
	// the conntrack stage.
	udp     map[netip.AddrPort][]netip.AddrPort
	haveUDP bool
}

// known is what kpipe last wrote to one chain.
type known struct {
	hash uint64 // render's hash of the rules written
	// listed is the kernel's digest of the chain, read back after the write
	// (seen), to notice later changes made behind kpipe's back.
	listed uint64
	seen   bool
	// rules are kept for filter chains: during a write, their old REJECT and DROP
	// rules stay until the nat table has moved (see writes.steps).
	rules string
}

// NewLedger makes an empty ledger: the first plan is written as a full sync.
func NewLedger() *Ledger {
	return &Ledger{chains: map[chainKey]known{}, unsure: map[chainKey]bool{}, tried: map[chainKey]string{}}
}

// chainKey names a chain of a table.
type chainKey struct{ table, chain string }

func key(table, chain string) chainKey { return chainKey{table, chain} }

// reset forgets what the ledger knew, for a full sync, which rewrites everything.
func (l *Ledger) reset() {
	l.synced = false
	l.chains = map[chainKey]known{}
	l.unsure = map[chainKey]bool{}
	l.tried = map[chainKey]string{}
}

// differs says whether c must be written: kpipe never wrote it, wrote other
// rules, or a write to it may have been cut short.
func (l *Ledger) differs(table string, c bus.Chain) bool {
	k := key(table, c.Name)
	old, ok := l.chains[k]
	return !ok || old.hash != c.Hash || l.unsure[k]
}

// unwanted lists the per-service chains of table that kpipe wrote (or may have
// written) and the plan does not have.
func (l *Ledger) unwanted(table string, wanted map[string]bool) []string {
	var out []string
	drop := func(k chainKey) bool { return k.table == table && !wanted[k.chain] && nf.KindOf(k.chain).Disposable() }
	for k := range l.chains {
		if drop(k) {
			out = append(out, k.chain)
		}
	}
	for k := range l.unsure {
		if _, known := l.chains[k]; !known && drop(k) {
			out = append(out, k.chain)
		}
	}
	sortForDelete(out)
	return out
}

// doubt marks an operation's chain as possibly half-written.
func (l *Ledger) doubt(o op) {
	k := key(o.table, o.chain)
	l.unsure[k] = true
	if o.table == nf.TableFilter && !o.deleted {
		// Each line once: a write retried while it keeps failing adds nothing new.
		l.tried[k] = withLines(l.tried[k], o.rules)
	}
}

// confirm records an operation the kernel has taken.
func (l *Ledger) confirm(o op) {
	k := key(o.table, o.chain)
	delete(l.unsure, k)
	delete(l.tried, k)
	if o.deleted {
		delete(l.chains, k)
		return
	}
	kn := known{hash: o.hash}
	if o.table == nf.TableFilter {
		kn.rules = o.rules
	}
	l.chains[k] = kn
}

// oldRules are the rules a filter chain may hold now, if kpipe knows them:
// what it last wrote there and, while a later write is in doubt, that write's
// rules too (the kernel took it or not). The first pass of a write keeps them
// all as guards: a write rejected or cut short must not leave the next one
// without the REJECT and DROP rules the nat table may still rely on.
func (l *Ledger) oldRules(table, chain string) (string, bool) {
	k := key(table, chain)
	old, ok := l.chains[k]
	tried, doubted := l.tried[k]
	if !ok && !doubted {
		return "", false
	}
	return old.rules + tried, true
}

// sawKernel records the kernel's digest of a chain kpipe just wrote.
func (l *Ledger) sawKernel(table, chain string, digest uint64) {
	k := key(table, chain)
	if kn, ok := l.chains[k]; ok {
		kn.listed, kn.seen = digest, true
		l.chains[k] = kn
	}
}

// matches says whether the kernel's digest of a chain is the one kpipe read back
// after writing it.
func (l *Ledger) matches(table, chain string, digest uint64) bool {
	kn, ok := l.chains[key(table, chain)]
	return ok && kn.seen && kn.listed == digest
}

// suspect marks a chain another writer changed as in doubt, so that the next
// write rewrites it (or deletes it, if no longer wanted). A chain kpipe did not
// write is not kpipe's to repair.
func (l *Ledger) suspect(table, chain string) {
	k := key(table, chain)
	if _, ok := l.chains[k]; ok {
		l.unsure[k] = true
	}
}
