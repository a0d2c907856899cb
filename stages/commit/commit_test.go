package commit

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/render"
)

func TestStaleChains(t *testing.T) {
	svc := nf.PrefixService + "AAAAAAAAAAAAAAAA"
	svl := nf.PrefixServiceLocal + "BBBBBBBBBBBBBBBB"
	ext := nf.PrefixExternal + "CCCCCCCCCCCCCCCC"
	fw := nf.PrefixFirewall + "DDDDDDDDDDDDDDDD"
	sep := nf.PrefixEndpoint + "EEEEEEEEEEEEEEEE" // kube-proxy's per-endpoint chain, never written by kpipe
	xlb := "KUBE-XLB-FFFFFFFFFFFFFFFF"            // kube-proxy's legacy local-balancer chain
	oldSvc := nf.PrefixService + "GGGGGGGGGGGGGGGG"
	deleted := nf.PrefixService + "HHHHHHHHHHHHHHHH"

	existing := []string{
		"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING", // built-in
		nf.ChainServices, nf.ChainNodePorts, nf.ChainPostrouting, nf.ChainMarkMasq, nf.ChainCanary, // kpipe's fixed chains
		"CNI-HOSTPORT-DNAT", "MY-OWN-CHAIN", // someone else's
		svc, svl, ext, fw, sep, xlb, oldSvc, deleted,
	}
	tp := bus.TablePayload{Table: "nat", Delete: []string{deleted}}
	programmed := &bus.Programmed{Chains: map[string]uint64{
		"nat/" + svc: 1, "nat/" + svl: 2, "nat/" + ext: 3,
		"nat/" + nf.ChainServices: 4,
		"filter/" + fw:            5, // same name in another table does not keep the nat one
	}}
	got := staleChains(existing, tp, programmed)
	want := []string{fw, sep, xlb, oldSvc}
	if !slices.Equal(got, want) {
		t.Errorf("staleChains = %v; want %v", got, want)
	}
}

func TestStaleChainsNothingStale(t *testing.T) {
	svc := nf.PrefixService + "AAAAAAAAAAAAAAAA"
	tp := bus.TablePayload{Table: "filter"}
	programmed := &bus.Programmed{Chains: map[string]uint64{"filter/" + svc: 1}}
	if got := staleChains([]string{"INPUT", nf.ChainExternalServices, svc}, tp, programmed); len(got) != 0 {
		t.Errorf("staleChains = %v; want none", got)
	}
	if got := staleChains(nil, tp, programmed); len(got) != 0 {
		t.Errorf("staleChains of an empty table = %v; want none", got)
	}
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func eps(ss ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, s := range ss {
		out = append(out, ap(s))
	}
	return out
}

func TestStaleFlows(t *testing.T) {
	dns := ap("10.96.0.10:53")
	np := ap("0.0.0.0:30053")
	other := ap("10.96.0.20:514")
	base := map[netip.AddrPort][]netip.AddrPort{dns: eps("10.244.1.5:53", "10.244.2.5:53"), np: eps("10.244.1.5:53")}

	tests := []struct {
		name        string
		last, now   *bus.Programmed
		wantChanged bool
		wantGone    []netip.AddrPort
	}{
		{
			name: "first commit always reports (flows from before a restart)",
			last: nil, now: &bus.Programmed{UDP: base},
			wantChanged: true,
		},
		{
			name: "first commit with no UDP services still reports",
			last: nil, now: &bus.Programmed{},
			wantChanged: true,
		},
		{
			name: "nothing changed",
			last: &bus.Programmed{UDP: base},
			now: &bus.Programmed{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53", "10.244.2.5:53"), np: eps("10.244.1.5:53")}},
			wantChanged: false,
		},
		{
			name: "no UDP before or after",
			last: &bus.Programmed{}, now: &bus.Programmed{UDP: map[netip.AddrPort][]netip.AddrPort{}},
			wantChanged: false,
		},
		{
			name: "an endpoint went away",
			last: &bus.Programmed{UDP: base},
			now: &bus.Programmed{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53"), np: eps("10.244.1.5:53")}},
			wantChanged: true,
		},
		{
			name: "a front-end went away",
			last: &bus.Programmed{UDP: base},
			now: &bus.Programmed{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53", "10.244.2.5:53")}},
			wantChanged: true, wantGone: []netip.AddrPort{np},
		},
		{
			name: "a front-end came",
			last: &bus.Programmed{UDP: base},
			now: &bus.Programmed{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53", "10.244.2.5:53"), np: eps("10.244.1.5:53"), other: eps("10.244.3.3:514")}},
			wantChanged: true,
		},
		{
			name:        "every UDP service went away",
			last:        &bus.Programmed{UDP: base},
			now:         &bus.Programmed{},
			wantChanged: true, wantGone: []netip.AddrPort{dns, np},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, changed := staleFlows(bus.IPv4, tt.last, tt.now)
			if changed != tt.wantChanged {
				t.Fatalf("changed = %v; want %v", changed, tt.wantChanged)
			}
			if !changed {
				return
			}
			if got.Family != bus.IPv4 {
				t.Errorf("Family = %v; want IPv4", got.Family)
			}
			if len(got.Now) != len(tt.now.UDP) {
				t.Errorf("Now = %v; want the new front-ends %v", got.Now, tt.now.UDP)
			}
			for k, v := range tt.now.UDP {
				if !slices.Equal(got.Now[k], v) {
					t.Errorf("Now[%v] = %v; want %v", k, got.Now[k], v)
				}
			}
			if len(got.Gone) != len(tt.wantGone) {
				t.Errorf("Gone = %v; want %v", got.Gone, tt.wantGone)
			}
			for _, g := range tt.wantGone {
				if !got.Gone[g] {
					t.Errorf("Gone = %v; want it to hold %v", got.Gone, g)
				}
			}
		})
	}
}

func TestStaleFlowsKeepsFamily(t *testing.T) {
	got, changed := staleFlows(bus.IPv6, nil, &bus.Programmed{UDP: map[netip.AddrPort][]netip.AddrPort{ap("[fd00::10]:53"): eps("[fd00:1::5]:53")}})
	if !changed || got.Family != bus.IPv6 {
		t.Fatalf("staleFlows = %+v, %v; want an IPv6 report", got, changed)
	}
}

// jumpTargets lists the chains that rules jump to ("-j NAME" or "-g NAME").
func jumpTargets(rules []byte) []string {
	var out []string
	fields := strings.Fields(string(rules))
	for i := 0; i+1 < len(fields); i++ {
		if fields[i] == "-j" || fields[i] == "-g" {
			out = append(out, fields[i+1])
		}
	}
	return out
}

// largeState is a cluster whose nat plan needs more than one restore: services
// with a NodePort, source ranges on a load balancer, a Local policy and endpoints
// on this node, so every kind of per-service chain is there.
func largeState(n int) bus.State {
	st := render.SyntheticState(n, 2)
	st.Node = &bus.Node{Name: "node-a", Addrs: []netip.Addr{netip.MustParseAddr("192.168.0.1")}}
	i := 0
	for _, s := range st.Services {
		if i%10 == 0 {
			c := *s
			c.Ports = []bus.Port{{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: int32(30000 + i%2000)}, c.Ports[1]}
			c.LoadBalancerIPs = []netip.Addr{netip.AddrFrom4([4]byte{198, 51, byte(i >> 8), byte(i)})}
			c.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")}
			c.ExternalPolicyLocal = i%20 == 0
			st.Services[s.ServiceKey] = &c
			for _, sl := range st.Slices[s.ServiceKey] {
				local := *sl
				local.Items = append([]bus.Endpoint{}, sl.Items...)
				local.Items[0].NodeName = "node-a"
				st.Slices[s.ServiceKey] = map[string]*bus.EndpointSlice{local.Name: &local}
			}
		}
		i++
	}
	return st
}

var largeConfig = render.Config{Family: bus.IPv4, NodeName: "node-a", MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR,
	ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.128.0.0/9")}}

// Batches are written one after the other into tables that may be empty (a fresh
// node, or one whose tables were flushed): a per-service chain may only jump to
// chains written before it or in its own batch. The top-level chains come last.
func TestSplitChainsOrder(t *testing.T) {
	plan := render.Render(largeConfig, &bus.Snapshot{State: largeState(300), Full: true})
	for _, tp := range plan.Tables {
		declared := map[string]bool{}
		for _, c := range tp.Chains {
			declared[c.Name] = true
		}
		services, top := splitChains(tp.Chains)
		if len(services)+len(top) != len(tp.Chains) {
			t.Fatalf("%s: split %d chains into %d + %d", tp.Table, len(tp.Chains), len(services), len(top))
		}
		for _, c := range top {
			if nf.IsOwned(c.Name) {
				t.Errorf("%s: per-service chain %s among the top-level chains", tp.Table, c.Name)
			}
		}
		written := map[string]bool{}
		for _, c := range services {
			written[c.Name] = true
			for _, target := range jumpTargets(c.Rules) {
				if declared[target] && !written[target] {
					t.Errorf("%s: %s jumps to %s, which is written after it (or only with the top-level chains)", tp.Table, c.Name, target)
				}
			}
		}
		if tp.Table == nf.TableNAT && len(services) == 0 {
			t.Error("nat: no per-service chains; the test needs some")
		}
	}
}

// A full sync big enough to be batched goes into empty tables (a fresh node). It
// runs iptables-restore for real, in a throwaway network namespace.
func TestApplyBatchedFullSyncIntoEmptyTables(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a network namespace")
	}
	for _, tool := range []string{"iptables-restore", "iptables-save", "iptables"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not found", tool)
		}
	}
	n := maxChainsPerRestore/2 + 200 // two chains per service at least
	plan := render.Render(largeConfig, &bus.Snapshot{State: largeState(n), Full: true})
	if got := len(plan.Tables[0].Chains) + len(plan.Tables[1].Chains); got <= maxChainsPerRestore {
		t.Fatalf("plan has %d chains; the test needs more than %d", got, maxChainsPerRestore)
	}
	netnstest.New(t).Run(t, func() error {
		if err := apply(plan); err != nil {
			return fmt.Errorf("full sync into empty tables: %w", err)
		}
		chains, err := nf.Tool{Family: bus.IPv4}.Chains(context.Background(), nf.TableNAT)
		if err != nil {
			return err
		}
		have := map[string]bool{}
		for _, c := range chains {
			have[c] = true
		}
		for _, tp := range plan.Tables {
			if tp.Table != nf.TableNAT {
				continue
			}
			for _, c := range tp.Chains {
				if !have[c.Name] {
					return fmt.Errorf("chain %s missing from the kernel after the sync", c.Name)
				}
			}
		}
		return nil
	})
}

// TestPeriodicRepairsDrift: a periodic plan puts back a rule deleted by hand from a
// top-level chain and a deleted jump from a built-in chain (real iptables, in a
// throwaway network namespace).
func TestPeriodicRepairsDrift(t *testing.T) {
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		t.Skip("iptables-restore not installed (go tool task setup)")
	}
	cfg := render.Config{Family: bus.IPv4, NodeName: "n", MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR}
	st := render.SyntheticState(3, 2)
	fullPlan := render.Render(cfg, &bus.Snapshot{State: st, Full: true})
	periodic := render.Render(cfg, &bus.Snapshot{State: st, Committed: fullPlan.Programmed, Refresh: true})
	netnstest.New(t).Run(t, func() error {
		if err := apply(fullPlan); err != nil {
			return err
		}
		tool := nf.Tool{Family: bus.IPv4}
		before := tool.RuleCount(context.Background(), nf.TableNAT, nf.ChainServices)
		for _, args := range [][]string{
			{"-t", "nat", "-D", nf.ChainServices, "1"},
			{"-t", "nat", "-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", nf.ChainServices},
		} {
			if out, err := exec.Command("iptables", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("iptables %v: %v %s", args, err, out)
			}
		}
		if err := apply(periodic); err != nil {
			return err
		}
		if after := tool.RuleCount(context.Background(), nf.TableNAT, nf.ChainServices); after != before {
			return fmt.Errorf("KUBE-SERVICES has %d rules after the periodic sync; want %d back", after, before)
		}
		out, err := exec.Command("iptables", "-t", "nat", "-S", "PREROUTING").Output()
		if err != nil || !strings.Contains(string(out), "-j "+nf.ChainServices) {
			return fmt.Errorf("the PREROUTING jump is not back: %v\n%s", err, out)
		}
		return nil
	})
}

// apply writes plan the way the commit stage does, in the current network
// namespace.
func apply(plan *bus.Plan) error {
	rules := nf.Tool{Family: bus.IPv4}
	s := NewStage(bus.IPv4, false, bus.NewMailbox[*bus.Plan](), Outputs{}, bus.NewBoard(),
		bus.NewMetrics(prometheus.NewRegistry()), slog.New(slog.DiscardHandler))
	return s.apply(context.Background(), rules, plan)
}
