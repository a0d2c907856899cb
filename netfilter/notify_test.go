package netfilter

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// nextChanges collects what sub reports until nothing comes for a moment.
func nextChanges(sub *Subscription) ([]Change, error) {
	var all []Change
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		cs, err := sub.Next(ctx)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			return all, nil
		}
		if err != nil {
			return all, err
		}
		all = append(all, cs...)
	}
}

// A subscription reports the changes other processes make to its family's
// tables (a rule added, rules flushed, a chain deleted, the table deleted) and
// none of those kpipe's own tools make.
func TestSubscriptionReportsOnlyOthersChanges(t *testing.T) {
	for _, family := range []bus.Family{bus.IPv4, bus.IPv6} {
		t.Run(family.String(), func(t *testing.T) {
			tool, other := Tool{Family: family}, Tool{Family: bus.IPv6}
			if family == bus.IPv6 {
				other.Family = bus.IPv4
			}
			ns := netnstest.New(t)
			var sub *Subscription
			ns.Run(t, func() (err error) {
				sub, err = tool.Subscribe(context.Background())
				return err
			})
			defer sub.Close()
			nft := map[bus.Family]string{bus.IPv4: "ip", bus.IPv6: "ip6"}[family]
			steps := []struct {
				name string
				do   func() error
				want []Change
			}{
				{"kpipe writes", func() error {
					if err := tool.Restore(context.Background(), []byte("*nat\n:KUBE-SVC-X - [0:0]\n:KUBE-SEP-1 - [0:0]\n-A KUBE-SVC-X -j KUBE-SEP-1\nCOMMIT\n")); err != nil {
						return err
					}
					return tool.EnsureJumps(context.Background(), Jumps(false))
				}, nil},
				{"the other family's tables change", func() error { return other.run1("-t", "nat", "-N", "OTHER") }, nil},
				{"another agent appends a rule", func() error { return tool.run1("-t", "nat", "-A", "KUBE-SVC-X", "-j", "RETURN") },
					[]Change{{RuleAdded, "nat", "KUBE-SVC-X"}}},
				{"another agent flushes a chain and deletes it", func() error {
					if err := tool.run1("-t", "nat", "-F", "KUBE-SEP-1"); err != nil {
						return err
					}
					if err := tool.run1("-t", "nat", "-F", "KUBE-SVC-X"); err != nil {
						return err
					}
					return tool.run1("-t", "nat", "-X", "KUBE-SEP-1")
				}, []Change{{RuleDeleted, "nat", "KUBE-SVC-X"}, {RuleDeleted, "nat", "KUBE-SVC-X"}, {ChainDeleted, "nat", "KUBE-SEP-1"}}},
				{"another agent deletes the table", func() error {
					out, err := exec.Command("nft", "delete", "table", nft, "nat").CombinedOutput()
					if err != nil {
						return fmt.Errorf("nft delete table: %v: %s", err, out)
					}
					return nil
				}, nil},
			}
			for _, st := range steps {
				ns.Run(t, st.do)
				got, err := nextChanges(sub)
				if err != nil {
					t.Fatalf("%s: %v", st.name, err)
				}
				if st.name == "another agent deletes the table" {
					if !slices.Contains(got, Change{Kind: TableDeleted, Table: "nat"}) || !slices.Contains(got, Change{ChainDeleted, "nat", "PREROUTING"}) {
						t.Errorf("%s: reported %v; want the table and its chains deleted", st.name, got)
					}
					continue
				}
				if !slices.Equal(got, st.want) {
					t.Errorf("%s: reported %v; want %v", st.name, got, st.want)
				}
			}
		})
	}
}

// A tool's pid is kpipe's while it runs and for a grace period after; then a
// process given the same pid is someone else.
func TestToolPidsExpire(t *testing.T) {
	p := toolPids{pids: map[uint32]time.Time{}}
	p.started(4242)
	if !p.ran(4242) || p.ran(4243) {
		t.Fatal("a running tool's pid is not kpipe's")
	}
	p.exited(4242)
	if !p.ran(4242) {
		t.Error("a tool's pid is not kpipe's right after it exited")
	}
	p.pids[4242] = time.Now().Add(-toolGrace - time.Second)
	if p.ran(4242) {
		t.Errorf("a pid is kpipe's %v after its tool exited: a reused pid would hide another writer's change", toolGrace+time.Second)
	}
}
