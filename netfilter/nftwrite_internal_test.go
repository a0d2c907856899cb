package netfilter

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

const writerPayload = "*nat\n:KUBE-KPX-W - [0:0]\n-A KUBE-KPX-W -m comment --comment \"x\" -d 10.96.0.1/32 -j RETURN\nCOMMIT\n"

// TestWriterOnLegacyIsRestore: on the legacy backend the netlink writer is
// iptables-restore: the rules are in iptables-legacy's tables, and nf_tables
// holds no table of the family.
func TestWriterOnLegacyIsRestore(t *testing.T) {
	tool := legacy(t, bus.IPv4)
	netnstest.New(t).Run(t, func() error {
		ctx := context.Background()
		if tool.Writer != WriterNetlink {
			return fmt.Errorf("the zero Tool's writer is %v, want netlink", tool.Writer)
		}
		if err := tool.Restore(ctx, []byte(writerPayload)); err != nil {
			return err
		}
		rules, err := tool.ListChain(ctx, TableNAT, "KUBE-KPX-W")
		if err != nil || len(rules) != 1 {
			return fmt.Errorf("iptables-legacy lists %q, %v; want the rule", rules, err)
		}
		if names, err := (Tool{Family: bus.IPv4}).netlinkChainNames(ctx, TableNAT); err == nil && len(names) > 0 {
			return fmt.Errorf("nf_tables has chains %v; the legacy backend's rules went to nf_tables", names)
		}
		return nil
	})
}

// TestWriterFallsBackToRestore: what the netlink writer does not translate,
// or what the kernel refuses from it (here: the table does not exist yet),
// iptables-restore writes.
func TestWriterFallsBackToRestore(t *testing.T) {
	onNFTablesNamespace(t, func(ctx context.Context, tool Tool) error {
		if err := tool.RestoreNetlink(ctx, []byte(writerPayload)); err == nil {
			return errors.New("the netlink writer wrote into a table that does not exist")
		}
		before := NetlinkFallbacks.Load()
		if err := tool.Restore(ctx, []byte(writerPayload)); err != nil {
			return err
		}
		if NetlinkFallbacks.Load() != before+1 {
			return errors.New("the refused netlink write was not counted")
		}
		// Untranslatable (-I): iptables-restore, and no fallback counted.
		insert := strings.Replace(writerPayload, "-A KUBE-KPX-W", "-I KUBE-KPX-W 1", 1)
		if err := tool.RestoreNetlink(ctx, []byte(insert)); !errors.Is(err, ErrUntranslatable) {
			return fmt.Errorf("RestoreNetlink of -I = %v, want ErrUntranslatable", err)
		}
		if err := tool.Restore(ctx, []byte(insert)); err != nil {
			return err
		}
		if NetlinkFallbacks.Load() != before+1 {
			return errors.New("an untranslatable payload was counted as a refusal")
		}
		rules, err := tool.ListChain(ctx, TableNAT, "KUBE-KPX-W")
		if err != nil || len(rules) != 1 {
			return fmt.Errorf("lists %q, %v; want the one rule", rules, err)
		}
		// Now the table exists: the netlink writer writes.
		if err := tool.RestoreNetlink(ctx, []byte(writerPayload)); err != nil {
			return err
		}
		return nil
	})
}

// TestRefusedBatchTooManyAnswers: a batch whose every rule the kernel refuses
// (no nat table yet) sends more refusals than the socket holds; that is still
// the kernel's refusal of the batch, not a failure to read it.
func TestRefusedBatchTooManyAnswers(t *testing.T) {
	netnstest.RequireRoot(t)
	if !OnNFTables(bus.IPv4) {
		netnstest.Unavailable(t, "iptables is not the nf_tables backend")
	}
	var b strings.Builder
	b.WriteString("*nat\n:KUBE-KPX-W - [0:0]\n")
	for i := range 20000 {
		fmt.Fprintf(&b, "-A KUBE-KPX-W -m comment --comment \"rule %d\" -j RETURN\n", i)
	}
	b.WriteString("COMMIT\n")
	netnstest.New(t).Run(t, func() error {
		err := Tool{Family: bus.IPv4}.RestoreNetlink(context.Background(), []byte(b.String()))
		var refused *nftBatchError
		if !errors.As(err, &refused) {
			return fmt.Errorf("RestoreNetlink into a namespace without tables = %v; want the batch refused", err)
		}
		// A few refusals are read: the first names what was refused, from the
		// payload (which translation does not copy).
		small := "*nat\n:KUBE-KPX-W - [0:0]\n-A KUBE-KPX-W -j RETURN\nCOMMIT\n"
		err = Tool{Family: bus.IPv4}.RestoreNetlink(context.Background(), []byte(small))
		if !errors.As(err, &refused) || refused.what != "create chain KUBE-KPX-W" {
			return fmt.Errorf("RestoreNetlink of one chain into a namespace without tables = %v; want its creation refused", err)
		}
		return nil
	})
}

// TestWriterDoesNotFallBackOnAChainInUse: deleting a chain another agent's
// rule jumps to is refused with EBUSY, which iptables-restore would be refused
// the same way: the netlink writer says so at once (commit then empties and
// leaves the chain) instead of running iptables-restore, which reads the whole
// table first (0.3 s at 10k services), for the same answer.
func TestWriterDoesNotFallBackOnAChainInUse(t *testing.T) {
	onNFTablesNamespace(t, func(ctx context.Context, tool Tool) error {
		if err := tool.Restore(ctx, []byte(writerPayload)); err != nil {
			return err
		}
		if err := tool.Restore(ctx, []byte("*nat\n:AGENT - [0:0]\n-A AGENT -j KUBE-KPX-W\nCOMMIT\n")); err != nil {
			return err
		}
		before := NetlinkFallbacks.Load()
		err := tool.Restore(ctx, []byte("*nat\n:KUBE-KPX-W - [0:0]\n-X KUBE-KPX-W\nCOMMIT\n"))
		if !errors.Is(err, syscall.EBUSY) {
			return fmt.Errorf("deleting a chain in use: %v; want EBUSY", err)
		}
		if n := NetlinkFallbacks.Load(); n != before {
			return fmt.Errorf("the refused delete went to iptables-restore (%d fallbacks)", n-before)
		}
		if rules, err := tool.ListChain(ctx, TableNAT, "KUBE-KPX-W"); err != nil || len(rules) != 1 {
			return fmt.Errorf("the chain in use lists %q, %v; want it untouched", rules, err)
		}
		return nil
	})
}

// TestWriterDoesNotFallBackOnAJumpLoop: a batch the kernel's validation walk
// refuses (a jump loop, or jumps deeper than 16: EMLINK/ELOOP) iptables-restore
// would make the same way and be refused the same way, after the kernel's
// replay walked the table once a rule again (9.9 s for 111 rules at 1,000
// services, 15.3 s with the fallback): the netlink writer says so at once.
func TestWriterDoesNotFallBackOnAJumpLoop(t *testing.T) {
	onNFTablesNamespace(t, func(ctx context.Context, tool Tool) error {
		reachable := "*nat\n:KUBE-KPX-A - [0:0]\n:KUBE-KPX-B - [0:0]\n-A PREROUTING -j KUBE-KPX-A\n-A KUBE-KPX-A -j KUBE-KPX-B\nCOMMIT\n"
		if err := tool.Restore(ctx, []byte(reachable)); err != nil {
			return err
		}
		before := NetlinkFallbacks.Load()
		err := tool.Restore(ctx, []byte("*nat\n-A KUBE-KPX-B -j KUBE-KPX-A\nCOMMIT\n"))
		if !errors.Is(err, syscall.EMLINK) && !errors.Is(err, syscall.ELOOP) {
			return fmt.Errorf("writing a jump loop: %v; want EMLINK or ELOOP", err)
		}
		if n := NetlinkFallbacks.Load(); n != before {
			return fmt.Errorf("the refused loop went to iptables-restore (%d fallbacks)", n-before)
		}
		if rules, err := tool.ListChain(ctx, TableNAT, "KUBE-KPX-B"); err != nil || len(rules) != 0 {
			return fmt.Errorf("the loop's chain lists %q, %v; want it as it was, empty", rules, err)
		}
		return nil
	})
}

// onNFTablesNamespace runs f in a new network namespace with an IPv4 Tool of
// the nf_tables backend (skipped without root or that backend).
func onNFTablesNamespace(t *testing.T, f func(context.Context, Tool) error) {
	netnstest.RequireRoot(t)
	if !OnNFTables(bus.IPv4) {
		netnstest.Unavailable(t, "iptables is not the nf_tables backend")
	}
	netnstest.New(t).Run(t, func() error { return f(context.Background(), Tool{Family: bus.IPv4}) })
}
