package bus

import (
	"net/netip"
	"time"
)

// Snapshot is coalesce's hand-off to render: the whole desired state plus what
// changed since the last successful commit. It is never modified after it is sent.
type Snapshot struct {
	Generation uint64
	State      State
	// Changed lists the services whose desired rules may differ from the last
	// successful commit. Full means every service must be rewritten (start-up, a
	// failed commit, a canary that disappeared).
	Changed map[ServiceKey]bool
	Full    bool
	// Refresh asks for kube-proxy's periodic sync: the top-level chains are
	// rewritten and the jumps into them re-ensured even if nothing changed, so a
	// rule removed by hand comes back within --iptables-sync-period.
	Refresh bool
	// QueuedAt is when the oldest change this snapshot carries was queued.
	QueuedAt time.Time
	// Committed is what the last successful commit of this family left in the
	// kernel (nil before the first), so render can write only what differs.
	Committed *Programmed
}

// Plan is render's hand-off to commit: iptables-restore payloads and what the
// kernel will hold once they are applied.
type Plan struct {
	Family     Family
	Generation uint64
	QueuedAt   time.Time
	Full       bool
	Refresh    bool
	Started    time.Time // when render began, for the sync duration metrics
	Tables     []TablePayload
	Programmed *Programmed
	// HealthChecks are the healthCheckNodePort answers this plan implies.
	HealthChecks HealthChecks
	// NoLocalEndpoints counts services with a Local policy and no local endpoints,
	// by "internal" / "external" (kubeproxy_sync_proxy_rules_no_local_endpoints_total).
	NoLocalEndpoints map[string]int
}

// TablePayload is what render wants written to one table: the chains to rewrite
// (iptables-restore --noflush empties a declared chain before refilling it, and
// leaves every other chain alone) and the chains to delete.
type TablePayload struct {
	Table  string  // "nat", "filter"
	Chains []Chain // chains whose rules are replaced (and created if missing)
	Delete []string
	// RuleCount is the number of rules the table holds once applied (not only the
	// rewritten ones), for kubeproxy_sync_proxy_rules_iptables_total.
	RuleCount int
}

// Chain is one chain's complete rules, as "-A CHAIN ..." lines.
type Chain struct {
	Name  string
	Rules []byte
}

// Programmed describes what a committed plan left in the kernel.
type Programmed struct {
	// Chains maps each kpipe-owned chain, as "table/chain", to a hash of its rules.
	Chains map[string]uint64
	// UDP maps each UDP front-end (service IP:port; NodePorts as the unspecified
	// address with the node port) to the endpoints it load-balances to, so the
	// conntrack stage can clear flows that point anywhere else.
	UDP map[netip.AddrPort][]netip.AddrPort
}

// Result is commit's answer for one plan.
type Result struct {
	Family     Family
	Generation uint64
	OK         bool
	Err        error
	Full       bool
	At         time.Time
	Programmed *Programmed // set when OK
}
