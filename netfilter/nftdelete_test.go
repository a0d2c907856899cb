package netfilter

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// TestDeleteRulesByHandle: RuleHandles lists a chain's rules with the digest
// Digests gives it; DeleteRules takes out just the rules named, all or none
// (a handle no longer there undoes the whole batch), and leaves the chain's
// other rules and other chains as they were.
func TestDeleteRulesByHandle(t *testing.T) {
	ns := netnstest.New(t)
	tool := Tool{Family: bus.IPv4}
	ctx := context.Background()
	ns.Run(t, func() error {
		if err := tool.Restore(ctx, []byte(digestPayload(bus.IPv4))); err != nil {
			return err
		}
		listed, err := tool.RuleHandles(ctx, TableNAT, []string{"KUBE-SVC-X", "KUBE-NONE"})
		if err != nil {
			return err
		}
		if _, there := listed["KUBE-NONE"]; there || len(listed) != 1 {
			t.Fatalf("RuleHandles listed %d chains, a missing one among them: %v", len(listed), listed)
		}
		handles, digest := listed["KUBE-SVC-X"].Handles, listed["KUBE-SVC-X"].Digest
		kernel, err := tool.Digests(ctx, TableNAT, []string{"KUBE-SVC-X", "KUBE-SVCS-A"})
		if err != nil {
			return err
		}
		if len(handles) != 3 || digest != kernel["KUBE-SVC-X"] {
			t.Fatalf("RuleHandles: %d handles, digest %x; want 3 and Digests' %x", len(handles), digest, kernel["KUBE-SVC-X"])
		}
		before, _ := tool.ListChain(ctx, TableNAT, "KUBE-SVC-X")

		// One rule still there, one gone: nothing is deleted.
		gone := handles[len(handles)-1] + 1000
		err = tool.DeleteRules(ctx, TableNAT, []RuleRef{{"KUBE-SVC-X", handles[0]}, {"KUBE-SVC-X", gone}})
		if err == nil {
			t.Fatal("deleting a rule that is not there succeeded")
		}
		if now, _ := tool.ListChain(ctx, TableNAT, "KUBE-SVC-X"); !slices.Equal(now, before) {
			t.Fatalf("a refused delete changed the chain:\n%s\nwant\n%s", strings.Join(now, "\n"), strings.Join(before, "\n"))
		}

		// The two rules of KUBE-SEP-1 go; the tail stays.
		if err := tool.DeleteRules(ctx, TableNAT, []RuleRef{{"KUBE-SVC-X", handles[0]}, {"KUBE-SVC-X", handles[1]}}); err != nil {
			return err
		}
		now, _ := tool.ListChain(ctx, TableNAT, "KUBE-SVC-X")
		if !slices.Equal(now, before[2:]) {
			t.Fatalf("after the delete:\n%s\nwant\n%s", strings.Join(now, "\n"), strings.Join(before[2:], "\n"))
		}
		after, err := tool.Digests(ctx, TableNAT, []string{"KUBE-SVCS-A"})
		if err != nil {
			return err
		}
		if after["KUBE-SVCS-A"] != kernel["KUBE-SVCS-A"] {
			t.Fatal("another chain changed")
		}
		return nil
	})
}

// TestNoRuleHandlesWithTheRestoreWriter: the iptables-restore writer keeps
// today's path.
func TestNoRuleHandlesWithTheRestoreWriter(t *testing.T) {
	tool := Tool{Family: bus.IPv4, Writer: WriterRestore}
	if _, err := tool.RuleHandles(context.Background(), TableNAT, []string{"KUBE-SVC-X"}); !errors.Is(err, ErrNoRuleHandles) {
		t.Fatalf("RuleHandles: %v, want ErrNoRuleHandles", err)
	}
	if err := tool.DeleteRules(context.Background(), TableNAT, []RuleRef{{"KUBE-SVC-X", 1}}); !errors.Is(err, ErrNoRuleHandles) {
		t.Fatalf("DeleteRules: %v, want ErrNoRuleHandles", err)
	}
}
