package commit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

var fakeConfig = render.Config{Family: bus.IPv4, NodeName: "node-a", MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR,
	ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.128.0.0/9")}}

func planOf(st bus.State, gen uint64, full bool) *bus.Plan {
	return render.Render(fakeConfig, &bus.Snapshot{Generation: gen, State: st, Full: full})
}

// freshKernel is what a kpipe that never ran before writes for st.
func freshKernel(t *testing.T, st bus.State) string {
	t.Helper()
	k := fakekernel.New()
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	return k.Dump()
}

func requireFresh(t *testing.T, k *fakekernel.Kernel, st bus.State, when string) {
	t.Helper()
	want, got := freshKernel(t, st), k.Dump()
	if got != want {
		t.Fatalf("%s: the kernel is not what a fresh kpipe writes:\n%s", when, lineDiff(want, got))
	}
}

func lineDiff(want, got string) string {
	w, g := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(want, "\n") {
		w[l] = true
	}
	for _, l := range strings.Split(got, "\n") {
		g[l] = true
	}
	var b strings.Builder
	for _, l := range slices.Sorted(maps.Keys(w)) {
		if !g[l] {
			b.WriteString("- " + l + "\n")
		}
	}
	for _, l := range slices.Sorted(maps.Keys(g)) {
		if !w[l] {
			b.WriteString("+ " + l + "\n")
		}
	}
	return b.String()
}

// with returns st with services changed: extra services added (by index into a
// synthetic state), some removed, and one service's endpoints cut to one.
func with(st bus.State, add []int, remove []string, shrink string) bus.State {
	out := st
	out.Services, out.Slices = maps.Clone(st.Services), maps.Clone(st.Slices)
	extra := rendertest.SyntheticState(300, 2)
	for _, i := range add {
		k := bus.ServiceKey{Namespace: fmt.Sprintf("ns%d", i%100), Name: fmt.Sprintf("svc%d", i)}
		out.Services[k], out.Slices[k] = extra.Services[k], extra.Slices[k]
	}
	for _, name := range remove {
		for k := range out.Services {
			if k.Name == name {
				delete(out.Services, k)
				delete(out.Slices, k)
			}
		}
	}
	for k, sls := range out.Slices {
		if k.Name != shrink {
			continue
		}
		inner := map[string]*bus.EndpointSlice{}
		for n, sl := range sls {
			c := *sl
			c.Items = c.Items[:1]
			inner[n] = &c
		}
		out.Slices[k] = inner
	}
	return out
}

// TestRestartAfterALostWrite: commit is killed after the kernel took a plan but
// before it could answer; coalesce sends the state again, which by then went back
// to what it was. The restarted commit must undo the lost plan: chains it created
// deleted, chains it changed (and that changed back) rewritten. Before the ledger,
// the resend was diffed against the last acknowledged commit, which equals the new
// state, so nothing was written and the lost plan's rules stayed for an hour.
func TestRestartAfterALostWrite(t *testing.T) {
	k := fakekernel.New()
	ledger := NewLedger()
	base := rendertest.SyntheticState(20, 2)
	first := testStage(k)
	first.ledger = ledger
	if err := first.apply(context.Background(), planOf(base, 1, true)); err != nil {
		t.Fatal(err)
	}
	k.StallAfter = func(n int) bool { return true }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	lost := with(base, []int{100, 101}, []string{"svc3"}, "svc5")
	go func() { done <- first.apply(ctx, planOf(lost, 2, false)) }()
	time.Sleep(50 * time.Millisecond)
	cancel() // the supervisor kills commit while the kernel already holds plan 2
	if err := <-done; err == nil {
		t.Fatal("apply returned nil after its context was cancelled mid-write")
	}
	k.StallAfter = nil

	restarted := testStage(k)
	restarted.ledger = ledger
	if err := restarted.apply(context.Background(), planOf(base, 3, false)); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, base, "after the restarted commit wrote the resent state")
}

// TestBatchCutShort: a large plan written in several restores fails in the
// middle. The next (partial) plan must still leave exactly the fresh rules.
func TestBatchCutShort(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	base := rendertest.SyntheticState(20, 2)
	if err := s.apply(context.Background(), planOf(base, 1, true)); err != nil {
		t.Fatal(err)
	}
	big := largeState(maxChainsPerRestore/2 + 200)
	calls := 0
	k.BeforeRestore = func(int, string) error {
		if calls++; calls == 2 {
			return errors.New("injected: restore failed")
		}
		return nil
	}
	if err := s.apply(context.Background(), planOf(big, 2, false)); err == nil {
		t.Fatal("the injected failure did not fail the commit")
	}
	k.BeforeRestore = nil
	if err := s.apply(context.Background(), planOf(base, 3, false)); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, base, "after a batched write was cut short and the next plan went back")
}

// TestPartialSyncWritesOnlyWhatChanged: after a commit, a changed endpoint
// rewrites only its service's chain; a deleted service deletes its chains.
func TestPartialSyncWritesOnlyWhatChanged(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	base := rendertest.SyntheticState(20, 2)
	if err := s.apply(context.Background(), planOf(base, 1, true)); err != nil {
		t.Fatal(err)
	}
	k.Payloads = nil
	shrunk := with(base, nil, nil, "svc5")
	if err := s.apply(context.Background(), planOf(shrunk, 2, false)); err != nil {
		t.Fatal(err)
	}
	if len(k.Payloads) != 1 {
		t.Fatalf("%d restores for one changed service; want 1", len(k.Payloads))
	}
	declared := regexpDeclared(k.Payloads[0])
	key := bus.ServiceKey{Namespace: "ns5", Name: "svc5"}
	svc := shrunk.Services[key]
	want := []string{nf.ServiceChain(nf.PrefixService, svc.PortName(svc.Ports[0])), nf.ServiceChain(nf.PrefixService, svc.PortName(svc.Ports[1]))}
	slices.Sort(want)
	if !slices.Equal(declared, want) {
		t.Errorf("rewrote %v; want only the changed service's chains %v", declared, want)
	}
	requireFresh(t, k, shrunk, "after the partial sync")

	k.Payloads = nil
	gone := with(shrunk, nil, []string{"svc5"}, "")
	if err := s.apply(context.Background(), planOf(gone, 3, false)); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, gone, "after a service was deleted")
	k.Payloads = nil
	if err := s.apply(context.Background(), planOf(gone, 4, false)); err != nil {
		t.Fatal(err)
	}
	if len(k.Payloads) != 0 {
		t.Errorf("an unchanged state wrote:\n%s", k.Payloads)
	}
}

func regexpDeclared(payload string) []string {
	var out []string
	for _, l := range strings.Split(payload, "\n") {
		if strings.HasPrefix(l, ":") {
			name, _, _ := strings.Cut(l[1:], " ")
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// TestRefreshRepairsChangedContent: a periodic sync notices a top-level chain and
// a bucket whose rules were changed by hand without changing their number (the
// old check compared rule counts only), and rewrites them, and nothing else.
func TestRefreshRepairsChangedContent(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	st := rendertest.SyntheticState(20, 2)
	if err := s.apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	bucket := nf.BucketChain(nf.Bucket(st.Services[bus.ServiceKey{Namespace: "ns0", Name: "svc0"}].ClusterIPs[0]))
	k.Mu.Lock()
	k.Tables[nf.TableNAT][bucket][0] = "-A " + bucket + " -d 10.96.0.0/32 -j " + nf.ChainMarkMasq
	k.Tables[nf.TableNAT][nf.ChainNodePorts] = append(k.Tables[nf.TableNAT][nf.ChainNodePorts], "-A "+nf.ChainNodePorts+" -j "+nf.ChainMarkMasq)
	k.Tables[nf.TableFilter][nf.ChainForward][0] = "-A " + nf.ChainForward + " -j ACCEPT"
	k.Mu.Unlock()
	k.Payloads = nil
	if err := s.apply(context.Background(), render.Render(fakeConfig, &bus.Snapshot{Generation: 2, State: st, Refresh: true})); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, st, "after the periodic sync")
	if got, want := regexpDeclared(strings.Join(k.Payloads, "")), []string{bucket, nf.ChainForward, nf.ChainNodePorts}; !slices.Equal(got, sorted(want)) {
		t.Errorf("periodic sync rewrote %v; want only the tampered %v", got, sorted(want))
	}
}

func sorted(s []string) []string { slices.Sort(s); return s }

// TestStaleChainsDeletedInBatchesAfterTheSwitch: taking over a node kube-proxy
// programmed (a KUBE-SEP- chain per endpoint) deletes its chains a batch at a
// time, referrers first, and only after kpipe's own rules are in place.
func TestStaleChainsDeletedInBatchesAfterTheSwitch(t *testing.T) {
	k := fakekernel.New()
	// kube-proxy's leftovers: 1500 services with 6 endpoint chains each.
	nat := k.Tables[nf.TableNAT]
	nat[nf.ChainMarkMasq] = nil
	for i := range 1500 {
		svc := fmt.Sprintf("%sOLD%013d", nf.PrefixService, i)
		nat[svc] = nil
		for j := range 6 {
			sep := fmt.Sprintf("%sOLD%010d%03d", nf.PrefixEndpoint, i, j)
			nat[sep] = []string{"-A " + sep + " -j " + nf.ChainMarkMasq}
			nat[svc] = append(nat[svc], "-A "+svc+" -j "+sep)
		}
	}
	st := rendertest.SyntheticState(20, 2)
	deletes, topWritten := []int{}, -1
	k.BeforeRestore = func(n int, payload string) error {
		if strings.Contains(payload, ":"+nf.ChainServices+" ") {
			topWritten = n
		}
		if c := strings.Count(payload, "\n-X "); c > 0 {
			deletes = append(deletes, c)
			if topWritten < 0 {
				t.Errorf("restore %d deletes chains before the top-level chains were written", n)
			}
		}
		return nil
	}
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	for _, n := range deletes {
		if n > maxChainsPerRestore {
			t.Errorf("one restore deletes %d chains; want at most %d", n, maxChainsPerRestore)
		}
	}
	if len(deletes) < 2 {
		t.Errorf("deletes in %d restores (%v); want them batched", len(deletes), deletes)
	}
	requireFresh(t, k, st, "after taking over")
}

// TestBatchedSyncNeverLeavesAGap: during a full sync big enough to be batched, a
// service that lost its endpoints is never without both its DNAT and its REJECT,
// and a new load balancer's KUBE-FW- chain is never reachable before the
// KUBE-PROXY-FIREWALL DROP it relies on; nor a removed one's after the DROP went.
// Also by a new process (a new ledger, which knows none of the filter rules
// the kernel holds), after a restart or a takeover. On nf_tables the full sync
// writes only what differs, in one run of several transactions; on legacy
// (no digest to compare with) it writes everything, in steps.
func TestBatchedSyncNeverLeavesAGap(t *testing.T) {
	for _, restarted := range []bool{false, true} {
		for _, legacy := range []bool{false, true} {
			t.Run(fmt.Sprintf("restarted=%v/legacy=%v", restarted, legacy), func(t *testing.T) {
				batchedSyncNeverLeavesAGap(t, restarted, legacy)
			})
		}
	}
}

func batchedSyncNeverLeavesAGap(t *testing.T, restarted, legacy bool) {
	k := fakekernel.New()
	var kernel Kernel = k
	if legacy {
		kernel = &legacyKernel{Kernel: k}
	}
	s := testStage(kernel)
	before := largeState(maxChainsPerRestore/2 + 200)
	after, gaps := gapScenario(before)
	if err := s.apply(context.Background(), planOf(before, 1, true)); err != nil {
		t.Fatal(err)
	}
	if restarted {
		s = testStage(kernel)
	}
	state := map[string]map[string][]string{}
	k.Observe = func(table string, chains map[string][]string) {
		state[table] = chains
		if state[nf.TableNAT] == nil || state[nf.TableFilter] == nil {
			return
		}
		for _, g := range gaps(state[nf.TableNAT], state[nf.TableFilter]) {
			t.Errorf("after transaction %d (%s): %s", k.Blocks, table, g)
		}
	}
	state[nf.TableNAT], _ = k.Save(context.Background(), nf.TableNAT)
	state[nf.TableFilter], _ = k.Save(context.Background(), nf.TableFilter)
	restores := k.Restores
	if err := s.apply(context.Background(), planOf(after, 2, true)); err != nil {
		t.Fatal(err)
	}
	if n := k.Restores - restores; legacy && n < 3 {
		t.Fatalf("the full sync took %d restores; the test needs a batched one", n)
	}
	requireFresh(t, k, after, "after the full sync")
}

// gapScenario changes before (a largeState) so that one service loses its
// endpoints, one gets a load balancer with source ranges and one loses its
// source ranges. gaps says what in a state of the kernel's nat and filter
// tables would let a packet through that neither before nor after lets
// through: the service without both its DNAT and its REJECT, a KUBE-FW- chain
// reachable without the KUBE-PROXY-FIREWALL DROP it relies on.
func gapScenario(before bus.State) (after bus.State, gaps func(nat, filter map[string][]string) []string) {
	var losing, newLB, oldLB *bus.Service
	for _, key := range slices.SortedFunc(maps.Keys(before.Services), func(a, b bus.ServiceKey) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	}) {
		svc := before.Services[key]
		switch {
		case losing == nil && len(svc.LoadBalancerIPs) == 0:
			losing = svc
		case oldLB == nil && len(svc.LoadBalancerSourceRanges) > 0:
			oldLB = svc
		case newLB == nil && len(svc.LoadBalancerIPs) == 0 && svc != losing:
			newLB = svc
		}
	}
	after = before
	after.Services, after.Slices = maps.Clone(before.Services), maps.Clone(before.Slices)
	delete(after.Slices, losing.ServiceKey)
	lb := *newLB
	lb.LoadBalancerIPs = []netip.Addr{netip.MustParseAddr("192.0.2.77")}
	lb.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")}
	after.Services[lb.ServiceKey] = &lb
	oldCopy := *oldLB
	oldCopy.LoadBalancerSourceRanges = nil
	after.Services[oldLB.ServiceKey] = &oldCopy

	losingIP := losing.ClusterIPs[0].String() + "/32"
	newFW := nf.ServiceChain(nf.PrefixFirewall, lb.PortName(lb.Ports[0]))
	oldFW := nf.ServiceChain(nf.PrefixFirewall, oldLB.PortName(oldLB.Ports[0]))
	return after, func(nat, filter map[string][]string) []string {
		var out []string
		nat = reachable(nat) // a full sync deletes the chains it no longer wants last
		dnat := anyRule(nat, func(r string) bool {
			return strings.Contains(r, "-d "+losingIP) && strings.Contains(r, "-j "+nf.PrefixService)
		})
		reject := anyRule(filter, func(r string) bool { return strings.Contains(r, "-d "+losingIP) && strings.Contains(r, "-j REJECT") })
		if !dnat && !reject {
			out = append(out, fmt.Sprintf("%s has neither its DNAT nor its REJECT", losingIP))
		}
		for _, fw := range []struct {
			chain string
			ip    netip.Addr
		}{{newFW, lb.LoadBalancerIPs[0]}, {oldFW, oldLB.LoadBalancerIPs[0]}} {
			_, reached := nat[fw.chain]
			drop := anyRule(filter, func(r string) bool {
				return strings.Contains(r, "-d "+fw.ip.String()+"/32") && strings.HasSuffix(r, "-j DROP")
			})
			if reached && !drop {
				out = append(out, fmt.Sprintf("%s is reachable but KUBE-PROXY-FIREWALL has no DROP for %s", fw.chain, fw.ip))
			}
		}
		return out
	}
}

// gapsIn is what gaps (of a gapScenario) finds in the real kernel's tables.
func gapsIn(ctx context.Context, tool nf.Tool, gaps func(nat, filter map[string][]string) []string) ([]string, error) {
	nat, err := tool.Save(ctx, nf.TableNAT)
	if err != nil {
		return nil, err
	}
	filter, err := tool.Save(ctx, nf.TableFilter)
	if err != nil {
		return nil, err
	}
	return gaps(nat, filter), nil
}

// reachable is the chains of a table a packet can reach: from the top-level
// chains (which the built-in chains jump to), through the jumps of their rules.
func reachable(chains map[string][]string) map[string][]string {
	out := map[string][]string{}
	var walk func(chain string)
	walk = func(chain string) {
		rules, ok := chains[chain]
		if _, seen := out[chain]; seen || !ok {
			return
		}
		out[chain] = rules
		for _, r := range rules {
			f := strings.Fields(r)
			for i := range len(f) - 1 {
				if f[i] == "-j" || f[i] == "-g" {
					walk(f[i+1])
				}
			}
		}
	}
	for chain := range chains {
		if nf.KindOf(chain) == nf.KindTop {
			walk(chain)
		}
	}
	return out
}

func anyRule(chains map[string][]string, f func(string) bool) bool {
	for _, rules := range chains {
		for _, r := range rules {
			if f(r) {
				return true
			}
		}
	}
	return false
}

// TestRouteLocalnetAfterTheFirewall: route_localnet opens 127.0.0.0/8 to the
// network (CVE-2020-8558) unless KUBE-FIREWALL drops what it must: commit sets it
// only once the rule and the jumps into it are in the kernel.
func TestRouteLocalnetAfterTheFirewall(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	s.localnetFirewall = true
	cfg := fakeConfig
	cfg.LocalhostNodePorts = true
	k.BeforeRestore = func(int, string) error { return errors.New("injected: iptables broken") }
	plan := render.Render(cfg, &bus.Snapshot{Generation: 1, State: rendertest.SyntheticState(3, 1), Full: true})
	if err := s.apply(context.Background(), plan); err == nil {
		t.Fatal("injected failure did not fail the commit")
	}
	if slices.ContainsFunc(k.Events, func(e string) bool { return strings.HasPrefix(e, "sysctl") }) {
		t.Fatalf("route_localnet set although the firewall rule could not be written: %v", k.Events)
	}
	k.BeforeRestore = nil
	if err := s.apply(context.Background(), plan); err != nil {
		t.Fatal(err)
	}
	i := slices.Index(k.Events, "sysctl net/ipv4/conf/all/route_localnet=1")
	j := slices.Index(k.Events, "jumps")
	if i < 0 || j < 0 || i < j {
		t.Fatalf("events %v; want the jumps ensured, then route_localnet set", k.Events)
	}
	if !anyRule(map[string][]string{"": k.Tables[nf.TableFilter][nf.ChainLocalnetFirewall]}, func(r string) bool { return strings.HasSuffix(r, "-j DROP") }) {
		t.Error("no localnet DROP rule in KUBE-FIREWALL")
	}
}

// runStage runs s until stop is called, as the supervisor runs it.
func runStage(t *testing.T, s *Stage) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	return sync.OnceFunc(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// TestRunProtocol: what commit sends after each plan. A failed restore answers
// with the plan's generation and no health checks; a success answers OK, then
// forwards the health checks; stale flows only when UDP front-ends changed; a
// restarted commit asks for the state again and still knows the UDP front-ends
// the kernel has, so flows to a UDP service deleted across the restart are
// cleared.
func TestRunProtocol(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	out := s.p
	stop := runStage(t, s)
	defer func() { stop() }() // the Run of the moment: it is started again below
	select {
	case <-out.Resend.C():
	case <-time.After(5 * time.Second):
		t.Error("commit did not ask for a resend at start")
	}
	st := rendertest.SyntheticState(5, 1)
	k.BeforeRestore = func(int, string) error { return errors.New("injected: restore failed") }
	s.p.In.Put(planOf(st, 7, true))
	if r := bustest.Take(t, out.Results, "result"); r.OK || r.Generation != 7 || r.Err == nil {
		t.Fatalf("result of a failed restore = %+v; want not OK, generation 7, an error", r)
	}
	if _, ok := out.HealthChecks.TryTake(); ok {
		t.Error("health checks forwarded for a plan that failed")
	}
	k.BeforeRestore = nil
	// Not marked full, but nothing was ever committed: it is written, and
	// answered, as a full sync.
	s.p.In.Put(planOf(st, 8, false))
	if r := bustest.Take(t, out.Results, "result"); !r.OK || r.Generation != 8 || !r.Full {
		t.Fatalf("result = %+v; want OK full generation 8", r)
	}
	bustest.Take(t, out.HealthChecks, "health checks")
	first := bustest.Take(t, out.Flows, "stale flows")
	if len(first.Now) != 5 {
		t.Errorf("first commit's flows name %d UDP front-ends; want 5", len(first.Now))
	}
	s.p.In.Put(planOf(st, 9, false))
	bustest.Take(t, out.Results, "result")
	if f, ok := out.Flows.TryTake(); ok {
		t.Errorf("stale flows %+v after a commit that changed no UDP front-end", f)
	}

	// A restart: the supervisor stops Run and starts it again; the ledger and the
	// mailboxes outlive it.
	stop()
	stop = runStage(t, s)
	gone := with(st, nil, []string{"svc2"}, "")
	s.p.In.Put(planOf(gone, 10, false))
	bustest.Take(t, out.Results, "result")
	flows := bustest.Take(t, out.Flows, "stale flows after the restart")
	if len(flows.Gone) != 1 {
		t.Errorf("after a restart, a deleted UDP service's front-end is not gone: %+v", flows.Gone)
	}
}

// TestRunReportsSyncStatus: commit's entry on the board (what /sync and /healthz
// show) names the generation of the last successful commit, when it finished,
// and when the last full one finished; a failure counts as an error and changes
// none of them.
func TestRunReportsSyncStatus(t *testing.T) {
	k := fakekernel.New()
	board := bus.NewBoard()
	s := testStageOn(k, board)
	stop := runStage(t, s)
	defer stop()
	report := func() bus.Report { return board.Read()[bus.Commit.Of(bus.IPv4)] }
	st := rendertest.SyntheticState(3, 1)

	before := time.Now()
	s.p.In.Put(planOf(st, 4, false)) // the first commit of a process is a full one
	bustest.Take(t, s.p.Results, "result")
	r := report()
	if r.Generation != 4 || r.LastSync.Before(before) || !r.LastFullSync.Equal(r.LastSync) {
		t.Fatalf("after a first commit: %+v; want generation 4, last sync = last full sync, after %v", r, before)
	}
	full := r.LastFullSync

	s.p.In.Put(planOf(st, 5, false))
	bustest.Take(t, s.p.Results, "result")
	r = report()
	if r.Generation != 5 || !r.LastSync.After(full) || !r.LastFullSync.Equal(full) {
		t.Fatalf("after a partial commit: %+v; want generation 5, a new last sync, the full sync of generation 4", r)
	}
	last := r.LastSync

	k.BeforeRestore = func(int, string) error { return errors.New("injected: restore failed") }
	// A full sync writes only what the kernel lacks: this one has a new service.
	s.p.In.Put(planOf(rendertest.SyntheticState(4, 1), 6, true))
	bustest.Take(t, s.p.Results, "result")
	r = report()
	if r.Generation != 5 || !r.LastSync.Equal(last) || !r.LastFullSync.Equal(full) || r.Errors != 1 || r.LastError == "" {
		t.Fatalf("after a failed commit: %+v; want generation 5 and the same times, one error", r)
	}
}

// TestFailedCommitIsLeftToCoalesceToLog: a failed commit is counted (the restore
// failures metric, the stage's errors) and answered, but commit writes no log
// record about it: coalesce logs it once, with the backoff it retries after.
func TestFailedCommitIsLeftToCoalesceToLog(t *testing.T) {
	k := fakekernel.New()
	board := bus.NewBoard()
	s := testStageOn(k, board)
	var records countingHandler
	s.log = slog.New(&records)
	stop := runStage(t, s)
	defer stop()
	k.BeforeRestore = func(int, string) error { return errors.New("injected: restore failed") }
	for gen := uint64(1); gen <= 3; gen++ {
		s.p.In.Put(planOf(rendertest.SyntheticState(2, 1), gen, true))
		if r := bustest.Take(t, s.p.Results, "result"); r.OK {
			t.Fatalf("generation %d: result OK; want a failure", gen)
		}
	}
	var m dto.Metric
	if err := s.metrics.RestoreFailures.WithLabelValues("IPv4").Write(&m); err != nil || m.GetCounter().GetValue() != 3 {
		got := m.GetCounter().GetValue()
		t.Errorf("restore failures = %v; want 3", got)
	}
	if r := board.Read()[bus.Commit.Of(bus.IPv4)]; r.Errors != 3 {
		t.Errorf("commit's errors on the board = %d; want 3", r.Errors)
	}
	if n := records.atLeast(slog.LevelInfo); n != 0 {
		t.Errorf("commit logged %d records at info or above about failures coalesce logs", n)
	}
}

// countingHandler counts log records by level.
type countingHandler struct {
	mu     sync.Mutex
	levels []slog.Level
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.levels = append(h.levels, r.Level)
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func (h *countingHandler) atLeast(l slog.Level) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, v := range h.levels {
		if v >= l {
			n++
		}
	}
	return n
}

// TestKilledWhileDeletingStaleChainsIsNoSuccess: a commit killed while a full
// sync deletes its stale chains (the last part of it) has not done the full
// sync: it must not answer OK, or coalesce stops asking for one and the stale
// chain stays until the hourly full sync. (Seen in e2e
// TestKillStagesDuringChurnAndFullSyncs: a stray KUBE-SEP- chain added by
// hand was still there 30 s after the kill.) The restarted commit, sent the
// full sync again, deletes it.
func TestKilledWhileDeletingStaleChainsIsNoSuccess(t *testing.T) {
	k, s, st, ctx, stray := killedWhileDeletingAStaleChain(t)
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	s.p.In.Put(planOf(st, 5, true))
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if r, ok := s.p.Results.TryTake(); ok && r.OK {
		t.Fatalf("a full sync killed before its stale chains were deleted answered %+v; want no success", r)
	}

	k.BeforeRestore = nil
	stop := runStage(t, s)
	defer stop()
	s.p.In.Put(planOf(st, 6, true)) // coalesce still wants the full sync
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK || !r.Full {
		t.Fatalf("result = %+v; want OK full", r)
	}
	if _, ok := k.Tables[nf.TableNAT][stray]; ok {
		t.Errorf("the stale chain %s is still there after the full sync", stray)
	}
	requireFresh(t, k, st, "after the full sync")
}

// TestKilledFullSyncIsWrittenFullAgain: after a commit killed while a full
// sync deleted its stale chains, the ledger does not count that sync as done:
// the next plan, even one not marked full (a repair's apply of the last plan,
// as in e2e TestKillStagesDuringChurnAndFullSyncs, where a stray KUBE-SEP-
// chain outlived the kill by 11 s), is written as a full sync and deletes
// them.
func TestKilledFullSyncIsWrittenFullAgain(t *testing.T) {
	k, s, st, ctx, stray := killedWhileDeletingAStaleChain(t)
	if err := s.apply(ctx, planOf(st, 5, true)); err == nil {
		t.Fatal("a full sync killed while deleting its stale chains returned no error")
	}
	k.BeforeRestore = nil
	stop := runStage(t, s)
	defer stop()
	s.p.In.Put(planOf(st, 6, false))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK || !r.Full {
		t.Fatalf("result = %+v; want OK, written as a full sync", r)
	}
	if _, ok := k.Tables[nf.TableNAT][stray]; ok {
		t.Errorf("the stale chain %s is still there", stray)
	}
}

// killedWhileDeletingAStaleChain is a commit stage over a fake kernel holding
// a stale chain (stray), and a context the supervisor cancels, killing commit,
// while a restore deletes that chain.
func killedWhileDeletingAStaleChain(t *testing.T) (k *fakekernel.Kernel, s *Stage, st bus.State, ctx context.Context, stray string) {
	t.Helper()
	k = fakekernel.New()
	stray = nf.PrefixEndpoint + "STRAY"
	k.Tables[nf.TableNAT][stray] = []string{"-A " + stray + " -j RETURN"}
	ctx, kill := context.WithCancel(context.Background())
	t.Cleanup(kill)
	k.BeforeRestore = func(_ int, payload string) error {
		if strings.Contains(payload, "-X "+stray) {
			kill() // the supervisor kills commit while the delete is under way
			return ctx.Err()
		}
		return nil
	}
	return k, testStage(k), rendertest.SyntheticState(3, 1), ctx, stray
}
