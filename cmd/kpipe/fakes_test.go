package main

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

// fakeKernel is an in-memory netfilter (after stages/commit's test fake): it
// takes iptables-restore payloads a "*table ... COMMIT" block at a time, refusing
// a jump to a chain that does not exist.
type fakeKernel struct {
	mu     sync.Mutex
	tables map[string]map[string][]string // table → chain → "-A ..." lines
}

func newFakeKernel() *fakeKernel {
	return &fakeKernel{tables: map[string]map[string][]string{nf.TableNAT: {}, nf.TableFilter: {}}}
}

var builtinTargets = map[string]bool{"ACCEPT": true, "DROP": true, "REJECT": true, "RETURN": true, "DNAT": true,
	"SNAT": true, "MASQUERADE": true, "MARK": true}

func (k *fakeKernel) Restore(ctx context.Context, payload []byte) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var table string
	var work map[string][]string
	for _, line := range strings.Split(string(payload), "\n") {
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
			delete(work, strings.TrimSpace(line[3:]))
		case line == "COMMIT":
			k.tables[table] = work
		default:
			return fmt.Errorf("fake: cannot parse %q", line)
		}
	}
	return ctx.Err()
}

// rules are table's rules, every chain's.
func (k *fakeKernel) rules(table string) []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for _, c := range slices.Sorted(maps.Keys(k.tables[table])) {
		out = append(out, k.tables[table][c]...)
	}
	return out
}

func (k *fakeKernel) Digests(_ context.Context, table string, names []string) (map[string]uint64, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := map[string]uint64{}
	for c, rules := range k.tables[table] {
		if names == nil || slices.Contains(names, c) {
			h := fnv.New64a()
			h.Write([]byte(strings.Join(rules, "\n")))
			out[c] = h.Sum64()
		}
	}
	return out, nil
}

func (k *fakeKernel) ChainNames(_ context.Context, table string) ([]string, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Sorted(maps.Keys(k.tables[table])), nil
}

func (k *fakeKernel) EnsureJumps(context.Context, []nf.Jump) error { return nil }

func (k *fakeKernel) WriteSysctl(string, string) error { return nil }

// liveCanaries are canaries nobody ever flushes.
type liveCanaries struct{}

func (liveCanaries) EnsureCanaries(context.Context, []string) error    { return nil }
func (liveCanaries) CanaryAlive(context.Context, string) (bool, error) { return true, nil }

// noConntrack has no flows to clear.
type noConntrack struct{}

func (noConntrack) ClearStaleUDP(nf.StaleUDP) (int, error) { return 0, nil }
func (noConntrack) Close() error                           { return nil }
