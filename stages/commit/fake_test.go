package commit

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

// fakeKernel is an in-memory netfilter that takes iptables-restore payloads the
// way the kernel does: each "*table ... COMMIT" block is one transaction, a rule
// may only jump to a chain that exists, and a chain that another chain jumps to
// cannot be deleted. Tests make it fail or stall on demand and watch every state
// it goes through.
type fakeKernel struct {
	mu     sync.Mutex
	tables map[string]map[string][]string // table → chain → "-A ..." lines
	// restores counts Restore calls; blocks counts committed transactions.
	restores, blocks int
	payloads         []string
	events           []string // "restore", "jumps", "sysctl ..."
	// beforeRestore, if set, runs before a payload is applied; an error fails
	// that Restore with nothing applied.
	beforeRestore func(n int, payload string) error
	// stallAfter, if set and true for a call, makes Restore wait for its context
	// to end after the payload was applied: a commit killed after the kernel took
	// the write but before it heard so.
	stallAfter func(n int) bool
	// observe, if set, is called with each committed state of a table.
	observe func(table string, chains map[string][]string)
}

func newFakeKernel() *fakeKernel {
	return &fakeKernel{tables: map[string]map[string][]string{nf.TableNAT: {}, nf.TableFilter: {}}}
}

var builtinTargets = map[string]bool{"ACCEPT": true, "DROP": true, "REJECT": true, "RETURN": true, "DNAT": true,
	"SNAT": true, "MASQUERADE": true, "MARK": true}

func (k *fakeKernel) Restore(ctx context.Context, payload []byte) error {
	k.mu.Lock()
	k.restores++
	n := k.restores
	k.payloads = append(k.payloads, string(payload))
	k.events = append(k.events, "restore")
	before, stall := k.beforeRestore, k.stallAfter
	k.mu.Unlock()
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

func (k *fakeKernel) apply(payload string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var table string
	var work map[string][]string
	for _, line := range strings.Split(payload, "\n") {
		switch {
		case line == "":
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			work = map[string][]string{}
			for c, r := range k.tables[table] {
				work[c] = slices.Clone(r)
			}
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			work[name] = nil
		case strings.HasPrefix(line, "-A "):
			f := strings.Fields(line)
			if _, ok := work[f[1]]; !ok {
				return fmt.Errorf("fake: -A into missing chain %s", f[1])
			}
			for i := range f {
				if (f[i] == "-j" || f[i] == "-g") && i+1 < len(f) && !builtinTargets[f[i+1]] {
					if _, ok := work[f[i+1]]; !ok {
						return fmt.Errorf("fake: %s jumps to missing chain %s", f[1], f[i+1])
					}
				}
			}
			work[f[1]] = append(work[f[1]], line)
		case strings.HasPrefix(line, "-X "):
			name := strings.TrimSpace(line[3:])
			if _, ok := work[name]; !ok {
				return fmt.Errorf("fake: -X of missing chain %s", name)
			}
			delete(work, name)
		case line == "COMMIT":
			// The kernel refuses to delete a chain that a rule still jumps to.
			for c, rules := range work {
				for _, r := range rules {
					if t := target(r); t != "" && !builtinTargets[t] {
						if _, ok := work[t]; !ok {
							return fmt.Errorf("fake: %s/%s: %s still jumps to deleted chain %s", table, c, r, t)
						}
					}
				}
			}
			k.tables[table] = work
			k.blocks++
			if k.observe != nil {
				k.observe(table, work)
			}
		default:
			return fmt.Errorf("fake: cannot parse %q", line)
		}
	}
	return nil
}

func (k *fakeKernel) Save(_ context.Context, table string) (map[string][]string, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := map[string][]string{}
	for c, r := range k.tables[table] {
		out[c] = slices.Clone(r)
	}
	return out, nil
}

func (k *fakeKernel) Digests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	all, _ := k.Save(ctx, table)
	out := map[string]uint64{}
	for c, rules := range all {
		if names == nil || slices.Contains(names, c) {
			h := fnv.New64a()
			h.Write([]byte(strings.Join(rules, "\n")))
			out[c] = h.Sum64()
		}
	}
	return out, nil
}

func (k *fakeKernel) ChainNames(ctx context.Context, table string) ([]string, error) {
	all, _ := k.Save(ctx, table)
	return slices.Sorted(maps.Keys(all)), nil
}

func (k *fakeKernel) EnsureJumps(context.Context, []nf.Jump) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.events = append(k.events, "jumps")
	return nil
}

func (k *fakeKernel) WriteSysctl(name, value string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.events = append(k.events, "sysctl "+name+"="+value)
	return nil
}

// dump is the kernel's tables as sorted text, for comparing two kernels.
func (k *fakeKernel) dump() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var b strings.Builder
	for _, t := range slices.Sorted(maps.Keys(k.tables)) {
		for _, c := range slices.Sorted(maps.Keys(k.tables[t])) {
			fmt.Fprintf(&b, "%s :%s\n", t, c)
			for _, r := range k.tables[t][c] {
				b.WriteString(t + " " + r + "\n")
			}
		}
	}
	return b.String()
}

// target is the chain or target a rule jumps to.
func target(rule string) string {
	f := strings.Fields(rule)
	for i := len(f) - 2; i >= 0; i-- {
		if f[i] == "-j" || f[i] == "-g" {
			return f[i+1]
		}
	}
	return ""
}
