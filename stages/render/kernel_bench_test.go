package render

import (
	"context"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
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
	plan := syntheticPlan(n)
	ns := netnstest.New(b)
	tool := nf.Tool{Family: bus.IPv4, Writer: nf.WriterNetlink}
	// What is timed, netlink only: a payload the writer does not take fails
	// the benchmark rather than timing iptables-restore.
	write := func(payload []byte) func() error {
		return func() error { return tool.RestoreNetlink(context.Background(), payload) }
	}
	for _, tp := range plan.Tables {
		loadTable(b, ns, tool, tp.Table, tp.Chains)
	}
	svc := firstServiceChain(plan.Table(nf.TableNAT).Chains)
	setUp := func(payload []byte) func() error {
		return func() error { return tool.Prepare(payload)(context.Background()) }
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

// syntheticPlan is the plan of the benchmarks' cluster of n services.
func syntheticPlan(n int) *bus.Plan {
	cfg := Config{Family: bus.IPv4, NodeName: "bench-node", MasqueradeBit: 14, DetectLocal: DetectClusterCIDR, ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}
	return Render(cfg, &bus.Snapshot{State: rendertest.SyntheticState(n, 10), Full: true})
}

// loadTable writes chains into table as commit writes a full sync, in steps.
func loadTable(b *testing.B, ns *netnstest.Namespace, tool nf.Tool, table string, chains []bus.Chain) {
	for len(chains) > 0 {
		n := min(len(chains), 4000)
		payload := nf.Assemble(table, chains[:n], nil)
		ns.Run(b, func() error { return tool.Prepare(payload)(context.Background()) })
		chains = chains[n:]
	}
}

func firstServiceChain(chains []bus.Chain) bus.Chain {
	for _, c := range chains {
		if nf.KindOf(c.Name) == nf.KindService {
			return c
		}
	}
	panic("no service chain")
}

// BenchmarkKernelWalk is what the validation walk costs for the nat table of
// 1,000 and 10,000 services (as BenchmarkKernelOneChainWrite's) in other
// shapes: one walked write (a service chain, as commit writes it) into a
// namespace holding the whole table in each shape, its built-in chains
// jumping into kpipe's. The shapes take out what the walk might pay for and
// nothing else: as-rendered; no-comments (every rule comment, an xt match the
// walk validates); no-empty-port-match (the "-m tcp"/"-m udp" without a
// --dport on endpoint rules, which only repeats -p); one-base-chain (the nat
// OUTPUT jump to KUBE-SERVICES left out, so the walk enters KUBE-SERVICES
// from PREROUTING only).
func BenchmarkKernelWalk(b *testing.B) {
	netnstest.RequireRoot(b)
	for _, n := range []int{1000, 10000} {
		nat := syntheticPlan(n).Table(nf.TableNAT)
		svc := firstServiceChain(nat.Chains)
		for _, s := range walkShapes {
			b.Run(fmt.Sprintf("services=%d/%s", n, s.name), func(b *testing.B) {
				ns := netnstest.New(b)
				tool := nf.Tool{Family: bus.IPv4, Writer: nf.WriterNetlink}
				loadTable(b, ns, tool, nf.TableNAT, reshape(nat.Chains, s.rules))
				ns.Run(b, func() error { return tool.EnsureJumps(context.Background(), s.jumps(nf.Jumps(false))) })
				payload := nf.Assemble(nf.TableNAT, reshape([]bus.Chain{svc}, s.rules), nil)
				for b.Loop() {
					ns.Run(b, func() error { return tool.RestoreNetlink(context.Background(), payload) })
				}
			})
		}
	}
}

// walkShape is one way of writing the same table: rules rewrites each rule
// line, jumps picks the built-in chains' jumps.
type walkShape struct {
	name  string
	rules func(line string) string
	jumps func([]nf.Jump) []nf.Jump
}

var (
	commentMatch   = regexp.MustCompile(`-m comment --comment ("[^"]*"|\S+) `)
	emptyPortMatch = regexp.MustCompile(`-m (tcp|udp|sctp) (-p (tcp|udp|sctp) )`)
)

func sameRule(line string) string     { return line }
func allJumps(js []nf.Jump) []nf.Jump { return js }
func withoutNATOutput(js []nf.Jump) []nf.Jump {
	return slices.DeleteFunc(slices.Clone(js), func(j nf.Jump) bool { return j.Table == nf.TableNAT && j.From == "OUTPUT" })
}

var walkShapes = []walkShape{
	{"as-rendered", sameRule, allJumps},
	{"no-comments", func(l string) string { return commentMatch.ReplaceAllString(l, "") }, allJumps},
	{"no-empty-port-match", func(l string) string {
		if strings.Contains(l, "--dport") {
			return l
		}
		return emptyPortMatch.ReplaceAllString(l, "$2")
	}, allJumps},
	{"one-base-chain", sameRule, withoutNATOutput},
}

// reshape is chains with each rule line rewritten.
func reshape(chains []bus.Chain, rule func(string) string) []bus.Chain {
	out := make([]bus.Chain, len(chains))
	for i, c := range chains {
		lines := strings.SplitAfter(c.Rules, "\n")
		for j, l := range lines {
			lines[j] = rule(l)
		}
		out[i] = bus.Chain{Name: c.Name, Rules: strings.Join(lines, "")}
	}
	return out
}
