package netfilter

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync/atomic"
	"syscall"
)

// Writer is how Restore writes a payload.
type Writer uint8

const (
	// WriterNetlink writes straight to nf_tables over netlink when the host's
	// iptables is the nf_tables backend, with the encodings iptables-nft uses;
	// anything it does not translate, or that the kernel refuses from it (but
	// a chain still in use), goes to iptables-restore instead. On the legacy backend it is iptables-restore.
	WriterNetlink Writer = iota
	// WriterRestore always runs iptables-restore.
	WriterRestore
)

// NetlinkFallbacks counts the payloads the netlink writer translated but the
// kernel refused, which iptables-restore then wrote (or refused too).
var NetlinkFallbacks atomic.Uint64

// Restore applies payload without flushing the tables: only the chains the
// payload declares are replaced, and each table section is one transaction.
func (t Tool) Restore(ctx context.Context, payload []byte) error {
	return t.Prepare(payload)(ctx)
}

// Prepare does the part of Restore that does not touch the kernel (the netlink
// writer's translation) and returns the rest: a caller can prepare the next
// payload while the kernel takes this one.
func (t Tool) Prepare(payload []byte) (write func(ctx context.Context) error) {
	if t.Writer != WriterNetlink {
		return func(ctx context.Context) error { return t.restoreTool(ctx, payload) }
	}
	sections, translateErr := translatePayload(t.Family, payload)
	return func(ctx context.Context) error {
		if nft, err := t.onNFTables(ctx); err == nil && nft && translateErr == nil {
			err := t.writeBatches(ctx, sections)
			if err == nil || ctx.Err() != nil || refusedAlike(err) {
				return err
			}
			NetlinkFallbacks.Add(1)
		}
		// The legacy backend, or what the netlink writer does not translate
		// (not counted: it never tried), or what the kernel refused from it.
		return t.restoreTool(ctx, payload)
	}
}

// refusedAlike says whether iptables-restore would make the same request and
// be refused the same way: a chain still in use (EBUSY), or a jump loop or a
// jump stack deeper than 16 found by the kernel's validation walk (EMLINK,
// ELOOP), which the kernel answers only after walking the table once a rule
// of the batch again (seconds at 1,000 services), so a fallback paid it twice.
// Not EINVAL: it also means an older kernel without a match revision, which
// iptables-restore may encode another way.
func refusedAlike(err error) bool {
	return errors.Is(err, syscall.EBUSY) || errors.Is(err, syscall.EMLINK) || errors.Is(err, syscall.ELOOP)
}

// RestoreNetlink writes payload over nf_tables netlink only, as Restore's
// netlink writer does, without falling back: ErrUntranslatable when the payload
// has anything it does not encode as iptables-nft would (the payload must then
// go to iptables-restore), else the kernel's answer. The tables must exist.
func (t Tool) RestoreNetlink(ctx context.Context, payload []byte) error {
	sections, err := translatePayload(t.Family, payload)
	if err != nil {
		return err
	}
	return t.writeBatches(ctx, sections)
}

// restoreTool feeds payload to iptables-restore --noflush.
func (t Tool) restoreTool(ctx context.Context, payload []byte) error {
	_, err := t.runTool(ctx, t.binary("-restore"), payload, "-w", lockWait, "--noflush", "--counters")
	return err
}

// RestoreFlushing runs iptables-restore without --noflush: every table in
// payload loses what it does not declare (tests use it to empty tables).
func (t Tool) RestoreFlushing(ctx context.Context, payload []byte) error {
	_, err := t.runTool(ctx, t.binary("-restore"), payload, "-w", lockWait)
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
