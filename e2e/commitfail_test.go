package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// healthTimeout is kpipe's /healthz timeout with the test bed's flags: twice
// --iptables-sync-period (5 s), as kube-proxy's.
const healthTimeout = 10 * time.Second

// serviceChainOf is the KUBE-SVC- chain the node's nat table sends svc's
// ClusterIP:port to, told from kpipe's dispatch chains by serviceChain (one
// service chain in 32 also starts "KUBE-SVC-B": its hash begins with B).
func serviceChainOf(t *testing.T, e *env, svc *corev1.Service) string {
	t.Helper()
	ip := svc.Spec.ClusterIP + "/32"
	var chain string
	testbed.Eventually(t, 15*time.Second, func() error {
		for _, r := range rulesMatching(e.iptablesSave("nat"), "-d "+ip, "-j KUBE-SVC-") {
			f := strings.Fields(r)
			if c := f[len(f)-1]; serviceChain.MatchString(c) {
				chain = c
				return nil
			}
		}
		return fmt.Errorf("no rule sends %s to a KUBE-SVC- chain", ip)
	})
	return chain
}

// syncFailedWarning finds kpipe's SyncProxyRulesFailed Warning on the Node,
// recorded after since.
func (e *env) syncFailedWarning(since time.Time) (string, error) {
	evs, err := e.nodeEventsSince("SyncProxyRulesFailed", since)
	if err != nil {
		return "", err
	}
	for _, ev := range evs {
		if ev.Type == corev1.EventTypeWarning && ev.ReportingController == "kube-proxy" {
			return ev.Note, nil
		}
	}
	return "", fmt.Errorf("no SyncProxyRulesFailed Warning from kube-proxy on Node %s since %s among %d such events", testbed.NodeName, since.Format(time.RFC3339), len(evs))
}

// TestCommitRejectedByTheKernel: another agent on the node has a rule of its
// own jump into a service chain of kpipe's, and the service is deleted: the
// kernel refuses to delete a chain a rule still jumps to (EBUSY), so every
// commit that deletes it fails. kpipe retries with backoff and keeps the rules
// that work (connections to another service are all answered), counts the
// failures in kube-proxy's restore failure metric, turns /healthz 503 only once
// the deletion has waited longer than the health timeout, and records a
// SyncProxyRulesFailed Warning on the Node. When the other agent's rule goes,
// kpipe recovers by itself: the chain is deleted, /healthz is 200 again and a
// change made then is programmed.
func TestCommitRejectedByTheKernel(t *testing.T) {
	e, serving, addr, client := answeringEcho(t)
	held := e.service("held", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(held, 3)
	expectExactly(t, "held before the fault", tcp(2*time.Second), client, testbed.ClusterAddr(held, 80), podIPs(3))
	chain := serviceChainOf(t, e, held)

	const other = "KPE2E-OTHER-AGENT"
	ipt := func(args ...string) {
		t.Helper()
		if _, err := tb.Exec(tb.NodeNS, append([]string{"iptables", "-w", "5", "-t", "nat"}, args...)...); err != nil {
			t.Fatal(err)
		}
	}
	ipt("-N", other)
	ipt("-A", other, "-j", chain)
	removed := false
	removeOther := func() {
		if !removed {
			removed = true
			ipt("-F", other)
			ipt("-X", other)
		}
	}
	t.Cleanup(removeOther)
	t.Logf("another agent's chain %s jumps to %s, the chain of service held", other, chain)

	v4 := map[string]string{"ip_family": "IPv4"}
	failures := metricSum(t, restoreFailuresMetric, v4)
	l := startLoop(tcp(2*time.Second), client, addr, 20*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	health := watchHealth(250 * time.Millisecond)
	defer func() {
		if health != nil {
			health.finish()
		}
	}()
	start := time.Now()
	if err := tb.DeleteService(e.ctx, e.ns, "held"); err != nil {
		t.Fatal(err)
	}

	// Failures counted, /healthz 503 after the health timeout, a Warning.
	testbed.Eventually(t, 20*time.Second, func() error {
		if n := metricSum(t, restoreFailuresMetric, v4); n < failures+3 {
			return fmt.Errorf("%s{IPv4} = %v, was %v", restoreFailuresMetric, n, failures)
		}
		return nil
	})
	t.Logf("3 failed commits counted within %v", since(start))
	var unhealthy time.Duration
	testbed.Eventually(t, healthTimeout+20*time.Second, func() error {
		code, body, err := tb.HTTPGet(tb.NodeNS, testbed.HealthzURL+"/healthz")
		if err != nil {
			return err
		}
		if code != 503 {
			return fmt.Errorf("/healthz: HTTP %d %s, want 503", code, body)
		}
		unhealthy = time.Since(start)
		return nil
	})
	t.Logf("/healthz 503 %v after the service was deleted (health timeout %v)", unhealthy.Round(time.Millisecond), healthTimeout)
	polls, bad := health.finish()
	health = nil
	// Every poll before the timeout is 200: a failure younger than it is not unhealthy.
	for _, b := range bad {
		if d := b.at.Sub(start); d < healthTimeout-time.Second {
			t.Errorf("/healthz not 200 %v after the failures began, before the health timeout %v: %s", d.Round(time.Millisecond), healthTimeout, b)
		}
	}
	t.Logf("/healthz polled %d times until it turned 503", polls)
	var note string
	testbed.Eventually(t, 15*time.Second, func() error {
		var err error
		note, err = e.syncFailedWarning(start.Add(-time.Second))
		return err
	})
	t.Logf("Warning on the Node: %s", note)
	if nat := e.iptablesSave("nat"); !strings.Contains(nat, ":"+chain+" ") {
		t.Errorf("%s gone although the kernel refuses to delete it", chain)
	}
	if n := metricSum(t, "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", v4); n < 1 {
		t.Errorf("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{IPv4} = %v; the first failed commit was partial", n)
	}
	keepsAnswering(t, l, "while commits fail")

	// The other agent goes away: kpipe recovers by itself.
	removeOther()
	start = time.Now()
	testbed.Eventually(t, 20*time.Second, func() error {
		code, body, err := tb.HTTPGet(tb.NodeNS, testbed.HealthzURL+"/healthz")
		if err != nil {
			return err
		}
		if code != 200 {
			return fmt.Errorf("/healthz: HTTP %d %s", code, body)
		}
		if nat := e.iptablesSave("nat"); strings.Contains(nat, ":"+chain+" ") {
			return fmt.Errorf("%s still in nat", chain)
		}
		return nil
	})
	t.Logf("recovered %v after the other agent's rule went: /healthz 200, %s deleted", since(start), chain)
	after := metricSum(t, restoreFailuresMetric, v4)
	e.endpoints(serving, 1, 2, 4)
	expectExactly(t, "a change after the recovery", tcp(2*time.Second), client, addr, podIPs(1, 2, 4))
	if n := metricSum(t, restoreFailuresMetric, v4); n != after {
		t.Errorf("restore failures went on after the recovery: %v → %v", after, n)
	}
	l.finishWithNoFailure(t, "connections to the other service while commits failed")
	l = nil
}

// TestXtablesLockHeldDoesNotStopCommits: another process holds the xtables
// lock (/run/xtables.lock; `ip netns exec` shares /run, so it is the same file
// kpipe's iptables would wait for) for longer than kpipe's -w 5 allows, while
// a service changes. The test bed's iptables is the nf_tables backend, which
// does not take that lock (nf_tables transactions need none): the change is
// programmed while the lock is still held and no restore fails. (On the
// legacy backend the wait is bounded by -w and a held lock fails the commit
// like any restore error; netfilter's tests hold the lock against
// iptables-legacy, and TestCommitRejectedByTheKernel follows such a failure.)
func TestXtablesLockHeldDoesNotStopCommits(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)
	v4 := map[string]string{"ip_family": "IPv4"}
	failures := metricSum(t, restoreFailuresMetric, v4)
	const hold = 8 * time.Second // longer than -w 5
	release, err := tb.HoldXtablesLock(hold)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	start := time.Now()
	e.endpoints(svc, 1, 2, 3)
	expectExactly(t, "change made while the xtables lock is held", tcp(2*time.Second), client, addr, podIPs(1, 2, 3))
	took := time.Since(start)
	if !testbed.XtablesLockHeld() {
		t.Fatalf("the lock was released (after %v) before the change was seen programmed (%v): the test proves nothing", hold, took.Round(time.Millisecond))
	}
	t.Logf("programmed %v after the change, with the xtables lock held throughout", took.Round(time.Millisecond))
	if n := metricSum(t, restoreFailuresMetric, v4); n != failures {
		t.Errorf("%s{IPv4} went from %v to %v while the lock was held", restoreFailuresMetric, failures, n)
	}
}
