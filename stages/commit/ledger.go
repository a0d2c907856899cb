package commit

import (
	"net/netip"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Hash: render's 64-bit hash of a chain's rule text (bus.Chain.Hash); equal to the ledger's, nothing to write.
// Digest: the kernel's digest of the rules a chain holds there (Kernel.Digests, read); equal digests, same rules.
// Expected digest: the digest a chain holding some rule text would have, worked out without reading (Kernel.ExpectedDigest).

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
	chains map[string]map[string]known // by table, then chain
	unsure map[chainKey]bool           // a write to these began and was not confirmed
	// tried holds, for filter chains in doubt, the rules of the writes that
	// began and were not confirmed: the kernel may hold them (see oldRules).
	tried map[chainKey]string
	// stuck are chains kpipe no longer wants and the kernel would not delete
	// (another agent's rule still jumps to them): emptied, out of chains and
	// unsure so that no commit trips over them again, retried at each full and
	// periodic sync (Stage.deleteUnwanted).
	stuck map[chainKey]bool
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
	return &Ledger{chains: map[string]map[string]known{}, unsure: map[chainKey]bool{}, tried: map[chainKey]string{}, stuck: map[chainKey]bool{}}
}

// chainKey names a chain of a table.
type chainKey struct{ table, chain string }

func key(table, chain string) chainKey { return chainKey{table, chain} }

// reset forgets what the ledger knew, for a full sync, which rewrites everything.
// The stuck chains stay: the full sync tries them again with its stale chains.
func (l *Ledger) reset() {
	l.synced = false
	l.chains = map[string]map[string]known{}
	l.unsure = map[chainKey]bool{}
	l.tried = map[chainKey]string{}
}

// differs says whether c must be written: kpipe never wrote it, wrote other
// rules, or a write to it may have been cut short. known: the ledger has it.
func (l *Ledger) differs(table string, c bus.Chain) (differs, known bool) {
	old, ok := l.chains[table][c.Name]
	return !ok || old.hash != c.Hash || len(l.unsure) > 0 && l.unsure[key(table, c.Name)], ok
}

// droppedOnly lists the chains to delete when the plan's Dropped hint
// accounts for them all: no chain in doubt, and every chain the ledger has
// for the table is either in the plan (known of them) or in Dropped. Not ok:
// unwanted must go through the ledger.
func (l *Ledger) droppedOnly(tp bus.TablePayload, known int) (out []string, ok bool) {
	if len(l.unsure) > 0 {
		return nil, false
	}
	for _, name := range tp.Dropped {
		if _, has := l.chains[tp.Table][name]; has && nf.KindOf(name).Disposable() {
			out = append(out, name)
		}
	}
	if known+len(out) != len(l.chains[tp.Table]) {
		return nil, false
	}
	sortForDelete(out)
	return out, true
}

// unwanted lists the per-service chains of table that kpipe wrote (or may have
// written) and the plan does not have.
func (l *Ledger) unwanted(table string, wanted map[string]bool) []string {
	var out []string
	drop := func(chain string) bool { return !wanted[chain] && nf.KindOf(chain).Disposable() }
	for chain := range l.chains[table] {
		if drop(chain) {
			out = append(out, chain)
		}
	}
	for k := range l.unsure {
		if _, known := l.chains[table][k.chain]; k.table == table && !known && drop(k.chain) {
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
	delete(l.stuck, k)
	if o.deleted {
		delete(l.chains[o.table], o.chain)
		return
	}
	kn := known{hash: o.hash}
	if o.table == nf.TableFilter {
		kn.rules = o.rules
	}
	if l.chains[o.table] == nil {
		l.chains[o.table] = map[string]known{}
	}
	l.chains[o.table][o.chain] = kn
}

// oldRules are the rules a filter chain may hold now, if kpipe knows them:
// what it last wrote there and, while a later write is in doubt, that write's
// rules too (the kernel took it or not). The first pass of a write keeps them
// all as guards: a write rejected or cut short must not leave the next one
// without the REJECT and DROP rules the nat table may still rely on.
func (l *Ledger) oldRules(table, chain string) (string, bool) {
	old, ok := l.chains[table][chain]
	tried, doubted := l.tried[key(table, chain)]
	if !ok && !doubted {
		return "", false
	}
	return old.rules + tried, true
}

// sawKernel records the kernel's digest of a chain kpipe just wrote.
func (l *Ledger) sawKernel(table, chain string, digest uint64) {
	if kn, ok := l.chains[table][chain]; ok {
		kn.listed, kn.seen = digest, true
		l.chains[table][chain] = kn
	}
}

// matches says whether the kernel's digest of a chain is the one kpipe read back
// after writing it.
func (l *Ledger) matches(table, chain string, digest uint64) bool {
	kn, ok := l.chains[table][chain]
	return ok && kn.seen && kn.listed == digest
}

// suspect marks a chain another writer changed as in doubt, so that the next
// write rewrites it (or deletes it, if no longer wanted). A chain kpipe did not
// write is not kpipe's to repair.
func (l *Ledger) suspect(table, chain string) {
	if _, ok := l.chains[table][chain]; ok {
		l.unsure[key(table, chain)] = true
	}
}

// stick records a chain the kernel would not delete, which kpipe has emptied:
// the ledger no longer holds it as written or in doubt, so that plans do not
// try to delete it again and again. new: it was not stuck before.
func (l *Ledger) stick(table, chain string) (new bool) {
	k := key(table, chain)
	delete(l.chains[table], chain)
	delete(l.unsure, k)
	delete(l.tried, k)
	new = !l.stuck[k]
	l.stuck[k] = true
	return new
}

// stuckIn lists table's stuck chains, in the order to delete them.
func (l *Ledger) stuckIn(table string) []string {
	var out []string
	for k := range l.stuck {
		if k.table == table {
			out = append(out, k.chain)
		}
	}
	sortForDelete(out)
	return out
}

// keepStuck keeps stuck only the chains of table that keep (a full sync: the
// stale chains it found in the kernel; a stuck chain no longer there is gone).
func (l *Ledger) keepStuck(table string, keep []string) {
	in := make(map[string]bool, len(keep))
	for _, c := range keep {
		in[c] = true
	}
	for k := range l.stuck {
		if k.table == table && !in[k.chain] {
			delete(l.stuck, k)
		}
	}
}
