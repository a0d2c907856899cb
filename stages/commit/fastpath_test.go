package commit

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render/rendertest"
	"github.com/kpipe/kpipe/stages/render/tracer"
)

// Rules of one service chain in render's shapes: A and B have KUBE-SEP-
// chains, C and D are inline DNATs (endpoints on other nodes).
const (
	svcMasq  = `-A KUBE-SVC-X -m comment --comment "ns/x:http cluster IP" -m tcp -p tcp -d 10.96.0.60/32 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ`
	svcA     = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.1.5:8080" -m statistic --mode random --probability 0.2500000000 -m tcp -p tcp -j KUBE-SEP-A`
	svcB     = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.1.6:8080" -m statistic --mode random --probability 0.3333333333 -m tcp -p tcp -j KUBE-SEP-B`
	svcC     = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.2.7:8080" -m statistic --mode random --probability 0.5000000000 -m tcp -p tcp -j DNAT --to-destination 10.244.2.7:8080`
	svcDTail = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.2.8:8080" -m tcp -p tcp -j DNAT --to-destination 10.244.2.8:8080`
	svcCTail = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.2.7:8080" -m tcp -p tcp -j DNAT --to-destination 10.244.2.7:8080`
	// Session affinity: a check per endpoint before the statistic rules.
	affA     = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.1.5:8080" -m recent --name KUBE-SEP-A --rcheck --seconds 30 --reap -m tcp -p tcp -j KUBE-SEP-A`
	affD     = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.2.8:8080" -m recent --name KUBE-SEP-D --update --seconds 30 --reap -m tcp -p tcp -j DNAT --to-destination 10.244.2.8:8080`
	affA2    = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.1.5:8080" -m statistic --mode random --probability 0.5000000000 -m tcp -p tcp -j KUBE-SEP-A`
	affDTail = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.2.8:8080" -m recent --name KUBE-SEP-D --set -m tcp -p tcp -j DNAT --to-destination 10.244.2.8:8080`
	affDOnly = `-A KUBE-SVC-X -m comment --comment "ns/x:http -> 10.244.2.8:8080" -m recent --name KUBE-SEP-D --set -m tcp -p tcp -j DNAT --to-destination 10.244.2.8:8080`
)

func rulesOf(lines ...string) string {
	if len(lines) == 0 {
		return ""
	}
	return strings.Join(lines, "\n") + "\n"
}

// TestFastCutsOfAServiceChain: the safety decision for one service chain. An
// endpoint's rules leave ahead of the walked write only when the chain keeps
// its unconditional last rule to a live endpoint.
func TestFastCutsOfAServiceChain(t *testing.T) {
	four := []string{svcMasq, svcA, svcB, svcC, svcDTail}
	for _, tc := range []struct {
		name     string
		old, now []string
		want     []int // indexes of old's rules cut; nil: no fast path
	}{
		{"a middle endpoint removed", four, []string{svcMasq, svcA, svcC, svcDTail}, []int{2}},
		{"the first endpoint removed", four, []string{svcMasq, svcB, svcC, svcDTail}, []int{1}},
		{"an inline endpoint removed", four, []string{svcMasq, svcA, svcB, svcDTail}, []int{3}},
		{"all but the tail removed", four, []string{svcMasq, svcDTail}, []int{1, 2, 3}},
		{"a middle endpoint removed, another added", four, []string{svcMasq, svcA, svcC, svcDTail, `-A KUBE-SVC-X -j KUBE-SEP-E`}, []int{2}},
		{"the tail removed", four, []string{svcMasq, svcA, svcB, svcCTail}, nil},
		{"the tail and a middle one removed", four, []string{svcMasq, svcA, svcCTail}, nil},
		{"every endpoint removed", four, []string{svcMasq}, nil},
		{"every endpoint removed, the chain empty", four, nil, nil},
		{"only added", []string{svcMasq, svcA, svcDTail}, four, nil},
		{"affinity: an endpoint with a check removed", []string{svcMasq, affA, affD, affA2, affDTail}, []string{svcMasq, affD, affDOnly}, []int{1, 3}},
		{"affinity: the tail's endpoint removed", []string{svcMasq, affA, affD, affA2, affDTail}, []string{svcMasq, affA, `-A KUBE-SVC-X -m recent --name KUBE-SEP-A --set -j KUBE-SEP-A`}, nil},
		{"a conditional last rule", []string{svcA, svcB, svcC}, []string{svcA, svcC}, nil},
		{"a rule that does not parse", []string{svcA, "-A KUBE-SVC-X -m frobnicate -j KUBE-SEP-A", svcDTail}, []string{svcDTail}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			old := bus.TablePayload{Table: "nat", Chains: []bus.Chain{{Name: "KUBE-SVC-X", Rules: rulesOf(tc.old...), Hash: hashOf(rulesOf(tc.old...))}}}
			now := bus.TablePayload{Table: "nat", Chains: []bus.Chain{{Name: "KUBE-SVC-X", Rules: rulesOf(tc.now...), Hash: hashOf(rulesOf(tc.now...))}}}
			cuts := fastCuts(old, now, true)
			var got []int
			if len(cuts) == 1 {
				got = cuts[0].rules
				if cuts[0].count != len(tc.old) {
					t.Errorf("count %d, want %d", cuts[0].count, len(tc.old))
				}
			} else if len(cuts) > 1 {
				t.Fatalf("%d cuts of one chain", len(cuts))
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("cut rules %v, want %v", got, tc.want)
			}
		})
	}
}

// TestFastCutsOfADeletedService: dispatch and top-level chains lose their
// jumps to a deleted service's chains ahead of the walked write only when
// their new rules are exactly the old ones without them and the filter table
// does not change.
func TestFastCutsOfADeletedService(t *testing.T) {
	toX := `-A KUBE-SVC-B24-AAAA -m comment --comment "ns/x:http cluster IP" -m tcp -p tcp -d 10.96.0.60/32 --dport 80 -j KUBE-SVC-X`
	toY := `-A KUBE-SVC-B24-AAAA -m comment --comment "ns/y:http cluster IP" -m tcp -p tcp -d 10.96.0.61/32 --dport 80 -j KUBE-SVC-Y`
	toZ := `-A KUBE-SVC-B24-AAAA -m comment --comment "ns/z:http cluster IP" -m tcp -p tcp -d 10.96.0.60/32 --dport 80 -j KUBE-SVC-Z`
	svc := func(name string) bus.Chain {
		return bus.Chain{Name: name, Rules: "-A " + name + " -j KUBE-SEP-A\n", Hash: 1}
	}
	bucket := func(lines ...string) bus.Chain {
		return bus.Chain{Name: "KUBE-SVC-B24-AAAA", Rules: rulesOf(lines...), Hash: hashOf(rulesOf(lines...))}
	}
	old := bus.TablePayload{Table: "nat", Chains: []bus.Chain{svc("KUBE-SVC-X"), svc("KUBE-SVC-Y"), bucket(toX, toY)}}
	for _, tc := range []struct {
		name     string
		now      bus.TablePayload
		filterAs bool
		want     []int
	}{
		{"a service deleted", bus.TablePayload{Chains: []bus.Chain{svc("KUBE-SVC-Y"), bucket(toY)}}, true, []int{0}},
		{"a service deleted while filter changes", bus.TablePayload{Chains: []bus.Chain{svc("KUBE-SVC-Y"), bucket(toY)}}, false, nil},
		{"its address taken by a new service", bus.TablePayload{Chains: []bus.Chain{svc("KUBE-SVC-Y"), svc("KUBE-SVC-Z"), bucket(toZ, toY)}}, true, nil},
		{"its chain kept", bus.TablePayload{Chains: []bus.Chain{svc("KUBE-SVC-X"), svc("KUBE-SVC-Y"), bucket(toY)}}, true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []int
			for _, c := range fastCuts(old, tc.now, tc.filterAs) {
				if c.chain.Name != "KUBE-SVC-B24-AAAA" {
					t.Fatalf("cut %s", c.chain.Name)
				}
				got = c.rules
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("cut rules %v, want %v", got, tc.want)
			}
		})
	}
}

// churnState is services with four endpoints each, two of them on this node
// (KUBE-SEP- chains) and two on another (inline DNAT).
func churnState(n int) bus.State {
	st := rendertest.SyntheticState(n, 4)
	for k, sls := range st.Slices {
		inner := map[string]*bus.EndpointSlice{}
		for name, sl := range sls {
			c := *sl
			c.Items = slices.Clone(sl.Items)
			for j := range c.Items {
				if j%2 == 0 {
					c.Items[j].NodeName = fakeConfig.NodeName
				}
			}
			inner[name] = &c
		}
		st.Slices[k] = inner
	}
	return st
}

// withoutEndpoint is st with the endpoint at index i of each named service
// gone (-1: every endpoint).
func withoutEndpoint(st bus.State, i int, services ...string) bus.State {
	out := st
	out.Slices = maps.Clone(st.Slices)
	for k, sls := range st.Slices {
		if !slices.Contains(services, k.Name) {
			continue
		}
		inner := map[string]*bus.EndpointSlice{}
		for name, sl := range sls {
			c := *sl
			if i < 0 {
				c.Items = nil
			} else {
				c.Items = slices.Delete(slices.Clone(sl.Items), i, i+1)
			}
			inner[name] = &c
		}
		out.Slices[k] = inner
	}
	return out
}

// tablesPlan is a plan holding the chains of tables (table, chain, "-A" lines).
func tablesPlan(tables map[string]map[string][]string) *bus.Plan {
	p := &bus.Plan{Family: bus.IPv4}
	for _, table := range []string{nf.TableNAT, nf.TableFilter} {
		tp := bus.TablePayload{Table: table}
		for _, c := range slices.Sorted(maps.Keys(tables[table])) {
			tp.Chains = append(tp.Chains, bus.Chain{Name: c, Rules: rulesOf(tables[table][c]...)})
		}
		p.Tables = append(p.Tables, tp)
	}
	return p
}

// requireNoNewOutcome traces a pod's first packet to every port of every
// service of before and after through the rules between (a state of the
// kernel): each path must end as one through before's or after's rules
// does (no connection meets a state neither gives it), and none may reach an
// endpoint after no longer has in a service of gone (the fast path took
// them out).
func requireNoNewOutcome(t *testing.T, between, before, after *bus.Plan, services []*bus.Service, gone map[string]bool) {
	t.Helper()
	pod := netip.MustParseAddr("10.200.0.5")
	traced := 0
	for _, svc := range services {
		for _, port := range svc.Ports {
			pkt := tracer.Packet{Source: pod, Dest: svc.ClusterIPs[0], Proto: strings.ToLower(string(port.Protocol)), DPort: int(port.Port),
				From: tracer.FromPrerouting, InInterface: "veth1"}
			outcomes := map[string]bool{}
			var newEndpoints []netip.AddrPort
			for i, p := range []*bus.Plan{before, after} {
				res := tracer.Trace(p, nil, nil, pkt)
				if res.Err != nil {
					t.Fatalf("%s %s: %v", svc.Name, port.Name, res.Err)
				}
				for _, path := range res.Paths {
					outcomes[outcome(path)] = true
				}
				if i == 1 {
					newEndpoints = res.Endpoints
				}
			}
			res := tracer.Trace(between, nil, nil, pkt)
			if res.Err != nil {
				t.Fatalf("%s %s between: %v", svc.Name, port.Name, res.Err)
			}
			for _, path := range res.Paths {
				if !outcomes[outcome(path)] {
					t.Errorf("%s %s: a path neither the old nor the new rules give: %s\n%s", svc.Name, port.Name, outcome(path), strings.Join(res.Trace(), "\n"))
				}
				if gone[svc.Name] && path.Endpoint.IsValid() && !slices.Contains(newEndpoints, path.Endpoint) {
					t.Errorf("%s %s: still sent to %s, which went away", svc.Name, port.Name, path.Endpoint)
				}
			}
			traced++
		}
	}
	if traced == 0 {
		t.Fatal("nothing traced")
	}
}

func outcome(p tracer.Path) string {
	return fmt.Sprintf("%s to %v (masqueraded %v)", p.Verdict, p.Endpoint, p.Masqueraded)
}

// servicesOf lists the services of the states.
func servicesOf(states ...bus.State) []*bus.Service {
	seen := map[bus.ServiceKey]*bus.Service{}
	for _, st := range states {
		maps.Copy(seen, st.Services)
	}
	return slices.SortedFunc(maps.Values(seen), func(a, b *bus.Service) int { return strings.Compare(a.Name, b.Name) })
}

// afterFastDelete records the kernel's tables right after its first
// delete-only transaction (nil until one).
func afterFastDelete(k *fakekernel.Kernel) (tables func() map[string]map[string][]string) {
	var got map[string]map[string][]string
	k.Observe = func(string, map[string][]string) { // k.Mu held
		if got == nil && k.Events[len(k.Events)-1] == "delete-rules" {
			got = map[string]map[string][]string{}
			for table, chains := range k.Tables {
				got[table] = maps.Clone(chains)
			}
		}
	}
	return func() map[string]map[string][]string {
		k.Mu.Lock()
		defer k.Mu.Unlock()
		return got
	}
}

// eventsSince are k's events after the first n.
func eventsSince(k *fakekernel.Kernel, n int) []string {
	k.Mu.Lock()
	defer k.Mu.Unlock()
	return slices.Clone(k.Events[n:])
}

// TestEndpointsRemovedLeaveBeforeTheWalkedWrite: a plan that removes a
// middle endpoint of some services, deletes a service, empties another and
// adds one is written as a delete-only transaction first (the endpoints and
// the deleted service), then the walked write of the rest. Between the two,
// no packet to any service meets what neither the old nor the new rules give
// it, and none reaches an endpoint that went; after both, the kernel is what
// a fresh kpipe writes.
func TestEndpointsRemovedLeaveBeforeTheWalkedWrite(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	t.Cleanup(runStage(t, s))
	base := churnState(12)
	s.p.In.Put(planOf(base, 1, true))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	between := afterFastDelete(k)
	k.Mu.Lock()
	n := len(k.Events)
	k.Mu.Unlock()

	next := with(withoutEndpoint(base, 1, "svc1", "svc2", "svc3"), []int{200}, []string{"svc4"}, "")
	s.p.In.Put(planOf(next, 2, false))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	requireFastThenWalked(t, k, n)
	// Two ports each: the rule of the endpoint gone in each service chain
	// (svc1-3), the dispatch jump of svc4 (one rule, or its bucket's).
	if got := value(t, s.metrics.FastDeletedRules.WithLabelValues("IPv4")); got < 3*2+1 {
		t.Errorf("kpipe_fast_path_deleted_rules_total %v; want at least 7", got)
	}
	// The deleted service's rules went with the endpoints: it meets what the
	// new rules give it (no DNAT) already.
	gone := map[string]bool{"svc1": true, "svc2": true, "svc3": true, "svc4": true}
	requireNoNewOutcome(t, tablesPlan(between()), planOf(base, 1, true), planOf(next, 2, true), servicesOf(base, next), gone)
	requireFresh(t, k, next, "after the walked write")

	// The last endpoint of svc5's chains and every endpoint of svc6 go: those
	// chains wait for the walked write (svc6's REJECT comes with it); svc7's
	// middle endpoint still leaves first.
	between = afterFastDelete(k)
	k.Mu.Lock()
	n = len(k.Events)
	k.Mu.Unlock()
	last := withoutEndpoint(withoutEndpoint(withoutEndpoint(next, 3, "svc5"), -1, "svc6"), 1, "svc7")
	s.p.In.Put(planOf(last, 3, false))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	requireFastThenWalked(t, k, n)
	requireNoNewOutcome(t, tablesPlan(between()), planOf(next, 2, true), planOf(last, 3, true), servicesOf(last), map[string]bool{"svc7": true})
	requireFresh(t, k, last, "after the walked write")
}

// requireFastThenWalked checks that the events after the first n are a
// delete-only transaction, then the walked write.
func requireFastThenWalked(t *testing.T, k *fakekernel.Kernel, n int) {
	t.Helper()
	if events := eventsSince(k, n); len(events) < 2 || events[0] != "delete-rules" || events[1] != "restore" {
		t.Fatalf("events %v; want delete-rules, then the walked restore", events)
	}
}

// applied applies plan as Run does, keeping it as the last plan applied.
func applied(t *testing.T, s *Stage, plan *bus.Plan) {
	t.Helper()
	if err := s.apply(context.Background(), plan); err != nil {
		t.Fatal(err)
	}
	s.last = plan
}

// afterFullSync is a fake kernel holding st as a full sync wrote it, the
// stage that wrote it, and restart: a new stage over the same ledger, as the
// supervisor restarts a killed commit.
func afterFullSync(t *testing.T, st bus.State) (k *fakekernel.Kernel, s *Stage, restart func() *Stage) {
	t.Helper()
	k, ledger := fakekernel.New(), NewLedger()
	s = testStage(k)
	s.ledger = ledger
	applied(t, s, planOf(st, 1, true))
	return k, s, func() *Stage {
		again := testStage(k)
		again.ledger = ledger
		return again
	}
}

// TestKilledBetweenTheDeleteAndTheWalkedWrite: commit is killed, or its
// walked write fails, after the delete-only transaction took the gone
// endpoints out. The chains it cut are in doubt, so whatever the next plan
// says (the endpoints back, as after a pod that was unready a moment, or
// gone) the kernel ends as a fresh kpipe writes it.
func TestKilledBetweenTheDeleteAndTheWalkedWrite(t *testing.T) {
	base := churnState(12)
	removed := withoutEndpoint(base, 1, "svc1", "svc2")
	for _, tc := range []struct {
		name  string
		stop  func(cancel context.CancelFunc) error // at the walked write's start
		again bus.State
	}{
		{"killed, the endpoints back", func(cancel context.CancelFunc) error { cancel(); return context.Canceled }, base},
		{"killed, the endpoints gone", func(cancel context.CancelFunc) error { cancel(); return context.Canceled }, removed},
		{"the walked write failed, the endpoints back", func(context.CancelFunc) error { return errors.New("injected: refused") }, base},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, first, restart := afterFullSync(t, base)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			k.BeforeRestore = func(int, string) error { return tc.stop(cancel) }
			if err := first.apply(ctx, planOf(removed, 2, false)); err == nil {
				t.Fatal("apply succeeded through a kill")
			}
			k.BeforeRestore = nil
			if !slices.Contains(k.Events, "delete-rules") {
				t.Fatal("no delete-only transaction before the kill")
			}
			applied(t, restart(), planOf(tc.again, 3, false))
			requireFresh(t, k, tc.again, "after the next plan")
		})
	}
}

// TestRefusedDeleteLeavesItToTheWalkedWrite: the kernel refuses the
// delete-only transaction (a rule it names is gone: another writer changed
// the chain since the listing); the walked write does it all.
func TestRefusedDeleteLeavesItToTheWalkedWrite(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	base := churnState(12)
	applied(t, s, planOf(base, 1, true))
	refused := 0
	k.BeforeCommit = func(string) error {
		if k.Events[len(k.Events)-1] == "delete-rules" {
			refused++
			return errors.New("injected: no such rule")
		}
		return nil
	}
	next := withoutEndpoint(base, 1, "svc1")
	applied(t, s, planOf(next, 2, false))
	if refused != 1 {
		t.Fatalf("%d delete-only transactions refused; want 1", refused)
	}
	requireFresh(t, k, next, "after the walked write")
}

// TestChainChangedByAnotherWriterIsNotCut: a service chain the kernel does not
// hold as kpipe wrote it (another writer appended a rule) is not cut by
// handle: its listing is not what the rules' positions were worked out from.
// The walked write rewrites it.
func TestChainChangedByAnotherWriterIsNotCut(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	base := churnState(12)
	applied(t, s, planOf(base, 1, true))
	k.Mu.Lock()
	for c := range k.Tables[nf.TableNAT] {
		if nf.KindOf(c) == nf.KindService {
			k.Tables[nf.TableNAT][c] = append([]string{"-A " + c + " -j ACCEPT"}, k.Tables[nf.TableNAT][c]...)
		}
	}
	n := len(k.Events)
	k.Mu.Unlock()
	next := withoutEndpoint(base, 1, "svc1", "svc2")
	applied(t, s, planOf(next, 2, false))
	if events := eventsSince(k, n); slices.Contains(events, "delete-rules") {
		t.Fatalf("events %v: chains another writer changed were cut", events)
	}
}

// TestNoFastPathWithoutRuleHandles: a kernel that cannot delete by handle (the
// iptables-restore writer, the legacy backend) keeps the one walked write.
func TestNoFastPathWithoutRuleHandles(t *testing.T) {
	k := fakekernel.New()
	s := testStage(struct{ Kernel }{k})
	base := churnState(12)
	applied(t, s, planOf(base, 1, true))
	n := len(k.Events)
	next := withoutEndpoint(base, 1, "svc1")
	applied(t, s, planOf(next, 2, false))
	if events := eventsSince(k, n); !slices.Equal(events, []string{"restore"}) {
		t.Fatalf("events %v; want one restore", events)
	}
	requireFresh(t, k, next, "after the write")
}

// TestOwnFastDeletesAreNotRepaired: canary names every chain the fast path
// cut (it hears kpipe's deletes as anyone's); commit finds them as the last
// plan wrote them and writes nothing.
func TestOwnFastDeletesAreNotRepaired(t *testing.T) {
	k := fakekernel.New()
	base := churnState(12)
	s, repairs := runWithRepairs(t, k, base)
	next := withoutEndpoint(base, 1, "svc1", "svc2")
	s.p.In.Put(planOf(next, 2, false))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	k.Mu.Lock()
	if !slices.Contains(k.Events, "delete-rules") {
		k.Mu.Unlock()
		t.Fatal("no delete-only transaction")
	}
	named := map[string]bool{}
	for c := range k.Tables[nf.TableNAT] {
		if nf.KindOf(c) == nf.KindService {
			named[c] = true
		}
	}
	k.Payloads, k.Events = nil, nil
	k.Mu.Unlock()
	repairs.Put(bus.Repair{Chains: map[string]map[string]bool{nf.TableNAT: named}, Jumps: map[string]bool{nf.TableNAT: true}, Since: time.Now()})
	waitFor(t, k, "the repair's jump check", func() bool { return slices.Contains(k.Events, "jumps nat") })
	k.Mu.Lock()
	defer k.Mu.Unlock()
	if wrote := regexpDeclared(strings.Join(k.Payloads, "")); len(wrote) > 0 {
		t.Fatalf("the repair of kpipe's own fast deletes rewrote %v", wrote)
	}
}

// TestKilledBeforeTheWalkedWriteReachesTheCutChains: a large plan's walked
// write goes in steps, the filter guards first (services that lost every
// endpoint are REJECTed before their DNAT goes). Commit is killed in that
// first step, before any step that rewrites the chains the delete-only
// transaction cut; the endpoints come back. The cut chains must be rewritten
// all the same: the ledger held them in doubt from the delete on.
func TestKilledBeforeTheWalkedWriteReachesTheCutChains(t *testing.T) {
	base := churnState(1500)
	var emptied []string
	for i := 100; i < 900; i++ {
		emptied = append(emptied, fmt.Sprintf("svc%d", i))
	}
	removed := withoutEndpoint(withoutEndpoint(base, 1, "svc1", "svc2"), -1, emptied...)
	k, first, restart := afterFullSync(t, base)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	restores := 0
	k.BeforeRestore = func(_ int, payload string) error {
		if restores++; restores == 1 && strings.HasPrefix(payload, "*filter") && !strings.Contains(payload, "*nat") {
			cancel() // killed in the guards' step
			return context.Canceled
		}
		return errors.New("injected: not the guards' step first")
	}
	if err := first.apply(ctx, planOf(removed, 2, false)); !errors.Is(err, context.Canceled) {
		t.Fatalf("apply: %v; want it killed in the guards' step", err)
	}
	k.BeforeRestore = nil
	if !slices.Contains(k.Events, "delete-rules") {
		t.Fatal("no delete-only transaction before the kill")
	}
	applied(t, restart(), planOf(base, 3, false))
	requireFresh(t, k, base, "after the endpoints came back")
}
