package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// The stage-kill scenario under load (TestKillStagesDuringChurnAndFullSyncs).
const (
	// chaosServices dual-stack services make a full sync take noticeable time.
	chaosServices = 600
	// chaosBurst endpoint changes are made while stages are killed.
	chaosBurst = 2000
	// chaosKills kill events in all: half during the burst, half during
	// full syncs.
	chaosKills = 30
	// apiWorkers bounds the concurrent API calls.
	apiWorkers = 12
	// chaosEndpointPods are the pods the churned services take endpoints
	// from; pods 1 and 2 serve the looped service only.
	chaosFirstPod, chaosLastPod = 3, endpointPods
)

// killSets are what one kill event kills: each stage of a family alone, or
// all three at once.
var killSets = [][]string{
	{"render-ipv4"}, {"commit-ipv6"}, {"conntrack-ipv4"}, {"render-ipv6", "commit-ipv6", "conntrack-ipv6"},
	{"render-ipv6"}, {"commit-ipv4"}, {"conntrack-ipv6"}, {"render-ipv4", "commit-ipv4", "conntrack-ipv4"},
}

// TestKillStagesDuringChurnAndFullSyncs kills render, commit and conntrack,
// one at a time and together, at random moments while a burst of endpoint
// changes is being programmed and while full syncs are in flight:
//
//  1. 15 kills at random points of a burst of 2,000 EndpointSlice changes
//     across 600 dual-stack services; then the node's rules must come to equal
//     what a fresh kpipe writes for the final API state (testbed.FreshRules).
//  2. 15 rounds of: break the rules as only a full sync repairs (a rule
//     deleted from a KUBE-SVC- chain, a stray chain with a name kpipe owns),
//     force a full sync (flush the canary), kill at a random moment while it
//     runs; the damage must be repaired within 10 s. Then the rules must equal
//     a fresh kpipe's again.
//
// Throughout, a client looping connections to a service whose endpoints never
// change must not lose one. The pace (about 40 stage kills in two minutes)
// exceeds kpipe's restart budget of a family (10 a minute), so a family's
// supervisor may give up and be restarted, stages and all, by its parent: one
// more way of killing them together.
func TestKillStagesDuringChurnAndFullSyncs(t *testing.T) {
	testStart := time.Now()
	e := setup(t)
	// Every rule here is this test's: the diffs are the evidence, not a dump
	// of the whole table.
	e.dumped = true
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kpipe log tail (%s):\n%s", e.k.LogPath, e.k.LogTail(40))
		}
	})
	looped := e.service("looped", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(looped, 1, 2)
	addr := testbed.ClusterAddr(looped, 80)
	client := tb.Pod(clientPod).NS
	waitAnswer(t, tcp2, client, addr, 20*time.Second)

	start := time.Now()
	bulk := createChaosServices(t, e, chaosServices)
	t.Logf("%d dual-stack services with endpoints created in %v", len(bulk), since(start))
	requireLikeFresh(t, "after creating the services", 60*time.Second)
	fullSync := measureFullSync(t)
	t.Logf("a full sync (kpipe noticing flushed canaries to both families' full commits) takes %v", fullSync.Round(time.Millisecond))

	l := startLoop(tcp2, client, addr, 10*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	k := &killer{t: t}

	// 1. Kills at random points of a burst of endpoint changes.
	start = time.Now()
	changes, killsInBurst := burstWithKills(t, e, bulk, k, chaosKills/2)
	t.Logf("burst: %d endpoint changes in %v, %d kill events (%d while changes were still being made)",
		changes, since(start), chaosKills/2, killsInBurst)
	took, diff := convergeToFresh(t, k.last, 30*time.Second)
	if diff != "" {
		t.Errorf("after the burst: node's rules differ from what a fresh kpipe writes for the same API state:\n%s", diff)
	} else {
		t.Logf("after the burst: node's rules equal a fresh kpipe's %v after the last kill", took.Round(time.Millisecond))
	}

	// 2. Kills at random moments of full syncs that have damage to repair.
	start = time.Now()
	inFlight, unrepaired := fullSyncsWithKills(t, k, fullSync, chaosKills-chaosKills/2)
	t.Logf("full syncs: %d kill events in %v, %d of them before the full syncs they hit had committed",
		chaosKills-chaosKills/2, since(start), inFlight)
	if len(unrepaired) > 0 {
		t.Errorf("%d of %d full syncs did not repair what they had to:\n%s", len(unrepaired), chaosKills-chaosKills/2, strings.Join(unrepaired, "\n"))
	}
	took, diff = convergeToFresh(t, k.last, 30*time.Second)

	ok, failures, _ := l.finish()
	l = nil
	t.Logf("kill events %d, stage kills done %d; client connections to the looped service: %d attempted, %d failed; whole test %v",
		k.events, k.kills, ok+len(failures), len(failures), since(testStart))
	if st, err := getStages(); err == nil {
		var restarts []string
		for _, s := range st {
			restarts = append(restarts, fmt.Sprintf("%s=%d", s.Name, s.Restarts))
		}
		t.Logf("stage restarts: %s", strings.Join(restarts, " "))
	}
	if diff != "" {
		t.Errorf("after the full syncs: node's rules differ from what a fresh kpipe writes for the same API state:\n%s", diff)
	} else {
		t.Logf("after the full syncs: node's rules equal a fresh kpipe's %v after the last kill", took.Round(time.Millisecond))
	}
	if len(failures) > 0 {
		t.Errorf("%d of %d connections to the looped service failed:\n%s", len(failures), ok+len(failures), strings.Join(failures, "\n"))
	}
}

// chaosService is one of the churned services.
type chaosService struct{ svc *corev1.Service }

// createChaosServices creates n dual-stack ClusterIP services, each with an
// IPv4 and an IPv6 EndpointSlice of two pods, with a bounded worker pool. The
// services are deleted (concurrently) when the test ends.
func createChaosServices(t *testing.T, e *env, n int) []*chaosService {
	t.Helper()
	out := make([]*chaosService, n)
	err := parallel(n, func(i int) error {
		svc := dualStack(testbed.Service(e.ns, fmt.Sprintf("bulk-%04d", i), testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort)))
		svc, err := tb.CreateService(e.ctx, svc)
		if err != nil {
			return err
		}
		out[i] = &chaosService{svc: svc}
		for _, v6 := range []bool{false, true} {
			if err := out[i].setEndpoints(e.ctx, v6, randomPods(2, 2)); err != nil {
				return err
			}
		}
		return nil
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		_ = parallel(n, func(i int) error {
			if out[i] != nil {
				_ = tb.DeleteService(ctx, e.ns, out[i].svc.Name)
			}
			return nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// setEndpoints replaces one family's slice of the service with the pods.
func (c *chaosService) setEndpoints(ctx context.Context, v6 bool, pods []int) error {
	eps, family := tb.ReadyEndpoints(pods...), discoveryv1.AddressTypeIPv4
	if v6 {
		eps, family = tb.ReadyEndpoints6(pods...), discoveryv1.AddressTypeIPv6
	}
	slice := testbed.EndpointSlice(c.svc, c.svc.Name+"-"+strings.ToLower(string(family)), eps)
	slice.AddressType = family // EndpointSlice takes IPv4 when there are no endpoints
	_, err := tb.ApplyEndpointSlice(ctx, slice)
	return err
}

// randomPods picks between lo and hi distinct pods of the churned range.
func randomPods(lo, hi int) []int {
	all := make([]int, 0, chaosLastPod-chaosFirstPod+1)
	for p := chaosFirstPod; p <= chaosLastPod; p++ {
		all = append(all, p)
	}
	rand.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	pods := all[:lo+rand.IntN(hi-lo+1)]
	slices.Sort(pods)
	return pods
}

// parallel runs fn(0..n-1) on apiWorkers goroutines and returns the first error.
func parallel(n int, fn func(i int) error) error {
	var next atomic.Int64
	var first error
	var once sync.Once
	var wg sync.WaitGroup
	for w := 0; w < apiWorkers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					once.Do(func() { first = err })
					next.Store(int64(n)) // stop handing out work
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// killer kills stages and counts what it did.
type killer struct {
	t      *testing.T
	n      int // kill events so far: picks the next kill set
	events int
	kills  int
	last   time.Time
}

// kill kills the next kill set, once its stages run (a stage still waiting
// out the backoff of an earlier kill cannot be killed).
func (k *killer) kill() []string {
	set := killSets[k.n%len(killSets)]
	k.n++
	waitRunning(set, 5*time.Second)
	k.kills += killStages(k.t, set)
	k.events++
	k.last = time.Now()
	return set
}

// burstWithKills makes chaosBurst endpoint changes across the services as
// fast as the API takes them (apiWorkers at a time): each a random service's
// IPv4 or IPv6 slice set to 0-3 random pods, so that KUBE-SVC- and KUBE-SEP-
// chains come and go. Meanwhile it makes kills kill events, each when the
// burst reaches a random point. It returns the number of changes and how many
// kills came while changes were still being made.
func burstWithKills(t *testing.T, e *env, bulk []*chaosService, k *killer, kills int) (int, int) {
	t.Helper()
	points := make([]int, kills)
	for i := range points {
		points[i] = rand.IntN(chaosBurst)
	}
	slices.Sort(points)
	var done atomic.Int64
	burstOver := make(chan error, 1)
	go func() {
		burstOver <- parallel(chaosBurst, func(int) error {
			c := bulk[rand.IntN(len(bulk))]
			err := c.setEndpoints(e.ctx, rand.IntN(2) == 1, randomPods(0, 3))
			done.Add(1)
			return err
		})
	}()
	during := 0
	var burstErr error
	over := false
	for _, p := range points {
		for !over && int(done.Load()) < p {
			select {
			case burstErr = <-burstOver:
				over = true
			case <-time.After(5 * time.Millisecond):
			}
		}
		if !over {
			during++
		}
		k.kill()
	}
	if !over {
		burstErr = <-burstOver
	}
	if burstErr != nil {
		t.Fatalf("burst of endpoint changes: %v", burstErr)
	}
	return int(done.Load()), during
}

// fullSyncCount is how many full syncs kpipe has committed (all families).
func fullSyncCount(t *testing.T) float64 {
	return metricSum(t, "kubeproxy_sync_full_proxy_rules_duration_seconds_count", nil)
}

// flushCanaries flushes both families' nat canary chain: kpipe takes it for a
// flushed table and makes a full sync.
func flushCanaries(t *testing.T) {
	t.Helper()
	for _, cmd := range []string{"iptables", "ip6tables"} {
		if _, err := tb.Exec(tb.NodeNS, cmd, "-w", "-t", "nat", "-F", "KUBE-PROXY-CANARY"); err != nil {
			t.Fatal(err)
		}
	}
}

// canaryBack says whether both families' nat canary chain holds its rule
// again: kpipe's canary stage restores it just before it asks for a full sync.
func canaryBack() bool {
	for _, cmd := range []string{"iptables", "ip6tables"} {
		out, err := tb.Exec(tb.NodeNS, cmd, "-w", "-t", "nat", "-S", "KUBE-PROXY-CANARY")
		if err != nil || !strings.Contains(out, "-A KUBE-PROXY-CANARY") {
			return false
		}
	}
	return true
}

// startFullSync flushes the canaries and returns once kpipe has noticed (the
// full syncs of both families are then under way) and the full sync count
// before it.
func startFullSync(t *testing.T) float64 {
	t.Helper()
	before := fullSyncCount(t)
	flushCanaries(t)
	testbed.EventuallyEvery(t, 10*time.Second, 5*time.Millisecond, func() error {
		if !canaryBack() {
			return fmt.Errorf("kpipe has not restored its canaries")
		}
		return nil
	})
	return before
}

// measureFullSync forces a full sync and returns how long it took from kpipe
// noticing the flushed canaries to both families' full commits.
func measureFullSync(t *testing.T) time.Duration {
	t.Helper()
	before := startFullSync(t)
	start := time.Now()
	testbed.EventuallyEvery(t, 30*time.Second, 10*time.Millisecond, func() error {
		if n := fullSyncCount(t); n < before+2 {
			return fmt.Errorf("%v full syncs committed since kpipe noticed the flushed canaries, want 2", n-before)
		}
		return nil
	})
	return time.Since(start)
}

// damage is what one round of the full-sync phase broke in the node's rules.
type damage struct {
	// chains are the damaged chains' keys (see testbed.RuleDump) and their
	// rules before: what a full sync must restore.
	chains map[string][]string
	// strays are the keys of chains with names kpipe owns that were added by
	// hand: a full sync must delete them.
	strays []string
}

// breakRules damages the node's rules the way only a full sync repairs: in
// each family it deletes the last rule of a random KUBE-SVC- chain of the
// churned services and adds an empty chain with a name kpipe owns.
func breakRules(t *testing.T, round int) damage {
	t.Helper()
	got, err := tb.NodeRules()
	if err != nil {
		t.Fatal(err)
	}
	d := damage{chains: map[string][]string{}}
	for _, f := range []struct{ family, cmd string }{{"ipv4", "iptables"}, {"ipv6", "ip6tables"}} {
		var svcChains []string
		for key, rules := range got.Chains {
			chain, isNat := strings.CutPrefix(key, f.family+" nat ")
			if isNat && serviceChain.MatchString(chain) && len(rules) > 0 && strings.Contains(rules[0], "/bulk-") {
				svcChains = append(svcChains, key)
			}
		}
		if len(svcChains) == 0 {
			t.Fatalf("no %s KUBE-SVC- chain of the churned services to damage", f.family)
		}
		key := svcChains[rand.IntN(len(svcChains))]
		chain := strings.Fields(key)[2]
		n := strconv.Itoa(len(got.Chains[key]))
		stray := fmt.Sprintf("KUBE-SEP-KPE2ESTRAY%03d", round)
		for _, args := range [][]string{{"-D", chain, n}, {"-N", stray}} {
			if _, err := tb.Exec(tb.NodeNS, append([]string{f.cmd, "-w", "-t", "nat"}, args...)...); err != nil {
				t.Fatal(err)
			}
		}
		d.chains[key] = got.Chains[key]
		d.strays = append(d.strays, f.family+" nat "+stray)
	}
	return d
}

// repaired says whether the node's rules no longer show the damage.
func (d damage) repaired() error {
	got, err := tb.NodeRules()
	if err != nil {
		return err
	}
	var problems []string
	for key, want := range d.chains {
		if !slices.Equal(got.Chains[key], want) {
			problems = append(problems, fmt.Sprintf("chain %s has %d rules, want %d:\n%s", key, len(got.Chains[key]), len(want),
				strings.TrimSpace(testbed.Diff(testbed.RuleDump{Chains: map[string][]string{key: want}}, testbed.RuleDump{Chains: map[string][]string{key: got.Chains[key]}}, "before", "now"))))
		}
	}
	for _, key := range d.strays {
		if _, ok := got.Chains[key]; ok {
			problems = append(problems, "chain "+key+" added by hand is still there")
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("%s", strings.Join(problems, "\n"))
	}
	return nil
}

// fullSyncsWithKills makes kills rounds of: damage the rules, force a full
// sync, kill at a random moment within the time a full sync takes, and give
// kpipe repairTime to repair the damage. It returns how many kills came before
// the round's full syncs had committed, and a description of each round whose
// damage was not repaired.
func fullSyncsWithKills(t *testing.T, k *killer, fullSync time.Duration, kills int) (int, []string) {
	t.Helper()
	const repairTime = 10 * time.Second
	inFlight := 0
	var unrepaired []string
	for i := 0; i < kills; i++ {
		d := breakRules(t, i)
		before := startFullSync(t)
		time.Sleep(time.Duration(rand.Int64N(int64(fullSync))))
		hit := fullSyncCount(t) < before+2
		if hit {
			inFlight++
		}
		set := k.kill()
		if err := testbed.Poll(repairTime, 50*time.Millisecond, d.repaired); err != nil {
			unrepaired = append(unrepaired, fmt.Sprintf("round %d (killed %v %s): not repaired %v after the kill: %v",
				i+1, set, map[bool]string{true: "before the full syncs had committed", false: "after the full syncs had committed"}[hit], repairTime, err))
		}
	}
	return inFlight, unrepaired
}
