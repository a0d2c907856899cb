package netfilter

import (
	"context"
	"maps"
	"slices"
)

// Restore feeds payload to iptables-restore without flushing the tables: only the
// chains the payload declares are replaced, and each table is replaced atomically.
func (t Tool) Restore(ctx context.Context, payload []byte) error {
	_, err := t.runTool(ctx, t.binary("-restore"), payload, "-w", lockWait, "--noflush", "--counters")
	return err
}

// Chains lists the chains that exist in table, sorted, as iptables-save shows them.
func (t Tool) Chains(ctx context.Context, table string) ([]string, error) {
	all, err := t.Save(ctx, table)
	if err != nil {
		return nil, err
	}
	return slices.Sorted(maps.Keys(all)), nil
}
