package bus

import (
	"maps"
	"net/netip"
	"slices"
	"time"
)

// Snapshot is coalesce's hand-off to render: the whole desired state. It is never
// modified after it is sent.
type Snapshot struct {
	Generation uint64
	State      State
	// Changed lists the services whose desired rules may differ from the last
	// successful commit (for tests and logs; render and commit find what differs
	// themselves).
	Changed map[ServiceKey]bool
	// Full asks commit to rewrite every chain and delete every per-service chain it
	// does not want, whatever it believes the kernel holds (start-up, a failed
	// commit, flushed tables, the hourly full sync).
	Full bool
	// Refresh asks for kube-proxy's periodic sync: commit checks the top-level and
	// bucket chains and the jumps into them against the kernel and rewrites what
	// differs, so a rule removed or changed by hand comes back within
	// --iptables-sync-period.
	Refresh bool
	// QueuedAt is when the oldest change this snapshot carries was queued.
	QueuedAt time.Time
}

// Plan is render's hand-off to commit: every chain of the desired ruleset of one
// family, with its hash. Commit writes only the chains that differ from what it
// knows the kernel holds.
type Plan struct {
	Family     Family
	Generation uint64
	QueuedAt   time.Time
	Full       bool
	Refresh    bool
	Started    time.Time // when render began, for the sync duration metrics
	Tables     []TablePayload
	// UDP maps each UDP front-end (service IP:port; NodePorts as the unspecified
	// address with the node port) to the endpoints it load-balances to, so the
	// conntrack stage can clear flows that point anywhere else.
	UDP map[netip.AddrPort][]netip.AddrPort
	// HealthChecks are the healthCheckNodePort answers this plan implies.
	HealthChecks HealthChecks
	// NoLocalEndpoints counts services with a Local policy and no local endpoints
	// (kubeproxy_sync_proxy_rules_no_local_endpoints_total).
	NoLocalEndpoints NoLocal
	// Unserved names the service ports without endpoints (for kpipe status).
	Unserved *Unserved
}

// Table is the plan's payload for table ("nat", "filter"), nil when it has none.
func (p *Plan) Table(table string) *TablePayload {
	for i := range p.Tables {
		if p.Tables[i].Table == table {
			return &p.Tables[i]
		}
	}
	return nil
}

// NoLocal counts services whose traffic policy is Local and that have no
// local endpoint, by the policy: internalTrafficPolicy or externalTrafficPolicy.
type NoLocal struct{ Internal, External int }

// Plus is n with m's counts added.
func (n NoLocal) Plus(m NoLocal) NoLocal {
	return NoLocal{Internal: n.Internal + m.Internal, External: n.External + m.External}
}

// Minus is n with m's counts taken away.
func (n NoLocal) Minus(m NoLocal) NoLocal {
	return NoLocal{Internal: n.Internal - m.Internal, External: n.External - m.External}
}

// Unserved names the service ports ("ns/name:port") whose traffic has no
// endpoint to go to: with no endpoints at all (their rules REJECT), or with a
// Local traffic policy and no endpoint on this node (their rules DROP what that
// policy covers).
type Unserved struct {
	NoEndpoints      Names `json:"noEndpoints"`
	NoLocalEndpoints Names `json:"noLocalEndpoints"`
}

// MaxNames bounds Names.First: a node with 50,000 services without endpoints
// must not make a huge status answer.
const MaxNames = 100

// Names are the first MaxNames of a set of names in order, and how many it has.
type Names struct {
	First []string `json:"first,omitempty"`
	Total int      `json:"total"`
}

// NamesOf is the sorted, bounded Names of set.
func NamesOf(set map[string]bool) Names {
	all := slices.Sorted(maps.Keys(set))
	return Names{First: all[:min(len(all), MaxNames):min(len(all), MaxNames)], Total: len(all)}
}

// TablePayload is every chain kpipe wants in one table, in dependency order: a
// chain after the chains it jumps to (netfilter.Rank), the top-level chains last.
type TablePayload struct {
	Table  string // "nat", "filter"
	Chains []Chain
	// RuleCount is the number of rules the table holds once applied, for
	// kubeproxy_sync_proxy_rules_iptables_total.
	RuleCount int
	// Dropped names chains the renderer's previous plan had and this one does
	// not, none twice. It is a hint: commit deletes what its ledger has and
	// the plan does not, and uses Dropped to find that without going through
	// the whole ledger when the two account for every chain it has.
	Dropped []string
}

// Chain is one chain's complete rules, as "-A CHAIN ...\n" lines, and their hash.
type Chain struct {
	Name  string
	Rules string
	Hash  uint64
}

// Result is commit's answer for one plan.
type Result struct {
	Family     Family
	Generation uint64
	OK         bool
	Err        error
	Full       bool
	Refresh    bool
	At         time.Time
}
