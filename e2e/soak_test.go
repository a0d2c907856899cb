package e2e

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// soakPlan is how long and how hard the soak runs: a short version in the
// standing suite, a long one for `go tool task soak` (KPIPE_SOAK=long).
type soakPlan struct {
	duration  time.Duration // kills go on at least this long
	kills     int           // and until at least this many stages were killed
	killPause time.Duration // between kill events
	services  int           // services whose endpoints keep changing
}

func soakPlanFromEnv() soakPlan {
	if os.Getenv("KPIPE_SOAK") == "long" {
		return soakPlan{duration: 8 * time.Minute, kills: 150, killPause: 1500 * time.Millisecond, services: 60}
	}
	return soakPlan{duration: 50 * time.Second, kills: 30, killPause: time.Second, services: 20}
}

const (
	// restartBudget is kpipe's: more restarts than this within a minute and a
	// supervisor gives up. Random kills stay below it (budgetMargin); one stage
	// is killed on purpose until its supervisor gives up.
	restartBudget = 10
	budgetMargin  = 3
	// escalating is the stage killed until its supervisor escalates.
	escalating = "commit-ipv6"
	// soakLBIP is the eTP=Local load-balancer IP the client loops over.
	soakLBIP = "203.0.113.41"
)

// TestSoak kills kpipe's stages through its supervisor — every stage, in
// random order, one or two at once, and one stage again and again until its
// supervisor spends its restart budget and its parent restarts the family —
// while clients loop over a ClusterIP (TCP and UDP, from a pod), a NodePort
// and an eTP=Local load-balancer IP (from outside the node), and while
// services and endpoints keep changing through the API. No connection may
// fail; afterwards the rules must equal a fresh kpipe's, and kpipe's
// goroutines and heap must be within 10% of what they were before. The last
// lines print the figures.
func TestSoak(t *testing.T) {
	plan := soakPlanFromEnv()
	e := setup(t)
	svc := e.echoNodePort("soak")
	lbSpec := typed(e.ns, "soak-local", corev1.ServiceTypeLoadBalancer, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	lbSpec.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	lb := e.create(lbSpec)
	if _, err := tb.SetLoadBalancerIngress(e.ctx, e.ns, lb.Name, testbed.LBIngressIP(soakLBIP, "")); err != nil {
		t.Fatal(err)
	}
	e.setEndpoints(lb, local(1, 2))
	churned := createChaosServices(t, e, plan.services)

	tr := newTraffic(t, 20*time.Millisecond, podIPs(1, 2), append(nodePortTargets(svc),
		target{"TCP eTP=Local LB IP", tcp2, tb.ClientNS, testbed.HostPort(soakLBIP, 80)})...)
	tr.start(podIPs(1, 2))
	// Warm up while the API changes: every stage killed once, in random order
	// (its first restart makes what any later one reuses: metric series,
	// caches, maps at working size). Then measure.
	k := newSoakKiller(t)
	start := time.Now()
	warm, warmed := context.WithCancel(e.ctx)
	warmup := startChurn(warm, e, churned)
	k.killEachOnce()
	warmed()
	if _, _, err := warmup.wait(); err != nil {
		t.Fatalf("warm-up changes: %v", err)
	}
	requireLikeFresh(t, "before the soak", 30*time.Second)
	before := measureResources(t, "before")

	ctx, stop := context.WithCancel(e.ctx)
	churn := startChurn(ctx, e, churned)
	escalated := make(chan error, 1)
	go func() { escalated <- k.escalate(ctx) }()
	k.killRandomly(ctx, plan, start)
	if err := <-escalated; err != nil {
		t.Errorf("escalation: %v", err)
	}
	stop()
	changes, slowest, churnErr := churn.wait()
	if churnErr != nil {
		t.Errorf("API changes: %v", churnErr)
	}
	if !waitRunning(k.stages, 30*time.Second) {
		t.Fatal("not every stage runs again 30s after the last kill")
	}
	soakTime := since(start)
	requireLikeFresh(t, "after the soak", 60*time.Second)

	tr.endPhase("soak")
	attempted, failed := tr.totals()
	tr.finish()
	after := measureResources(t, "after")

	t.Logf("soak: %v, %d kills (%d kill events, %d stages, %d escalation of %s's supervisor)",
		soakTime, k.kills, k.events, len(k.stages), k.escalations, escalating)
	t.Logf("soak: connections attempted %d, failed %d", attempted, failed)
	t.Logf("soak: longest kill → stage running again: %v (%s)", k.slowest.Round(time.Millisecond), k.slowestStage)
	t.Logf("soak: %d API changes, longest API change → kernel: %v", changes, slowest.Round(time.Millisecond))
	t.Logf("soak: goroutines %d → %d, heap %.1f → %.1f MiB", before.goroutines, after.goroutines, before.heapMiB, after.heapMiB)

	if k.kills < plan.kills {
		t.Errorf("only %d kills, want at least %d", k.kills, plan.kills)
	}
	if missed := k.notKilled(); len(missed) > 0 {
		t.Errorf("stages never killed: %v", missed)
	}
	if k.escalations == 0 {
		t.Errorf("%s's supervisor never spent its restart budget", escalating)
	}
	if !within(after.goroutines, before.goroutines, 0.10) {
		t.Errorf("goroutines %d → %d: more than 10%% apart", before.goroutines, after.goroutines)
	}
	if !within(after.heapMiB, before.heapMiB, 0.10) {
		t.Errorf("heap %.1f → %.1f MiB: more than 10%% apart", before.heapMiB, after.heapMiB)
	}
}

// resources are kpipe's goroutines and live heap (after a forced GC).
type resources struct {
	goroutines int
	heapMiB    float64
}

// measureResources reads kpipe's goroutines and its live heap: HeapAlloc right
// after a forced GC, both from the debug listener's text profiles (a /metrics
// reading would count the gzip writer serving it, about 1 MiB). The least of
// five readings each: the loops' requests come and go. With
// KPIPE_SOAK_PROFILES=dir it also saves the heap profile as dir/name.heap.pb.gz
// (go tool pprof -base).
func measureResources(t *testing.T, name string) resources {
	t.Helper()
	r := resources{goroutines: 1 << 30, heapMiB: 1 << 30}
	for range 5 {
		code, body, err := tb.HTTPGet(tb.NodeNS, testbed.DebugURL+"/debug/pprof/heap?gc=1&debug=1")
		if err != nil || code != 200 {
			t.Fatalf("heap profile: HTTP %d %v %s", code, err, body)
		}
		_, after, ok := strings.Cut(string(body), "# HeapAlloc = ")
		var heap float64
		if _, err := fmt.Sscan(after, &heap); !ok || err != nil {
			t.Fatalf("no HeapAlloc in the heap profile: %v", err)
		}
		if dir := os.Getenv("KPIPE_SOAK_PROFILES"); dir != "" {
			if _, prof, err := tb.HTTPGet(tb.NodeNS, testbed.DebugURL+"/debug/pprof/heap"); err == nil {
				_ = os.WriteFile(filepath.Join(dir, name+".heap.pb.gz"), prof, 0o644)
			}
		}
		// Goroutines from the debug listener too: a /metrics scrape leaves its
		// gzip writer (0.9 MiB) in a pool that outlives the next forced GC, and
		// the next reading would count it (seen: 2.8 → 3.6 MiB in the heap).
		code, body, err = tb.HTTPGet(tb.NodeNS, testbed.DebugURL+"/debug/pprof/goroutine?debug=1")
		var g int
		if err != nil || code != 200 {
			t.Fatalf("goroutine profile: HTTP %d %v %s", code, err, body)
		}
		if _, err := fmt.Sscanf(string(body), "goroutine profile: total %d", &g); err != nil {
			t.Fatalf("goroutine profile: %v", err)
		}
		r.goroutines, r.heapMiB = min(r.goroutines, g), min(r.heapMiB, heap/(1<<20))
		time.Sleep(200 * time.Millisecond)
	}
	return r
}

func within[N int | float64](got, want N, frac float64) bool {
	d := float64(got) - float64(want)
	return d <= frac*float64(want) && -d <= frac*float64(want)
}

// churn changes endpoints and services through the API one at a time, each
// followed into the kernel, until its context ends.
type churn struct {
	done    chan struct{}
	changes int
	slowest time.Duration
	err     error
}

// startChurn changes the services in turn: mostly a new random set of
// endpoints (IPv4), every tenth a service's session affinity switched on or
// off. Each change is waited for in the node's nat table.
func startChurn(ctx context.Context, e *env, services []*chaosService) *churn {
	c := &churn{done: make(chan struct{})}
	go func() {
		defer close(c.done)
		affinity := map[int]bool{}
		for ctx.Err() == nil {
			i := rand.IntN(len(services))
			s := services[i]
			comment := testbed.ServiceComment(e.ns, s.svc.Name, "http")
			var start time.Time
			var inKernel func(nat string) bool
			if c.changes%10 == 9 {
				affinity[i] = !affinity[i]
				on := affinity[i]
				start = time.Now()
				_, err := tb.UpdateService(ctx, e.ns, s.svc.Name, func(svc *corev1.Service) {
					svc.Spec.SessionAffinity = corev1.ServiceAffinityNone
					if on {
						svc.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
					}
				})
				if c.stopped(ctx, err) {
					return
				}
				inKernel = func(nat string) bool { return (len(rulesMatching(nat, comment, "--rcheck")) > 0) == on }
			} else {
				pods := randomPods(1, 3)
				start = time.Now()
				if c.stopped(ctx, s.setEndpoints(ctx, false, pods)) {
					return
				}
				want := make([]string, len(pods))
				for j, p := range pods {
					want[j] = fmt.Sprintf("%s:%d", podIP(p), testbed.EchoPort)
				}
				inKernel = func(nat string) bool { return slices.Equal(dnatTargets(nat, comment), want) }
			}
			if err := waitKernel(ctx, inKernel); err != nil {
				if ctx.Err() == nil {
					c.err = fmt.Errorf("change %d (%s): %w", c.changes+1, s.svc.Name, err)
				}
				return
			}
			c.changes++
			c.slowest = max(c.slowest, time.Since(start))
		}
	}()
	return c
}

// stopped records err unless the churn was stopped, and says whether to stop.
func (c *churn) stopped(ctx context.Context, err error) bool {
	if err != nil && ctx.Err() == nil {
		c.err = err
	}
	return err != nil
}

// wait waits for the churn to stop and returns its figures.
func (c *churn) wait() (int, time.Duration, error) {
	<-c.done
	return c.changes, c.slowest, c.err
}

// waitKernel polls the node's IPv4 nat table until ok accepts it (60 s at most).
func waitKernel(ctx context.Context, ok func(nat string) bool) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		nat, err := tb.Exec(tb.NodeNS, "iptables-save", "-t", "nat")
		if err == nil && ok(nat) {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return errors.New("not in the kernel after 60s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// dnatTargets are the sorted DNAT destinations of the rules with comment.
func dnatTargets(nat, comment string) []string {
	var out []string
	for _, r := range rulesMatching(nat, "\""+comment+"\"", "-j DNAT --to-destination ") {
		out = append(out, strings.Fields(r[strings.Index(r, "--to-destination ")+len("--to-destination "):])[0])
	}
	slices.Sort(out)
	return out
}

// soakKiller kills stages and keeps the figures.
type soakKiller struct {
	t            *testing.T
	stages       []string          // every stage, from /debug/stages
	parent       map[string]string // stage → its supervisor's path
	mu           sync.Mutex
	restarts     map[string][]time.Time // supervisor path → restarts it made for our kills
	killed       map[string]int
	kills        int
	events       int
	escalations  int
	slowest      time.Duration
	slowestStage string
}

func newSoakKiller(t *testing.T) *soakKiller {
	t.Helper()
	var st []stageStatus
	testbed.Eventually(t, 10*time.Second, func() (err error) { st, err = getStages(); return err })
	k := &soakKiller{t: t, parent: map[string]string{}, restarts: map[string][]time.Time{}, killed: map[string]int{}}
	for _, s := range st {
		k.stages = append(k.stages, s.Name)
		k.parent[s.Name] = path.Dir(s.Path)
	}
	return k
}

// killEachOnce kills every stage once, in random order, one at a time.
func (k *soakKiller) killEachOnce() {
	order := slices.Clone(k.stages)
	rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	for _, name := range order {
		k.killSet([]string{name})
	}
}

// killRandomly kills random stages, every fifth kill event two at once, one
// event every plan.killPause, for at least plan.duration and plan.kills kills
// in all. Until the escalation is done it spares what would spoil it, and it
// keeps every other supervisor within its budget.
func (k *soakKiller) killRandomly(ctx context.Context, plan soakPlan, start time.Time) {
	for event := 0; ctx.Err() == nil && (time.Since(start) < plan.duration || k.count() < plan.kills); event++ {
		size := 1
		if event%5 == 4 {
			size = 2
		}
		var set []string
		for tries := 0; len(set) < size && tries < 4*len(k.stages); tries++ {
			name := k.stages[rand.IntN(len(k.stages))]
			if slices.Contains(set, name) || !k.budgetLeft(name) ||
				(k.escalationsSoFar() == 0 && spareDuringEscalation(name, k.parent)) {
				continue
			}
			set = append(set, name)
		}
		if len(set) > 0 {
			k.killSet(set)
		}
		time.Sleep(plan.killPause)
	}
}

// spareDuringEscalation says whether killing name would spoil the escalation:
// a stage of the escalating family (its supervisor's budget is the
// escalation's), or one whose rest_for_one restart restarts that family, and
// with it a fresh budget (watch, coalesce).
func spareDuringEscalation(name string, parent map[string]string) bool {
	return parent[name] == parent[escalating] || name == "watch" || name == "coalesce"
}

// escalate kills the escalating stage each time it runs again until its
// supervisor has spent its budget (kpipe_supervisor_escalations_total) and
// its parent has restarted the family.
func (k *soakKiller) escalate(ctx context.Context) error {
	sup := path.Base(k.parent[escalating])
	for i := 0; ctx.Err() == nil; i++ {
		if i > 2*restartBudget {
			return fmt.Errorf("%d kills of %s and no escalation of %s", i, escalating, sup)
		}
		if !waitRunning([]string{escalating}, 20*time.Second) {
			return fmt.Errorf("%s not running again 20s after kill %d", escalating, i)
		}
		k.killSet([]string{escalating})
		n, err := scrapeSumRetrying("kpipe_supervisor_escalations_total", map[string]string{"supervisor": sup})
		if err != nil {
			return err
		}
		if n > 0 {
			k.mu.Lock()
			k.escalations = int(n)
			k.mu.Unlock()
			return nil
		}
	}
	return ctx.Err()
}

// scrapeSumRetrying is scrapeSum retried for up to 5 s: a killed health stage
// does not serve /metrics until it runs again.
func scrapeSumRetrying(name string, labels map[string]string) (float64, error) {
	var n float64
	err := testbed.Poll(5*time.Second, 50*time.Millisecond, func() (err error) {
		n, err = scrapeSum(name, labels)
		return err
	})
	return n, err
}

// killSet kills the stages at once and waits for each to run again,
// recording the slowest.
func (k *soakKiller) killSet(set []string) {
	at := time.Now()
	killed := killStagesRetrying(k.t, set)
	k.mu.Lock()
	k.events++
	for _, name := range killed {
		k.kills++
		k.killed[name]++
		p := k.parent[name]
		k.restarts[p] = append(k.restarts[p], at)
	}
	k.mu.Unlock()
	for _, name := range killed {
		took, err := runningAgainSince(name, at, 30*time.Second)
		if err != nil {
			k.t.Errorf("%s: %v", name, err)
			continue
		}
		k.mu.Lock()
		if took > k.slowest {
			k.slowest, k.slowestStage = took, name
		}
		k.mu.Unlock()
	}
}

// killStagesRetrying is killStages that retries a kill the debug endpoint
// could not take (the health stage serving it was itself just killed) and
// returns the stages killed.
func killStagesRetrying(t *testing.T, set []string) []string {
	t.Helper()
	var killed []string
	for _, name := range set {
		err := testbed.Poll(10*time.Second, 50*time.Millisecond, func() error {
			code, body, err := tb.HTTPPost(tb.NodeNS, testbed.DebugURL+"/debug/stages/"+name+"/kill")
			switch {
			case err != nil:
				return err
			case code == 200:
				killed = append(killed, name)
			case code != 409: // 409: waiting out a backoff, not running
				return fmt.Errorf("HTTP %d: %s", code, body)
			}
			return nil
		})
		if err != nil {
			t.Errorf("kill %s: %v", name, err)
		}
	}
	return killed
}

// runningAgainSince waits until stage runs in a start after at, and returns
// how long after at that start was.
func runningAgainSince(stage string, at time.Time, timeout time.Duration) (time.Duration, error) {
	var took time.Duration
	err := testbed.Poll(timeout, 10*time.Millisecond, func() error {
		st, err := getStages()
		if err != nil {
			return err
		}
		for _, s := range st {
			if s.Name == stage && s.State == "running" && s.LastStart.After(at) {
				took = s.LastStart.Sub(at)
				return nil
			}
		}
		return fmt.Errorf("%s not running again", stage)
	})
	return took, err
}

// budgetLeft says whether killing name keeps its supervisor well within its
// restart budget (restarts we caused in the last minute).
func (k *soakKiller) budgetLeft(name string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	p := k.parent[name]
	recent := slices.DeleteFunc(k.restarts[p], func(at time.Time) bool { return time.Since(at) > time.Minute })
	k.restarts[p] = recent
	return len(recent) < restartBudget-budgetMargin
}

func (k *soakKiller) count() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.kills
}

func (k *soakKiller) escalationsSoFar() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.escalations
}

// notKilled are the stages never killed.
func (k *soakKiller) notKilled() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for _, s := range k.stages {
		if k.killed[s] == 0 {
			out = append(out, s)
		}
	}
	return out
}
