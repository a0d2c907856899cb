// Package writertest proves, in tests, that the netlink writer writes what
// iptables-restore writes: the same payload goes into two fresh network
// namespaces, one each way, and both must then hold the same rules.
package writertest

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// Bed is a pair of fresh network namespaces with the nat and filter tables
// and kube-proxy's nfacct objects: one written with iptables-restore, one with
// the netlink writer.
type Bed struct {
	Family           bus.Family
	Restore, Netlink *netnstest.Namespace
}

// New makes a Bed (Unavailable without root or the nf_tables backend).
func New(tb testing.TB, family bus.Family) *Bed {
	tb.Helper()
	netnstest.RequireRoot(tb)
	if !nf.OnNFTables(family) {
		netnstest.Unavailable(tb, "iptables is not the nf_tables backend (go tool task setup)")
	}
	b := &Bed{Family: family, Restore: netnstest.New(tb), Netlink: netnstest.New(tb)}
	for _, ns := range []*netnstest.Namespace{b.Restore, b.Netlink} {
		ns.Run(tb, func() error {
			for _, name := range nf.NFAcctNames {
				if err := (nf.NFAcct{}).Ensure(name); err != nil {
					return err
				}
			}
			return nil
		})
	}
	b.Reset(tb)
	return b
}

// Reset empties both namespaces: the nat and filter tables exist, with no
// chain of their own. (The netlink writer needs the tables, which a node has;
// iptables makes them the same way in both.)
func (b *Bed) Reset(tb testing.TB) {
	tb.Helper()
	for _, ns := range []*netnstest.Namespace{b.Restore, b.Netlink} {
		ns.Run(tb, func() error {
			ctx := context.Background()
			// Without --noflush, iptables-nft deletes the tables it is given.
			if err := restoreTool(b.Family).RestoreFlushing(ctx, []byte("*nat\nCOMMIT\n*filter\nCOMMIT\n")); err != nil {
				return err
			}
			return MakeTables(b.Family)
		})
	}
}

// MakeTables makes the nat and filter tables, as iptables does, in the network
// namespace it runs in (a node has them; the netlink writer needs them).
func MakeTables(family bus.Family) error {
	return restoreTool(family).Restore(context.Background(),
		[]byte("*nat\n:KUBE-KPX-PRIME - [0:0]\n-X KUBE-KPX-PRIME\nCOMMIT\n*filter\n:KUBE-KPX-PRIME - [0:0]\n-X KUBE-KPX-PRIME\nCOMMIT\n"))
}

func restoreTool(family bus.Family) nf.Tool { return nf.Tool{Family: family, Writer: nf.WriterRestore} }

// Write writes the payloads, in turn, into both namespaces, each its own way;
// the netlink side must not fall back to iptables-restore.
func (b *Bed) Write(tb testing.TB, payloads ...[]byte) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for _, p := range payloads {
		b.Restore.Run(tb, func() error { return restoreTool(b.Family).Restore(ctx, p) })
		b.Netlink.Run(tb, func() error { return nf.Tool{Family: b.Family}.RestoreNetlink(ctx, p) })
	}
}

// RestoreOverNetlink has iptables-restore write payload over what the netlink
// writer wrote (another agent's iptables-restore next to kpipe's rules).
func (b *Bed) RestoreOverNetlink(tb testing.TB, payload []byte) {
	tb.Helper()
	b.Netlink.Run(tb, func() error { return restoreTool(b.Family).Restore(context.Background(), payload) })
}

var counters = regexp.MustCompile(`\[\d+:\d+\]`)

// Save is iptables-save of table in ns, counters zeroed, without its dated
// comment lines.
func (b *Bed) Save(tb testing.TB, ns *netnstest.Namespace, table string) string {
	tb.Helper()
	var out []byte
	ns.Run(tb, func() error {
		var err error
		out, err = nf.Tool{Family: b.Family}.SaveText(context.Background(), table)
		return err
	})
	var keep []string
	for _, l := range strings.Split(string(out), "\n") {
		if !strings.HasPrefix(l, "#") {
			keep = append(keep, counters.ReplaceAllString(l, "[0:0]"))
		}
	}
	return strings.Join(keep, "\n")
}

// RequireSameSaved fails unless iptables-save prints the same text, byte for
// byte, for both namespaces' nat and filter tables.
func (b *Bed) RequireSameSaved(tb testing.TB, what string) {
	tb.Helper()
	for _, table := range []string{nf.TableNAT, nf.TableFilter} {
		r, n := b.Save(tb, b.Restore, table), b.Save(tb, b.Netlink, table)
		if r != n {
			tb.Fatalf("%s: iptables-save -t %s differs (- iptables-restore, + netlink):\n%s", what, table, lineDiff(r, n))
		}
	}
}

// RequireSame is RequireSameSaved, and the kernel holds the same expressions
// in every chain (what iptables-save does not print: the x_tables info
// structures' every byte). Reading a whole table costs the square of its size:
// seconds from 100,000 rules on.
func (b *Bed) RequireSame(tb testing.TB, what string) {
	tb.Helper()
	b.RequireSameSaved(tb, what)
	for _, table := range []string{nf.TableNAT, nf.TableFilter} {
		dr, dn := b.digests(tb, b.Restore, table), b.digests(tb, b.Netlink, table)
		bad := 0
		for chain, h := range dr {
			if dn[chain] != h && bad < 3 {
				bad++
				tb.Errorf("%s: %s %s: the kernel holds other expressions than iptables-restore wrote: %s", what, table, chain,
					firstDifference(b.exprs(tb, b.Restore, table, chain), b.exprs(tb, b.Netlink, table, chain)))
			}
		}
		if len(dr) != len(dn) {
			tb.Errorf("%s: %s has %d chains written by iptables-restore, %d by netlink", what, table, len(dr), len(dn))
		}
	}
}

func (b *Bed) digests(tb testing.TB, ns *netnstest.Namespace, table string) map[string]uint64 {
	tb.Helper()
	var d map[string]uint64
	ns.Run(tb, func() error {
		var err error
		d, err = nf.Tool{Family: b.Family}.Digests(context.Background(), table, nil)
		return err
	})
	return d
}

func (b *Bed) exprs(tb testing.TB, ns *netnstest.Namespace, table, chain string) [][]string {
	tb.Helper()
	var out [][]string
	ns.Run(tb, func() error {
		var err error
		out, err = nf.Tool{Family: b.Family}.ChainExpressions(context.Background(), table, chain)
		return err
	})
	return out
}

// firstDifference describes the first expression that differs between two
// chains' rules.
func firstDifference(restored, written [][]string) string {
	for i := range min(len(restored), len(written)) {
		for j := range max(len(restored[i]), len(written[i])) {
			var r, w string
			if j < len(restored[i]) {
				r = restored[i][j]
			}
			if j < len(written[i]) {
				w = written[i][j]
			}
			if r != w {
				at := 0
				for at < min(len(r), len(w)) && r[at] == w[at] {
					at++
				}
				return fmt.Sprintf("rule %d, expression %d, from character %d:\n  iptables-restore %s\n  netlink          %s", i+1, j+1, at, r, w)
			}
		}
	}
	return fmt.Sprintf("%d rules written by iptables-restore, %d by netlink", len(restored), len(written))
}

// lineDiff lists the lines only in a (-) and only in b (+).
func lineDiff(a, b string) string {
	inA, inB := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(a, "\n") {
		inA[l] = true
	}
	for _, l := range strings.Split(b, "\n") {
		inB[l] = true
	}
	var out strings.Builder
	for _, l := range strings.Split(a, "\n") {
		if !inB[l] {
			out.WriteString("- " + l + "\n")
		}
	}
	for _, l := range strings.Split(b, "\n") {
		if !inA[l] {
			out.WriteString("+ " + l + "\n")
		}
	}
	return out.String()
}
