package commit

import (
	"context"
	"time"

	nf "github.com/kpipe/kpipe/netfilter"
)

// earlyRead is what the kernel held of the tables kpipe writes when the stage
// started with a ledger that has seen no full sync (a new process, a reload,
// a stage restarted before its full sync succeeded): every chain, and the
// digest of each that readsEarly. The first full sync compares its
// plan with these, chain by chain, and writes only what differs; reading them
// is most of a restart's work when nothing changed (0.65 s of 0.86 s at
// 10,000 services). Read at start, it is done while watch's informers list
// the cluster and render renders it, not after. It is used only while the
// nf_tables ruleset generation, which every change of any table bumps, is the
// one it was read at.
type earlyRead struct {
	generation uint32
	tables     map[string]tableRead
}

// tableRead is one table's chains, and the digest of each that readsEarly.
type tableRead struct {
	names   []string
	digests map[string]uint64
}

// readsEarly says whether the early read reads chain: one of those a plan
// holds many of. Not an endpoint chain: kpipe has few (local endpoints,
// affinity), and kube-proxy, when kpipe takes a node over from it, one per
// endpoint (100,000 at 10,000 services of 10), all stale. Nor another agent's.
// The first full sync reads those of them it plans.
func readsEarly(chain string) bool {
	k := nf.KindOf(chain)
	return k != nf.KindOther && k != nf.KindEndpoint
}

// generations is a Kernel that tells the nf_tables ruleset generation
// (netfilter.Tool on the nf_tables backend).
type generations interface {
	Generation(ctx context.Context) (uint32, error)
}

// readEarly reads the kernel for the first full sync: nil when the kernel has
// no generation, cannot say what a chain's digest should be (the legacy
// backend compares nothing), or changed during the read.
func (s *Stage) readEarly(ctx context.Context) *earlyRead {
	g, ok := s.kernel.(generations)
	if !ok {
		return nil
	}
	if _, known := s.kernel.ExpectedDigest(ctx, nf.TableNAT, ""); !known {
		return nil
	}
	start := time.Now()
	before, err := g.Generation(ctx)
	if err != nil {
		return nil
	}
	r := &earlyRead{generation: before, tables: map[string]tableRead{}}
	for _, table := range []string{nf.TableNAT, nf.TableFilter} {
		names, err := s.kernel.ChainNames(ctx, table)
		if err != nil {
			return nil
		}
		t := tableRead{names: names, digests: map[string]uint64{}}
		var early []string
		for _, name := range names {
			if readsEarly(name) {
				early = append(early, name)
			}
		}
		if len(early) > 0 {
			if t.digests, err = s.kernel.Digests(ctx, table, early); err != nil {
				return nil // nf.ErrBusy too: the next read may stand still
			}
		}
		r.tables[table] = t
	}
	if after, err := g.Generation(ctx); err != nil || after != before {
		return nil
	}
	s.log.Debug("read the kernel before the first plan", "family", s.family, "took", time.Since(start))
	return r
}

// takeEarly returns the early read, once, if the kernel has not changed
// since; nil otherwise.
func (s *Stage) takeEarly(ctx context.Context) *earlyRead {
	r := s.early
	s.early = nil
	if r == nil {
		return nil
	}
	if now, err := s.kernel.(generations).Generation(ctx); err != nil || now != r.generation {
		s.log.Debug("the kernel changed since it was read at start; reading it again", "family", s.family)
		return nil
	}
	return r
}

// chainNames lists the chains of table: as read early, or now (r nil).
func (r *earlyRead) chainNames(ctx context.Context, k Kernel, table string) ([]string, error) {
	if t, ok := r.table(table); ok {
		return t.names, nil
	}
	return k.ChainNames(ctx, table)
}

// table is table as read early (false: not read, or r nil).
func (r *earlyRead) table(table string) (tableRead, bool) {
	if r == nil {
		return tableRead{}, false
	}
	t, ok := r.tables[table]
	return t, ok
}

// digestsOf is the kernel's digests of the chains of table named (those that
// exist): as read early (t), and those not read early read now.
func (s *Stage) digestsOf(ctx context.Context, t tableRead, table string, names []string) (map[string]uint64, error) {
	out := make(map[string]uint64, len(names))
	var late []string
	for _, name := range names {
		if !readsEarly(name) {
			late = append(late, name)
		} else if d, ok := t.digests[name]; ok {
			out[name] = d
		}
	}
	if len(late) == 0 {
		return out, nil
	}
	d, err := s.digests(ctx, table, late)
	for name, digest := range d {
		out[name] = digest
	}
	return out, err
}
