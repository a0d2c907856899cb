package netfilter

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// programmed is a kube-proxy-style nat ruleset with chains of every kind that
// jump to each other.
const programmed = `*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVCS-16-AAAA - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-EXT-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-XLB-AAAAAAAAAAAAAAAA - [0:0]
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -j KUBE-SVCS-16-AAAA
-A KUBE-SVCS-16-AAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-EXT-AAAAAAAAAAAAAAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-XLB-AAAAAAAAAAAAAAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SEP-BBBBBBBBBBBBBBBB -j KUBE-MARK-MASQ
COMMIT
`

// foreign are other agents' chains and rules, which cleanup must leave.
const foreign = `*nat
:CNI-HOSTPORT-DNAT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
-A CNI-HOSTPORT-DNAT -p tcp --dport 8080 -j RETURN
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
COMMIT
*filter
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP
-A INPUT -j KUBE-FIREWALL
COMMIT
`

func TestCleanupRemovesKubeProxyChainsAndLeavesOthers(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		tool := Tool{Family: f}
		ns.Run(t, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for _, p := range []string{foreign, programmed} {
				if err := tool.Restore(ctx, []byte(p)); err != nil {
					t.Fatalf("%v: program: %v", f, err)
				}
			}
			if err := tool.EnsureJumps(ctx, Jumps(false)); err != nil {
				t.Fatalf("%v: jumps: %v", f, err)
			}
			if err := tool.EnsureCanaries(ctx, []string{TableNAT, TableFilter, TableMangle}); err != nil {
				t.Fatalf("%v: canaries: %v", f, err)
			}

			if err := tool.Cleanup(ctx); err != nil {
				t.Fatalf("%v: cleanup: %v", f, err)
			}

			for _, table := range []string{TableNAT, TableFilter, TableMangle} {
				chains, err := tool.ChainNames(ctx, table)
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range chains {
					if slices.Contains(fixedChains[table], c) || KindOf(c) != KindOther {
						if c != ChainLocalnetFirewall {
							t.Errorf("%v: %s/%s is left", f, table, c)
						}
					}
				}
				for _, builtin := range []string{"INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING"} {
					rules, _ := tool.ListChain(ctx, table, builtin)
					for _, r := range rules {
						if strings.Contains(r, "-j KUBE-") && !strings.HasSuffix(r, "-j KUBE-FIREWALL") {
							t.Errorf("%v: jump left: %s", f, r)
						}
					}
				}
			}
			// The foreign chains, their rules and the jump into them are intact.
			mustHave(t, tool, TableNAT, "CNI-HOSTPORT-DNAT", "-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8080 -j RETURN")
			mustHave(t, tool, TableNAT, "PREROUTING", "-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT")
			mustHave(t, tool, TableFilter, "KUBE-FIREWALL", "-A KUBE-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP")
			mustHave(t, tool, TableFilter, "INPUT", "-A INPUT -j KUBE-FIREWALL")
			for _, table := range []string{TableNAT, TableFilter} {
				if _, err := tool.ListChain(ctx, table, "KUBE-KUBELET-CANARY"); err != nil {
					t.Errorf("%v: %s/KUBE-KUBELET-CANARY: %v", f, table, err)
				}
			}
			// A second run finds nothing to do and succeeds.
			if err := tool.Cleanup(ctx); err != nil {
				t.Errorf("%v: second cleanup: %v", f, err)
			}
			return nil
		})
	}
}

func mustHave(t *testing.T, tool Tool, table, chain, rule string) {
	t.Helper()
	rules, err := tool.ListChain(context.Background(), table, chain)
	if err != nil || !slices.Contains(rules, rule) {
		t.Errorf("%v: %s/%s lost %q: has %q (%v)", tool.Family, table, chain, rule, rules, err)
	}
}

func TestDeleteNFTablesKubeProxyLeavesOtherTables(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t)
	ns.Run(t, func() error {
		ctx := context.Background()
		for _, script := range []string{"add table ip kube-proxy", "add chain ip kube-proxy services", "add table ip6 kube-proxy", "add table inet kube-proxy", "add table ip other"} {
			if _, err := runNFT(ctx, strings.Fields(script)...); err != nil {
				netnstest.Unavailable(t, err.Error())
			}
		}
		if err := DeleteNFTablesKubeProxy(ctx); err != nil {
			t.Fatal(err)
		}
		out, err := runNFT(ctx, "list", "tables")
		if err != nil {
			t.Fatal(err)
		}
		got := strings.Fields(string(out))
		want := strings.Fields("table inet kube-proxy table ip other")
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("tables after delete: %q, want %q", out, want)
		}
		return DeleteNFTablesKubeProxy(ctx) // nothing left to do: no error
	})
}
