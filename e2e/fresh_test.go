package e2e

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// convergeToFresh waits up to timeout for the node's rules to equal what a
// fresh kpipe writes for the current API state (testbed.FreshRules), which
// must not change meanwhile. The fresh kpipe runs once; if the node still
// differs at the end, it runs once more (in case it was the fresh one that
// was off) and the node gets one last look. It returns how long after from
// the node's rules first matched, or the last diff.
func convergeToFresh(t *testing.T, from time.Time, timeout time.Duration) (time.Duration, string) {
	t.Helper()
	want, err := tb.FreshRules()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(timeout)
	var diff string
	for attempt := 0; ; attempt++ {
		got, err := tb.NodeRules()
		if err != nil {
			t.Fatal(err)
		}
		if diff = testbed.Diff(want, got, "fresh kpipe", "node"); diff == "" {
			return time.Since(from), ""
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("node's rules still differ from a fresh kpipe's after waiting %v (%v since the start); running a fresh kpipe again", timeout, since(from))
	if want, err = tb.FreshRules(); err != nil {
		t.Fatal(err)
	}
	got, err := tb.NodeRules()
	if err != nil {
		t.Fatal(err)
	}
	if diff = testbed.Diff(want, got, "fresh kpipe", "node"); diff == "" {
		return time.Since(from), ""
	}
	return 0, diff
}

// requireLikeFresh fails the test unless the node's rules come to equal a
// fresh kpipe's within timeout.
func requireLikeFresh(t *testing.T, what string, timeout time.Duration) {
	t.Helper()
	start := time.Now()
	took, diff := convergeToFresh(t, start, timeout)
	if diff != "" {
		t.Fatalf("%s: node's rules differ from what a fresh kpipe writes for the same API state:\n%s", what, diff)
	}
	t.Logf("%s: node's rules equal a fresh kpipe's (checked within %v)", what, took.Round(time.Millisecond))
}

func TestFreshKpipeComparisonSeesAHandDeletedRule(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)
	requireLikeFresh(t, "before the deletion", 20*time.Second)

	// Delete the first rule of the service's KUBE-SVC- chain by hand: the
	// masquerade rule for traffic from outside the cluster, so that the pods'
	// traffic still reaches every endpoint (deleting an endpoint's rule would
	// leave a 50 % branch that DNATs nowhere).
	nat := e.iptablesSave("nat")
	chain := ""
	for _, l := range rulesMatching(nat, "-A KUBE-SVC-", testbed.ServiceComment(e.ns, svc.Name, "http")) {
		if c := strings.Fields(l)[1]; serviceChain.MatchString(c) {
			chain = c
		}
	}
	if chain == "" {
		t.Fatalf("no KUBE-SVC- chain for %s/%s:\n%s", e.ns, svc.Name, filterRules(nat, e.ns+"/"))
	}
	rules := rulesMatching(nat, "-A "+chain+" ")
	deleted := rules[0]
	if !strings.HasSuffix(deleted, "-j KUBE-MARK-MASQ") {
		t.Fatalf("the first rule of %s is not its masquerade rule: %s", chain, deleted)
	}
	// kpipe repairs a hand edit within a second (TestTamperRepaired): frozen,
	// it cannot, and the comparison sees the node as the edit left it.
	resume, err := tb.Kpipe().Pause()
	if err != nil {
		t.Fatal(err)
	}
	resume = sync.OnceValue(resume) // thawed once, here or when the test stops early
	defer resume()
	if _, err := tb.Exec(tb.NodeNS, "iptables", "-w", "-t", "nat", "-D", chain, "1"); err != nil {
		t.Fatal(err)
	}
	t.Logf("deleted by hand: %s", deleted)

	got, err := tb.NodeRules()
	if err != nil {
		t.Fatal(err)
	}
	want, err := tb.FreshRules()
	if err != nil {
		t.Fatal(err)
	}
	diff := testbed.Diff(want, got, "fresh kpipe", "node")
	t.Logf("diff:\n%s", diff)
	for _, s := range []string{"chain ipv4 nat " + chain + ": rules differ", "  - [1] " + deleted} {
		if !strings.Contains(diff, s) {
			t.Fatalf("the comparison with a fresh kpipe does not show the deleted rule (want %q in the diff)", s)
		}
	}
	if n := strings.Count(diff, "\n"); n != 2 {
		t.Errorf("the diff has %d lines, want 2 (the chain and the deleted rule)", n)
	}
	// Thawed, kpipe puts the rule back, and the comparison sees that too.
	if err := resume(); err != nil {
		t.Fatal(err)
	}
	requireLikeFresh(t, "after kpipe thawed", 10*time.Second)
	waitAnswer(t, tcp2, client, addr, 5*time.Second)
}

// killStages kills the named stages at once (POST /debug/stages/<name>/kill,
// concurrently) and returns how many kills the supervisor accepted: a stage
// waiting out a backoff (409) is not running and cannot be killed.
func killStages(t *testing.T, names []string) int {
	t.Helper()
	type result struct {
		name string
		code int
		body string
		err  error
	}
	results := make(chan result, len(names))
	for _, name := range names {
		go func() {
			code, body, err := tb.HTTPPost(tb.NodeNS, testbed.DebugURL+"/debug/stages/"+name+"/kill")
			results <- result{name, code, string(body), err}
		}()
	}
	killed := 0
	for range names {
		r := <-results
		switch {
		case r.err != nil:
			t.Errorf("POST /debug/stages/%s/kill: %v", r.name, r.err)
		case r.code == 200:
			killed++
		case r.code == 409:
		default:
			t.Errorf("POST /debug/stages/%s/kill: HTTP %d: %s", r.name, r.code, r.body)
		}
	}
	return killed
}

// waitRunning waits up to timeout for every named stage to be running (not
// waiting out a backoff after an earlier kill). It reports whether they were.
func waitRunning(names []string, timeout time.Duration) bool {
	return testbed.Poll(timeout, 50*time.Millisecond, func() error {
		st, err := getStages()
		if err != nil {
			return err
		}
		for _, s := range st {
			if slices.Contains(names, s.Name) && s.State != "running" {
				return fmt.Errorf("%s is %s", s.Name, s.State)
			}
		}
		return nil
	}) == nil
}
