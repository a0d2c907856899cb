// Package fakekernel is an in-memory netfilter for tests: it takes
// iptables-restore payloads the way the kernel does and satisfies commit.Kernel.
package fakekernel

import (
	"context"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"strings"
	"sync"

	nf "github.com/kpipe/kpipe/netfilter"
)

// Kernel is an in-memory netfilter that takes iptables-restore payloads the way
// the kernel does: each "*table ... COMMIT" block is one transaction, a rule
// may only jump to a chain that exists, and a chain that another chain jumps to
// cannot be deleted. Tests make it fail or stall on demand and watch every state
// it goes through.
type Kernel struct {
	Mu     sync.Mutex
	Tables map[string]map[string][]string // table → chain → "-A ..." lines
	// Restores counts Restore calls; Blocks counts committed transactions.
	Restores, Blocks int
	Payloads         []string
	Events           []string // "restore", "jumps", "sysctl ..."
	// BeforeRestore, if set, runs before a payload is applied; an error fails
	// that Restore with nothing applied.
	BeforeRestore func(n int, payload string) error
	// BeforeCommit, if set, runs at each "COMMIT" before the transaction is
	// taken; an error rejects it, as the kernel rejects a payload, and ends the
	// run there: the transactions before it in the payload stay committed, the
	// ones after it are not tried (iptables-restore stops at the first failure).
	BeforeCommit func(table string) error
	// StallAfter, if set and true for a call, makes Restore wait for its context
	// to end after the payload was applied: a commit killed after the kernel took
	// the write but before it heard so.
	StallAfter func(n int) bool
	// Observe, if set, is called with each committed state of a table.
	Observe func(table string, chains map[string][]string)
	// Busy, if set and true for a chain, makes Digests leave the chain out and
	// return netfilter.ErrBusy with the others, as netfilter.Tool does with the
	// chains it could not read while another writer kept changing the ruleset.
	Busy func(table, chain string) bool
}

// New makes an empty kernel with nat and filter tables.
func New() *Kernel {
	return &Kernel{Tables: map[string]map[string][]string{nf.TableNAT: {}, nf.TableFilter: {}}}
}

// Prepare returns Restore of payload.
func (k *Kernel) Prepare(payload []byte) func(context.Context) error {
	return func(ctx context.Context) error { return k.Restore(ctx, payload) }
}

func (k *Kernel) Restore(ctx context.Context, payload []byte) error {
	k.Mu.Lock()
	k.Restores++
	n := k.Restores
	k.Payloads = append(k.Payloads, string(payload))
	k.Events = append(k.Events, "restore")
	before, stall := k.BeforeRestore, k.StallAfter
	k.Mu.Unlock()
	if before != nil {
		if err := before(n, string(payload)); err != nil {
			return err
		}
	}
	if err := k.apply(string(payload)); err != nil {
		return err
	}
	if stall != nil && stall(n) {
		<-ctx.Done()
		return ctx.Err()
	}
	return ctx.Err()
}

func (k *Kernel) apply(payload string) error {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	var table string
	var work map[string][]string
	for _, line := range strings.Split(payload, "\n") {
		switch {
		case line == "":
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			work = map[string][]string{}
			for c, r := range k.Tables[table] {
				work[c] = slices.Clone(r)
			}
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			work[name] = nil
		case strings.HasPrefix(line, "-A "):
			r, err := nf.ParseRule(line)
			if err != nil {
				return fmt.Errorf("fake: %q: %w", line, err)
			}
			if _, ok := work[r.Chain]; !ok {
				return fmt.Errorf("fake: -A into missing chain %s", r.Chain)
			}
			if to := r.Target.JumpsTo(); to != "" {
				if _, ok := work[to]; !ok {
					return fmt.Errorf("fake: %s jumps to missing chain %s", r.Chain, to)
				}
			}
			work[r.Chain] = append(work[r.Chain], line)
		case strings.HasPrefix(line, "-X "):
			name := strings.TrimSpace(line[3:])
			if _, ok := work[name]; !ok {
				return fmt.Errorf("fake: -X of missing chain %s", name)
			}
			delete(work, name)
		case line == "COMMIT":
			if k.BeforeCommit != nil {
				if err := k.BeforeCommit(table); err != nil {
					return err
				}
			}
			// The kernel refuses to delete a chain that a rule still jumps to.
			for c, rules := range work {
				for _, line := range rules {
					r, err := nf.ParseRule(line)
					if err != nil {
						return fmt.Errorf("fake: %s/%s: %q: %w", table, c, line, err)
					}
					if to := r.Target.JumpsTo(); to != "" {
						if _, ok := work[to]; !ok {
							return fmt.Errorf("fake: %s/%s: %s still jumps to deleted chain %s", table, c, line, to)
						}
					}
				}
			}
			k.Tables[table] = work
			k.Blocks++
			if k.Observe != nil {
				k.Observe(table, work)
			}
		default:
			return fmt.Errorf("fake: cannot parse %q", line)
		}
	}
	return nil
}

func (k *Kernel) Save(_ context.Context, table string) (map[string][]string, error) {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	out := map[string][]string{}
	for c, r := range k.Tables[table] {
		out[c] = slices.Clone(r)
	}
	return out, nil
}

func (k *Kernel) Digests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	all, _ := k.Save(ctx, table)
	k.Mu.Lock()
	busy := k.Busy
	k.Mu.Unlock()
	out := map[string]uint64{}
	unread := 0
	for c, rules := range all {
		switch {
		case names != nil && !slices.Contains(names, c):
		case busy != nil && busy(table, c):
			unread++
		default:
			out[c] = digestOf(rules)
		}
	}
	if unread > 0 {
		return out, fmt.Errorf("fake: %d chains of %s unread: %w", unread, table, nf.ErrBusy)
	}
	return out, nil
}

// ExpectedDigest is the digest of the "-A" lines of rules, as Digests computes it.
func (k *Kernel) ExpectedDigest(_ context.Context, _, rules string) (uint64, bool) {
	var lines []string
	for line := range strings.Lines(rules) {
		if line = strings.TrimSpace(line); line != "" {
			lines = append(lines, line)
		}
	}
	return digestOf(lines), true
}

func digestOf(rules []string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(strings.Join(rules, "\n")))
	return h.Sum64()
}

// Generation stands for nf_tables' ruleset generation: it changes whenever
// the tables do, however a test changed them (through Restore or by hand in
// Tables). It is a digest of every table, so a change undone gives the
// generation back, as nothing a reader holds is wrong then.
func (k *Kernel) Generation(context.Context) (uint32, error) {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	h := fnv.New32a()
	for _, table := range slices.Sorted(maps.Keys(k.Tables)) {
		for _, chain := range slices.Sorted(maps.Keys(k.Tables[table])) {
			fmt.Fprintf(h, "%s %s\n", table, chain)
			for _, rule := range k.Tables[table][chain] {
				fmt.Fprintln(h, rule)
			}
		}
	}
	return h.Sum32(), nil
}

// ListChain returns the rules of chain ("-A ..." lines), as netfilter.Tool's
// does; netfilter.ErrNoChain when it does not exist.
func (k *Kernel) ListChain(_ context.Context, table, chain string) ([]string, error) {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	rules, ok := k.Tables[table][chain]
	if !ok {
		return nil, fmt.Errorf("fake: %s/%s: %w", table, chain, nf.ErrNoChain)
	}
	return slices.Clone(rules), nil
}

func (k *Kernel) ChainNames(ctx context.Context, table string) ([]string, error) {
	all, _ := k.Save(ctx, table)
	return slices.Sorted(maps.Keys(all)), nil
}

// EnsureJumps records "jumps" for every table's jumps, "jumps <table>" for one's.
func (k *Kernel) EnsureJumps(_ context.Context, js []nf.Jump) error {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	tables := map[string]bool{}
	for _, j := range js {
		tables[j.Table] = true
	}
	if len(tables) == 1 {
		k.Events = append(k.Events, "jumps "+js[0].Table)
		return nil
	}
	k.Events = append(k.Events, "jumps")
	return nil
}

func (k *Kernel) WriteSysctl(name, value string) error {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	k.Events = append(k.Events, "sysctl "+name+"="+value)
	return nil
}

// RuleHandles lists the chains' rules as handles and digests, as
// netfilter.Tool does: a rule's handle here is a hash of its line, so a
// handle names the rule it was listed for until that rule goes.
func (k *Kernel) RuleHandles(_ context.Context, table string, chains []string) (map[string]nf.ChainRules, error) {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	out := map[string]nf.ChainRules{}
	for _, chain := range chains {
		rules, ok := k.Tables[table][chain]
		if !ok {
			continue
		}
		handles := make([]uint64, len(rules))
		for i, r := range rules {
			handles[i] = handleOf(r)
		}
		out[chain] = nf.ChainRules{Handles: handles, Digest: digestOf(rules)}
	}
	return out, nil
}

// DeleteRules deletes rules by handle in one transaction (counted in Blocks,
// "delete-rules" in Events), all or none: a handle no chain holds refuses
// it. BeforeCommit can refuse it too.
func (k *Kernel) DeleteRules(_ context.Context, table string, refs []nf.RuleRef) error {
	k.Mu.Lock()
	k.Events = append(k.Events, "delete-rules")
	before := k.BeforeCommit
	k.Mu.Unlock()
	if before != nil {
		if err := before(table); err != nil {
			return err
		}
	}
	k.Mu.Lock()
	defer k.Mu.Unlock()
	work := maps.Clone(k.Tables[table])
	for _, ref := range refs {
		rules := work[ref.Chain]
		i := slices.IndexFunc(rules, func(r string) bool { return handleOf(r) == ref.Handle })
		if i < 0 {
			return fmt.Errorf("fake: %s/%s has no rule %x", table, ref.Chain, ref.Handle)
		}
		work[ref.Chain] = slices.Delete(slices.Clone(rules), i, i+1)
	}
	k.Tables[table] = work
	k.Blocks++
	if k.Observe != nil {
		k.Observe(table, work)
	}
	return nil
}

func handleOf(rule string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(rule))
	return h.Sum64()
}

// Dump is the kernel's tables as sorted text, for comparing two kernels.
func (k *Kernel) Dump() string {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	var b strings.Builder
	for _, t := range slices.Sorted(maps.Keys(k.Tables)) {
		for _, c := range slices.Sorted(maps.Keys(k.Tables[t])) {
			fmt.Fprintf(&b, "%s :%s\n", t, c)
			for _, r := range k.Tables[t][c] {
				b.WriteString(t + " " + r + "\n")
			}
		}
	}
	return b.String()
}

// Rules are the rules of every chain of table, chain by chain in name order.
func (k *Kernel) Rules(table string) []string {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	var out []string
	for _, c := range slices.Sorted(maps.Keys(k.Tables[table])) {
		out = append(out, k.Tables[table][c]...)
	}
	return out
}
