package commit

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func eps(ss ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, s := range ss {
		out = append(out, ap(s))
	}
	return out
}

// udpMap is a UDP front-end map as a commit leaves it (nil: no commit yet).
type udpMap struct {
	UDP map[netip.AddrPort][]netip.AddrPort
}

func udpOf(p *udpMap) map[netip.AddrPort][]netip.AddrPort {
	if p == nil {
		return nil
	}
	return p.UDP
}

func TestStaleFlows(t *testing.T) {
	dns := ap("10.96.0.10:53")
	np := ap("0.0.0.0:30053")
	other := ap("10.96.0.20:514")
	base := map[netip.AddrPort][]netip.AddrPort{dns: eps("10.244.1.5:53", "10.244.2.5:53"), np: eps("10.244.1.5:53")}

	tests := []struct {
		name        string
		last, now   *udpMap
		wantChanged bool
		wantGone    []netip.AddrPort
	}{
		{
			name: "first commit always reports (flows from before a restart)",
			last: nil, now: &udpMap{UDP: base},
			wantChanged: true,
		},
		{
			name: "first commit with no UDP services still reports",
			last: nil, now: &udpMap{},
			wantChanged: true,
		},
		{
			name: "nothing changed",
			last: &udpMap{UDP: base},
			now: &udpMap{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53", "10.244.2.5:53"), np: eps("10.244.1.5:53")}},
			wantChanged: false,
		},
		{
			name: "no UDP before or after",
			last: &udpMap{}, now: &udpMap{UDP: map[netip.AddrPort][]netip.AddrPort{}},
			wantChanged: false,
		},
		{
			name: "an endpoint went away",
			last: &udpMap{UDP: base},
			now: &udpMap{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53"), np: eps("10.244.1.5:53")}},
			wantChanged: true,
		},
		{
			name: "a front-end went away",
			last: &udpMap{UDP: base},
			now: &udpMap{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53", "10.244.2.5:53")}},
			wantChanged: true, wantGone: []netip.AddrPort{np},
		},
		{
			name: "a front-end came",
			last: &udpMap{UDP: base},
			now: &udpMap{UDP: map[netip.AddrPort][]netip.AddrPort{
				dns: eps("10.244.1.5:53", "10.244.2.5:53"), np: eps("10.244.1.5:53"), other: eps("10.244.3.3:514")}},
			wantChanged: true,
		},
		{
			name:        "every UDP service went away",
			last:        &udpMap{UDP: base},
			now:         &udpMap{},
			wantChanged: true, wantGone: []netip.AddrPort{dns, np},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, changed := staleFlows(bus.IPv4, udpOf(tt.last), tt.last != nil, udpOf(tt.now))
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
	got, changed := staleFlows(bus.IPv6, nil, false, map[netip.AddrPort][]netip.AddrPort{ap("[fd00::10]:53"): eps("[fd00:1::5]:53")})
	if !changed || got.Family != bus.IPv6 {
		t.Fatalf("staleFlows = %+v, %v; want an IPv6 report", got, changed)
	}
}

// jumpTargets lists the chains that rules jump to ("-j NAME" or "-g NAME").
func jumpTargets(rules string) []string {
	var out []string
	fields := strings.Fields(rules)
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
	st := rendertest.SyntheticState(n, 2)
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
			if nf.KindOf(c.Name).PerService() {
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
	netnstest.RequireRoot(t)
	for _, tool := range []string{"iptables-restore", "iptables-save", "iptables"} {
		if _, err := exec.LookPath(tool); err != nil {
			netnstest.Unavailable(t, fmt.Sprintf("%s not found", tool))
		}
	}
	n := maxChainsPerRestore/2 + 200 // two chains per service at least
	plan := render.Render(largeConfig, &bus.Snapshot{State: largeState(n), Full: true})
	if got := len(plan.Table(nf.TableNAT).Chains) + len(plan.Table(nf.TableFilter).Chains); got <= maxChainsPerRestore {
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
// top-level chain, a rule changed by hand in a bucket (same number of rules, other
// content) and a deleted jump from a built-in chain (real iptables, in a throwaway
// network namespace).
func TestPeriodicRepairsDrift(t *testing.T) {
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		netnstest.Unavailable(t, "iptables-restore not installed (go tool task setup)")
	}
	cfg := render.Config{Family: bus.IPv4, NodeName: "n", MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR}
	st := rendertest.SyntheticState(3, 2)
	fullPlan := render.Render(cfg, &bus.Snapshot{State: st, Full: true})
	periodic := render.Render(cfg, &bus.Snapshot{State: st, Refresh: true})
	netnstest.New(t).Run(t, func() error {
		s := realStage()
		if err := s.apply(context.Background(), fullPlan); err != nil {
			return err
		}
		tool := nf.Tool{Family: bus.IPv4}
		save := func() (map[string][]string, error) { return tool.Save(context.Background(), nf.TableNAT) }
		before, err := save()
		if err != nil {
			return err
		}
		bucket := nf.BucketChain(nf.Bucket(st.Services[bus.ServiceKey{Namespace: "ns0", Name: "svc0"}].ClusterIPs[0]))
		// Another rule in place of the first: the rule count stays, the content does not.
		changed := []string{"-t", "nat", "-R", bucket, "1", "-d", "10.96.0.0/32", "-j", nf.ChainMarkMasq}
		for _, args := range [][]string{
			{"-t", "nat", "-D", nf.ChainServices, "1"},
			changed,
			{"-t", "nat", "-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", nf.ChainServices},
		} {
			if out, err := exec.Command("iptables", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("iptables %v: %v %s", args, err, out)
			}
		}
		if err := s.apply(context.Background(), periodic); err != nil {
			return err
		}
		after, err := save()
		if err != nil {
			return err
		}
		for _, c := range []string{nf.ChainServices, bucket} {
			if !slices.Equal(after[c], before[c]) {
				return fmt.Errorf("%s after the periodic sync:\n%s\nwant back:\n%s", c, strings.Join(after[c], "\n"), strings.Join(before[c], "\n"))
			}
		}
		out, err := exec.Command("iptables", "-t", "nat", "-S", "PREROUTING").Output()
		if err != nil || !strings.Contains(string(out), "-j "+nf.ChainServices) {
			return fmt.Errorf("the PREROUTING jump is not back: %v\n%s", err, out)
		}
		return nil
	})
}

// realStage is a commit stage that writes into the real iptables of the current
// network namespace.
func realStage() *Stage { return testStage(nf.Tool{Family: bus.IPv4}) }

// testStage is a commit stage of IPv4 over kernel, with fresh mailboxes and ledger.
func testStage(kernel Kernel) *Stage { return testStageOn(kernel, bus.NewBoard()) }

// testStageOn is testStage reporting to board.
func testStageOn(kernel Kernel, board *bus.Board) *Stage {
	return NewStage(Params{Family: bus.IPv4, In: bus.NewMailbox[*bus.Plan](),
		Results: bus.NewMailbox[bus.Result](), Resend: bus.NewResendFlag(),
		Flows: bus.NewMergingMailbox(bus.MergeStaleFlows), HealthChecks: bus.NewMergingMailbox(bus.MergeHealthCheckUpdates),
		Ledger: NewLedger(), Kernel: kernel,
		Env: bus.Envs{Metrics: metrics.New(prometheus.NewRegistry()), Board: board}.For(bus.Commit.Of(bus.IPv4))})
}

// requireNFTables stops a test of the real kernel where it cannot run (it
// skips, and fails in CI): not root, or iptables not the nf_tables backend.
func requireNFTables(t *testing.T) {
	t.Helper()
	netnstest.RequireRoot(t)
	if !nf.OnNFTables(bus.IPv4) {
		netnstest.Unavailable(t, "iptables is not the nf_tables backend (go tool task setup)")
	}
}

// apply writes plan into the current network namespace with a new commit stage
// (an empty ledger: the plan is written as a full sync).
func apply(plan *bus.Plan) error { return realStage().apply(context.Background(), plan) }
