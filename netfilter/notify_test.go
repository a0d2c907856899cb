package netfilter

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/mdlayher/netlink"

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

// A subscription reports the changes made to its family's tables (a rule added,
// rules flushed, a chain deleted, the table deleted), kpipe's own included
// (commit tells them apart by what it wrote), and none of the other family's.
func TestSubscriptionReportsTheFamilysChanges(t *testing.T) {
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
			nft := NFTFamily(family)
			steps := []struct {
				name string
				do   func() error
				want []Change
				some bool // want is among what is reported (kpipe's tools create the table and its built-in chains too)
			}{
				{"kpipe writes", func() error {
					if err := tool.Restore(context.Background(), []byte("*nat\n:KUBE-SVC-X - [0:0]\n:KUBE-SEP-1 - [0:0]\n-A KUBE-SVC-X -j KUBE-SEP-1\nCOMMIT\n")); err != nil {
						return err
					}
					return tool.EnsureJumps(context.Background(), Jumps(false))
				}, []Change{{ChainAdded, "nat", "KUBE-SEP-1"}, {RuleAdded, "nat", "KUBE-SVC-X"}, {RuleAdded, "nat", "PREROUTING"}}, true},
				{"the other family's tables change", func() error { return other.run1("-t", "nat", "-N", "OTHER") }, nil, false},
				{"another agent appends a rule", func() error { return tool.run1("-t", "nat", "-A", "KUBE-SVC-X", "-j", "RETURN") },
					[]Change{{RuleAdded, "nat", "KUBE-SVC-X"}}, false},
				{"another agent flushes a chain and deletes it", func() error {
					if err := tool.run1("-t", "nat", "-F", "KUBE-SEP-1"); err != nil {
						return err
					}
					if err := tool.run1("-t", "nat", "-F", "KUBE-SVC-X"); err != nil {
						return err
					}
					return tool.run1("-t", "nat", "-X", "KUBE-SEP-1")
				}, []Change{{RuleDeleted, "nat", "KUBE-SVC-X"}, {RuleDeleted, "nat", "KUBE-SVC-X"}, {ChainDeleted, "nat", "KUBE-SEP-1"}}, false},
				{"another agent deletes the table", func() error {
					out, err := exec.Command("nft", "delete", "table", nft, "nat").CombinedOutput()
					if err != nil {
						return fmt.Errorf("nft delete table: %v: %s", err, out)
					}
					return nil
				}, nil, false},
			}
			for _, st := range steps {
				ns.Run(t, st.do)
				got, err := nextChanges(sub)
				if err != nil {
					t.Fatalf("%s: %v", st.name, err)
				}
				if st.some {
					for _, c := range st.want {
						if !slices.Contains(got, c) {
							t.Errorf("%s: reported %v; want %v among them", st.name, got, c)
						}
					}
					continue
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

// Another writer whose netlink port id is one kpipe's own tool had (a pid of
// another container in the host network namespace, numbered in its own pid
// namespace) is still another writer: its change to a chain of kpipe's is
// reported. (The kernel stamps each notification with the writer's port id; a
// process's first socket gets its pid, and any socket may bind a free port.)
func TestSubscriptionReportsAWriterOnAPortKpipeUsed(t *testing.T) {
	tool := Tool{Family: bus.IPv4}
	ns := netnstest.New(t)
	var sub *Subscription
	var spy *netlink.Conn
	ns.Run(t, func() (err error) {
		if sub, err = tool.Subscribe(context.Background()); err != nil {
			return err
		}
		if spy, err = netlink.Dial(syscall.NETLINK_NETFILTER, nil); err != nil {
			return err
		}
		return spy.JoinGroup(nfnlGroupNFTables)
	})
	defer sub.Close()
	defer spy.Close()
	ns.Run(t, func() error {
		return tool.Restore(context.Background(), []byte("*nat\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j RETURN\nCOMMIT\n"))
	})
	kpipes := writerPort(t, spy, "KUBE-SVC-X")
	if _, err := nextChanges(sub); err != nil {
		t.Fatal(err)
	}
	ns.Run(t, func() error { return writeAsPort(kpipes, "*nat\n-A KUBE-SVC-X -j ACCEPT\nCOMMIT\n") })
	got, err := nextChanges(sub)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Change{RuleAdded, "nat", "KUBE-SVC-X"}); !slices.Contains(got, want) {
		t.Errorf("another writer on port %d (kpipe's tool had it) appended a rule to KUBE-SVC-X; reported %v, want %v among them", kpipes, got, want)
	}
}

// writerPort is the port id the kernel stamped on the first notification spy
// reads of a rule added to chain.
func writerPort(t *testing.T, spy *netlink.Conn, chain string) uint32 {
	t.Helper()
	spy.SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		msgs, err := spy.Receive()
		if err != nil {
			t.Fatalf("no notification of a rule added to %s: %v", chain, err)
		}
		for _, m := range msgs {
			s := Subscription{family: nfproto(bus.IPv4)}
			raw := syscall.NetlinkMessage{Header: syscall.NlMsghdr{Type: uint16(m.Header.Type)}, Data: m.Data}
			if c, ok := s.decode(raw); ok && c.Kind == RuleAdded && c.Chain == chain {
				return m.Header.PID
			}
		}
	}
}

// writeAsPort writes payload over the netlink writer's encoding from a socket
// bound to port (retried while kpipe's closing socket still holds it).
func writeAsPort(port uint32, payload string) error {
	sections, err := translatePayload(bus.IPv4, []byte(payload))
	if err != nil {
		return err
	}
	var conn *netlink.Conn
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		conn, err = netlink.Dial(syscall.NETLINK_NETFILTER, &netlink.Config{PID: port})
		if err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("bind port %d: %w", port, err)
	}
	defer conn.Close()
	raw, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	w := &nftReader{conn: conn, raw: raw, buf: make([]byte, recvSize), family: nfproto(bus.IPv4), seq: 1 << 30}
	for _, s := range sections {
		if err := w.batch(&s); err != nil {
			return err
		}
	}
	return nil
}
