package render

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// BenchmarkKernelOneChainWrite is what the kernel charges for a one-chain
// write into the nat table of 1,000 and 10,000 services (10 endpoints, two
// ports) through kpipe's netlink writer, before and after the built-in chains
// jump into kpipe's: a rule with nothing the kernel validates (a native address
// match), a rule with a match, a service chain as commit writes it. Any
// transaction costs about 10 ms here. Once kpipe's chains are reachable from
// the built-in ones, a transaction with a rule the kernel validates (a match,
// a target, a verdict: every rule kpipe writes) also makes it walk every chain
// reachable from every built-in chain of the table (nft_table_validate),
// whichever chain changed: at 10,000 services that walk, about 250 ms, bounds
// one change, for kpipe and for iptables-restore alike.
func BenchmarkKernelOneChainWrite(b *testing.B) {
	netnstest.RequireRoot(b)
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) { benchKernelOneChainWrite(b, n) })
	}
}

func benchKernelOneChainWrite(b *testing.B, n int) {
	cfg := Config{Family: bus.IPv4, NodeName: "bench-node", MasqueradeBit: 14, DetectLocal: DetectClusterCIDR, ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}
	plan := Render(cfg, &bus.Snapshot{State: rendertest.SyntheticState(n, 10), Full: true})
	ns := netnstest.New(b)
	tool := nf.Tool{Family: bus.IPv4, Writer: nf.WriterNetlink}
	// The set-up as commit writes it; what is timed, netlink only: a payload
	// the writer does not take fails the benchmark rather than timing
	// iptables-restore.
	setUp := func(payload []byte) func() error {
		return func() error { return tool.Prepare(payload)(context.Background()) }
	}
	write := func(payload []byte) func() error {
		return func() error { return tool.RestoreNetlink(context.Background(), payload) }
	}
	for _, tp := range plan.Tables {
		for chains := tp.Chains; len(chains) > 0; {
			n := min(len(chains), 4000)
			ns.Run(b, setUp(nf.Assemble(tp.Table, chains[:n], nil)))
			chains = chains[n:]
		}
	}
	var svc bus.Chain
	for _, c := range plan.Table(nf.TableNAT).Chains {
		if nf.KindOf(c.Name) == nf.KindService {
			svc = c
			break
		}
	}
	ns.Run(b, setUp([]byte("*nat\n:KUBE-SVC-BENCHBENCHBENCHAA - [0:0]\nCOMMIT\n")))
	cases := []struct{ name, payload string }{
		{"address-match-rule", "*nat\n:KUBE-SVC-BENCHBENCHBENCHAA - [0:0]\n-A KUBE-SVC-BENCHBENCHBENCHAA -s 10.0.0.1/32\nCOMMIT\n"},
		{"comment-rule", "*nat\n:KUBE-SVC-BENCHBENCHBENCHAA - [0:0]\n-A KUBE-SVC-BENCHBENCHBENCHAA -m comment --comment bench\nCOMMIT\n"},
		{"service-chain", string(nf.Assemble(nf.TableNAT, []bus.Chain{svc}, nil))},
	}
	run := func(prefix string) {
		for _, c := range cases {
			b.Run(prefix+"/"+c.name, func(b *testing.B) {
				for b.Loop() {
					ns.Run(b, write([]byte(c.payload)))
				}
			})
		}
	}
	run("unreachable")
	ns.Run(b, func() error { return tool.EnsureJumps(context.Background(), nf.Jumps(false)) })
	run("reachable")
}
