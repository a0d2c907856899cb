package bus

import (
	"maps"
	"time"
)

// Repair asks commit to put back what another writer changed in kpipe's rules
// (canary → commit, merging mailbox per family): rewrite the chains named that
// the kernel does not hold as kpipe wrote them, put kpipe's missing jumps back
// in the tables named, or, when Lost, rewrite everything as a full sync. Commit
// rewrites only chains its ledger says it wrote, and inserts only its own
// missing jumps: another agent's rules are never touched.
type Repair struct {
	// Chains are kpipe's chains that changed, by table: notifications do not
	// say who changed them, so kpipe's own writes are named too.
	Chains map[string]map[string]bool
	// Jumps are the tables whose built-in chains lost a rule: a jump of
	// kpipe's may be missing.
	Jumps map[string]bool
	// Lost: a table was deleted, or changes went unseen.
	Lost bool
	// Since is when the first change this repair answers was seen.
	Since time.Time
}

// Empty says whether r asks for nothing.
func (r Repair) Empty() bool { return !r.Lost && len(r.Chains) == 0 && len(r.Jumps) == 0 }

// MergeRepairs folds a newer repair request into one not yet taken.
func MergeRepairs(old, new Repair) Repair {
	out := Repair{Chains: map[string]map[string]bool{}, Jumps: map[string]bool{}, Lost: old.Lost || new.Lost,
		Since: earliest(old.Since, new.Since)}
	for _, r := range []Repair{old, new} {
		maps.Copy(out.Jumps, r.Jumps)
		for table, chains := range r.Chains {
			if out.Chains[table] == nil {
				out.Chains[table] = map[string]bool{}
			}
			maps.Copy(out.Chains[table], chains)
		}
	}
	return out
}
