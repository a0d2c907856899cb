package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// outageDuration is how long TestAPIServerOutage keeps the apiserver down: the
// issue's 60 s, or $KPIPE_E2E_OUTAGE (a Go duration) to try other figures.
func outageDuration(t *testing.T) time.Duration {
	v := os.Getenv("KPIPE_E2E_OUTAGE")
	if v == "" {
		return 60 * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("KPIPE_E2E_OUTAGE=%q: %v", v, err)
	}
	return d
}

// controlPlaneBackAtEnd makes sure etcd and the apiserver run again when the
// test ends, whatever became of it, so the tests after it have an apiserver.
func controlPlaneBackAtEnd(t *testing.T) {
	t.Cleanup(func() {
		if tb.EtcdRunning() && tb.APIServerRunning() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if !tb.EtcdRunning() {
			if err := tb.StartEtcd(); err != nil {
				t.Errorf("start etcd again: %v", err)
			}
		}
		if !tb.APIServerRunning() {
			if err := tb.StartAPIServer(ctx); err != nil {
				t.Errorf("start kube-apiserver again: %v", err)
			}
		}
	})
}

// healthWatch polls kpipe's /healthz until stopped and records every answer
// that was not 200.
type healthWatch struct {
	stop, done chan struct{}
	mu         sync.Mutex
	polls      int
	bad        []badHealth
}

// badHealth is a /healthz answer that was not 200.
type badHealth struct {
	at   time.Time
	what string
}

func (b badHealth) String() string { return b.at.Format("15:04:05.000") + ": " + b.what }

func joinBad(bad []badHealth) string {
	s := make([]string, len(bad))
	for i, b := range bad {
		s[i] = b.String()
	}
	return strings.Join(s, "\n")
}

func watchHealth(interval time.Duration) *healthWatch { return watchHealthPath("/healthz", interval) }

// watchHealthPath polls path on kpipe's healthz listener every interval.
func watchHealthPath(path string, interval time.Duration) *healthWatch {
	h := &healthWatch{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(h.done)
		for {
			code, body, err := tb.HTTPGet(tb.NodeNS, testbed.HealthzURL+path)
			h.mu.Lock()
			h.polls++
			if err != nil || code != 200 {
				h.bad = append(h.bad, badHealth{time.Now(), fmt.Sprintf("HTTP %d %v %s", code, err, strings.TrimSpace(string(body)))})
			}
			h.mu.Unlock()
			select {
			case <-h.stop:
				return
			case <-time.After(interval):
			}
		}
	}()
	return h
}

// finish stops the polls and returns how many there were and the bad ones.
func (h *healthWatch) finish() (int, []badHealth) {
	close(h.stop)
	<-h.done
	return h.polls, h.bad
}

// ruleStageRestarts is each stage's restart count: no stage but watch (to
// reconnect) may restart because the apiserver went away (requireNoRestarts).
func ruleStageRestarts(t *testing.T) map[string]int {
	t.Helper()
	st, err := getStages()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, s := range st {
		out[s.Name] = s.Restarts
	}
	return out
}

// requireNoRestarts fails unless no stage but watch restarted since before.
func requireNoRestarts(t *testing.T, before map[string]int) {
	t.Helper()
	after := ruleStageRestarts(t)
	var restarted []string
	for name, n := range after {
		if n != before[name] && name != "watch" {
			restarted = append(restarted, fmt.Sprintf("%s %d→%d", name, before[name], n))
		}
	}
	if len(restarted) > 0 {
		t.Errorf("stages restarted: %v", restarted)
	}
	t.Logf("stage restarts: watch %d→%d, no other stage restarted", before["watch"], after["watch"])
}

// changedRules counts the rules of the chains that differ between two dumps
// (the chains' rules in after): what writing the change needs.
func changedRules(before, after testbed.RuleDump) (chains, rules int) {
	for k, r := range after.Chains {
		old, ok := before.Chains[k]
		if !ok || strings.Join(old, "\n") != strings.Join(r, "\n") {
			chains++
			rules += len(r)
		}
	}
	for k := range before.Chains {
		if _, ok := after.Chains[k]; !ok {
			chains++
		}
	}
	return chains, rules
}

// TestAPIServerOutage: the apiserver goes away for a minute (the issue's
// figure) and comes back. While it is away the rules stay exactly as they were
// (not one kernel write), connections to a ClusterIP (TCP and UDP) and a
// NodePort keep being answered and /healthz stays 200 (nothing is pending). When it comes back,
// kpipe's watches (closed by the server) are re-established in the same
// process, the relist costs no rewrite (the kernel sees only the writes that
// the change made right after the return needs, and no full sync), and that
// change is programmed.
func TestAPIServerOutage(t *testing.T) {
	e := setup(t)
	controlPlaneBackAtEnd(t)
	svc := e.echoNodePort("echo")
	tr := newTraffic(t, 20*time.Millisecond, podIPs(1, 2, 3), nodePortTargets(svc)...)
	tr.start(podIPs(1, 2))

	pid := e.k.PID()
	restarts := ruleStageRestarts(t)
	fullSyncs := fullSyncCount(t)
	before, err := tb.NodeRules()
	if err != nil {
		t.Fatal(err)
	}
	mon, err := tb.MonitorRuleset()
	if err != nil {
		t.Fatal(err)
	}
	defer mon.Stop()
	health := watchHealth(250 * time.Millisecond)

	outage := outageDuration(t)
	start := time.Now()
	if err := tb.StopAPIServer(); err != nil {
		t.Fatalf("stop kube-apiserver: %v", err)
	}
	t.Logf("kube-apiserver stopped in %v; keeping it down for %v", since(start), outage)
	time.Sleep(outage - time.Since(start))
	tr.keepsAnswering("end of the outage")
	tr.endPhase("apiserver down")
	during, err := tb.NodeRules()
	if err != nil {
		t.Fatal(err)
	}
	if d := testbed.Diff(before, during, "before the outage", "after it"); d != "" {
		t.Errorf("kpipe's rules changed while the apiserver was down:\n%s", d)
	}
	if w := mon.Writes(); w.Transactions != 0 {
		t.Errorf("kernel writes while the apiserver was down: %v:\n%s", w, strings.Join(w.TransactionLines, "\n"))
	}
	polls, bad := health.finish()
	t.Logf("/healthz during the %v outage: %d polls, %d not 200", outage, polls, len(bad))
	if len(bad) > 0 {
		t.Errorf("/healthz not 200 while the apiserver was down and nothing was pending:\n%s", joinBad(bad))
	}

	// Back, and a change made at once.
	mon.Reset()
	start = time.Now()
	if err := tb.StartAPIServer(e.ctx); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	t.Logf("kube-apiserver ready again %v after start", since(start))
	health = watchHealth(250 * time.Millisecond)
	testbed.Eventually(t, 30*time.Second, func() error {
		_, err := tb.SetEndpoints(e.ctx, svc, tb.ReadyEndpoints(1, 2, 3))
		return err
	})
	tr.expectEndpoints("after the change made on the return", 1, 2, 3)
	t.Logf("change made on the apiserver's return programmed (every target answered by it) %v after it was ready", since(back))
	// Let a periodic sync or two pass: a late relist or a full sync would show.
	time.Sleep(12 * time.Second)

	after, err := tb.NodeRules()
	if err != nil {
		t.Fatal(err)
	}
	chains, need := changedRules(before, after)
	w := mon.Writes()
	t.Logf("kernel writes from the return on: %v; the change needs %d chains, %d rules", w, chains, need)
	if w.RulesAdded > need {
		t.Errorf("the return cost %d rules written, more than the %d of the %d chains the change needs (a rewrite storm):\n%s",
			w.RulesAdded, need, chains, strings.Join(w.TransactionLines, "\n"))
	}
	if n := fullSyncCount(t); n != fullSyncs {
		t.Errorf("full syncs went from %v to %v across the outage", fullSyncs, n)
	}
	polls, bad = health.finish()
	t.Logf("/healthz after the return: %d polls, %d not 200", polls, len(bad))
	if len(bad) > 0 {
		t.Errorf("/healthz not 200 after the return:\n%s", joinBad(bad))
	}
	tr.endPhase("apiserver back")
	tr.finish()
	if got := e.k.PID(); got != pid || !e.k.Running() {
		t.Errorf("kpipe pid %d before the outage, %d after (running: %v)", pid, got, e.k.Running())
	}
	requireNoRestarts(t, restarts)
}

// TestEtcdRestoredFromSnapshot: etcd's data is wiped and restored from a
// snapshot taken earlier, so the API goes back in time (objects created since
// vanish, changed ones revert, resourceVersions go back). kpipe, in the same
// process, follows: its rules come to equal a fresh kpipe's for the restored
// state, and a change made after the restore is programmed.
func TestEtcdRestoredFromSnapshot(t *testing.T) {
	e := setup(t)
	controlPlaneBackAtEnd(t)
	port := testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort)
	kept := e.service("kept", port)
	e.endpoints(kept, 1, 2)
	keptAddr := testbed.ClusterAddr(kept, 80)
	pod := tb.Pod(clientPod).NS
	expectExactly(t, "kept before the snapshot", tcp(2*time.Second), pod, keptAddr, podIPs(1, 2))
	pid := e.k.PID()
	restarts := ruleStageRestarts(t)

	snapshot := restartControlPlane(t, e.ctx, "")

	// Changes after the snapshot: kpipe programs them.
	e.endpoints(kept, 1, 2, 4)
	later := e.service("later", port)
	e.endpoints(later, 3)
	laterAddr := testbed.ClusterAddr(later, 80)
	expectExactly(t, "kept after the snapshot", tcp(2*time.Second), pod, keptAddr, podIPs(1, 2, 4))
	expectExactly(t, "later (created after the snapshot)", tcp(2*time.Second), pod, laterAddr, podIPs(3))

	l := startLoop(tcp(2*time.Second), pod, keptAddr, 20*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	restartControlPlane(t, e.ctx, snapshot)
	start := time.Now()
	// The API went back: later does not exist, kept has its old endpoints.
	if _, err := tb.Client().CoreV1().Services(e.ns).Get(e.ctx, "later", metav1.GetOptions{}); err == nil {
		t.Fatalf("service later still exists after etcd was restored from a snapshot taken before it")
	}
	expectExactly(t, "kept after the restore", tcp(2*time.Second), pod, keptAddr, podIPs(1, 2))
	eventuallyUnanswered(t, "later after the restore (gone from the API)", tcp(time.Second), pod, laterAddr)
	t.Logf("kpipe followed the restored state within %v", since(start))
	requireLikeFresh(t, "after the restore", 30*time.Second)

	// A change after the restore is programmed.
	e.endpoints(kept, 1, 2, 5)
	expectExactly(t, "kept changed after the restore", tcp(2*time.Second), pod, keptAddr, podIPs(1, 2, 5))
	l.finishWithNoFailure(t, "connections to kept across the restore")
	l = nil
	if got := e.k.PID(); got != pid || !e.k.Running() {
		t.Errorf("kpipe pid %d before, %d after (running: %v)", pid, got, e.k.Running())
	}
	requireNoRestarts(t, restarts)
}

// restartControlPlane stops the apiserver and etcd and starts them again.
// With restoreFrom "" it takes a snapshot of etcd's data while etcd is down and
// returns its path; otherwise it wipes etcd's data and restores restoreFrom.
func restartControlPlane(t *testing.T, ctx context.Context, restoreFrom string) (snapshot string) {
	t.Helper()
	start := time.Now()
	if err := tb.StopAPIServer(); err != nil {
		t.Fatalf("stop kube-apiserver: %v", err)
	}
	if err := tb.StopEtcd(); err != nil {
		t.Fatalf("stop etcd: %v", err)
	}
	var err error
	if restoreFrom == "" {
		snapshot, err = tb.SnapshotEtcd(fmt.Sprint(time.Now().UnixNano()))
	} else {
		err = tb.RestoreEtcd(restoreFrom)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := tb.StartEtcd(); err != nil {
		t.Fatal(err)
	}
	if err := tb.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	if restoreFrom == "" {
		t.Logf("control plane restarted with a snapshot of etcd's data taken (%s) in %v", snapshot, since(start))
	} else {
		t.Logf("control plane restarted with etcd's data wiped and restored from %s in %v", restoreFrom, since(start))
	}
	return snapshot
}
