package netfilter

import (
	"context"
	"hash/fnv"
)

// Digests returns, for each chain of table (all chains when names is nil; only
// those that exist when names is given), a digest of its rules: equal digests
// mean the same rules in the same order.
func (t Tool) Digests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	all, err := t.Save(ctx, table)
	if err != nil {
		return nil, err
	}
	out := map[string]uint64{}
	for name, rules := range all {
		out[name] = digestLines(rules)
	}
	if names == nil {
		return out, nil
	}
	some := make(map[string]uint64, len(names))
	for _, n := range names {
		if d, ok := out[n]; ok {
			some[n] = d
		}
	}
	return some, nil
}

func digestLines(rules []string) uint64 {
	h := fnv.New64a()
	for _, r := range rules {
		h.Write([]byte(r))
		h.Write([]byte{'\n'})
	}
	return h.Sum64()
}
