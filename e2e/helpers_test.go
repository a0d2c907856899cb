package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// env is one test's world: its Kubernetes namespace, with kpipe running.
type env struct {
	t   *testing.T
	ctx context.Context
	ns  string
	k   *testbed.Kpipe
	// dumped: the evidence of a failure was already logged (before kpipe was
	// restarted with its default flags).
	dumped bool
	// flagsChanged: kpipe was restarted with extra flags (restartKpipe) and
	// is restarted with its defaults when the test ends.
	flagsChanged bool
}

var nonDNS = regexp.MustCompile(`[^a-z0-9]+`)

// setup gives the test its own Kubernetes namespace and a running kpipe. On
// failure the tail of kpipe's log and the node's NAT rules are logged; the
// namespace is always deleted.
func setup(t *testing.T) *env {
	t.Helper()
	if kpipeErr != nil {
		t.Fatalf("kpipe unavailable: %v", kpipeErr)
	}
	k := tb.Kpipe()
	if !k.Running() {
		t.Logf("kpipe was not running (an earlier test stopped or crashed it); starting it")
		if err := k.Start(); err != nil {
			t.Fatalf("start kpipe: %v", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	name := strings.Trim(nonDNS.ReplaceAllString(strings.ToLower(t.Name()), "-"), "-")
	if len(name) > 50 {
		name = name[:50]
	}
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	name = strings.Trim(name, "-") + "-" + hex.EncodeToString(b)
	e := &env{t: t, ctx: ctx, ns: name, k: k}
	if err := tb.CreateNamespace(ctx, name); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() && !e.dumped {
			e.dumpEvidence()
		}
		dctx, dcancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer dcancel()
		if err := tb.DeleteNamespace(dctx, name); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		cancel()
	})
	return e
}

func (e *env) dumpEvidence() {
	t := e.t
	state := "running"
	if !e.k.Running() {
		state = "NOT running"
	}
	t.Logf("kpipe (%s, pid %d, started %d times) log tail (%s):\n%s", state, e.k.PID(), e.k.Starts(), e.k.LogPath, e.k.LogTail(60))
	e.dumped = true
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		for _, table := range []string{"nat", "filter"} {
			out, err := tb.Exec(tb.NodeNS, save, "-t", table)
			if err != nil {
				t.Logf("%s -t %s: %v", save, table, err)
				continue
			}
			if save == "ip6tables-save" && !strings.Contains(out, e.ns+"/") {
				continue // nothing of this test's: spare the noise
			}
			t.Logf("%s -t %s (rules for %s/ and chain heads):\n%s", save, table, e.ns, filterRules(out, e.ns+"/"))
		}
	}
}

// filterRules keeps the table and chain lines, the rules of shared chains and
// the rules mentioning needle; it drops other services' own chains.
func filterRules(save, needle string) string {
	var keep []string
	for _, l := range strings.Split(save, "\n") {
		if strings.Contains(l, needle) || !perServiceRule(l) {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

func perServiceRule(l string) bool {
	f := strings.Fields(l)
	if len(f) < 2 || f[0] != "-A" {
		return false
	}
	for _, p := range []string{"KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SVL-", "KUBE-XLB-"} {
		if strings.HasPrefix(f[1], p) {
			return true
		}
	}
	return false
}

// service creates a ClusterIP service in the test's namespace.
func (e *env) service(name string, ports ...corev1.ServicePort) *corev1.Service {
	e.t.Helper()
	svc, err := tb.CreateService(e.ctx, testbed.Service(e.ns, name, ports...))
	if err != nil {
		e.t.Fatal(err)
	}
	return svc
}

// endpoints sets the IPv4 endpoints of svc to the given pods.
func (e *env) endpoints(svc *corev1.Service, pods ...int) {
	e.t.Helper()
	if _, err := tb.SetEndpoints(e.ctx, svc, tb.ReadyEndpoints(pods...)); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) iptablesSave(table string) string {
	e.t.Helper()
	out, err := tb.Exec(tb.NodeNS, "iptables-save", "-t", table)
	if err != nil {
		e.t.Fatalf("iptables-save -t %s: %v", table, err)
	}
	return out
}

// dialer is one kind of request: TCP or UDP, from a namespace.
type dialer struct {
	// proto ("tcp", "udp") and src (the source address; "": the kernel's
	// choice) describe the request to `kpipe explain`; a dialer without a
	// proto is not explained.
	proto, src string
	dial       func(ns, addr string) (testbed.Answer, error)
}

func tcp(timeout time.Duration) dialer {
	return dialer{"tcp", "", func(ns, addr string) (testbed.Answer, error) { return tb.DialTCP(ns, addr, timeout) }}
}

func udp(timeout time.Duration) dialer {
	return dialer{"udp", "", func(ns, addr string) (testbed.Answer, error) { return tb.DialUDP(ns, addr, timeout, 0) }}
}

// podIP is the IPv4 of pod n.
func podIP(n int) string { return tb.Pod(n).IPv4 }

func podIPs(pods ...int) []string {
	out := make([]string, len(pods))
	for i, n := range pods {
		out[i] = podIP(n)
	}
	return out
}

// waitAnswer waits until a request from ns to addr is answered.
func waitAnswer(t *testing.T, d dialer, ns, addr string, timeout time.Duration) testbed.Answer {
	t.Helper()
	var a testbed.Answer
	testbed.Eventually(t, timeout, func() error {
		var err error
		a, err = d.dial(ns, addr)
		return err
	})
	return a
}

// spread makes n requests from ns to addr, all of which must be answered, and
// counts answers per endpoint.
func spread(t *testing.T, d dialer, ns, addr string, n int) map[string]int {
	t.Helper()
	seen := map[string]int{}
	for i := 0; i < n; i++ {
		a, err := d.dial(ns, addr)
		if err != nil {
			t.Fatalf("request %d/%d from %s to %s: %v (answers so far: %v)", i+1, n, ns, addr, err, seen)
		}
		seen[a.Endpoint]++
	}
	return seen
}

// requireExactly fails unless every IP of want is a key of seen, and seen has no
// other key.
func requireExactly(t *testing.T, seen map[string]int, want []string) {
	t.Helper()
	if missing, extra := compareAnswerers(seen, want); len(missing) > 0 || len(extra) > 0 {
		t.Fatalf("answers by endpoint %v: endpoints that never answered %v, unexpected answerers %v", seen, missing, extra)
	}
}

// compareAnswerers lists the wanted endpoints that never answered and the
// answerers that were not wanted.
func compareAnswerers(seen map[string]int, want []string) (missing, extra []string) {
	for _, w := range want {
		if seen[w] == 0 {
			missing = append(missing, w)
		}
	}
	for k := range seen {
		if !slices.Contains(want, k) {
			extra = append(extra, k)
		}
	}
	sort.Strings(extra)
	return missing, extra
}

// stageStatus is one element of GET /debug/stages.
type stageStatus struct {
	Name      string    `json:"name"`
	Path      string    `json:"path"`
	State     string    `json:"state"`
	Restarts  int       `json:"restarts"`
	LastError string    `json:"lastError"`
	LastStart time.Time `json:"lastStart"`
}

func getStages() ([]stageStatus, error) {
	code, body, err := tb.HTTPGet(tb.NodeNS, testbed.DebugURL+"/debug/stages")
	if err != nil {
		return nil, err
	}
	if code != 200 {
		return nil, fmt.Errorf("GET /debug/stages: HTTP %d: %s", code, body)
	}
	var st []stageStatus
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("GET /debug/stages: decode %q: %w", body, err)
	}
	if len(st) == 0 {
		return nil, errors.New("GET /debug/stages: empty list")
	}
	return st, nil
}

// loop makes requests from ns to addr until stopped, recording every failure.
type loop struct {
	stop chan struct{}
	done chan struct{}

	mu       sync.Mutex
	ok       int
	failures []string
	failedAt []time.Time // when each failed request began
	seen     map[string]int
}

func startLoop(d dialer, ns, addr string, pause time.Duration) *loop {
	l := &loop{stop: make(chan struct{}), done: make(chan struct{}), seen: map[string]int{}}
	go func() {
		defer close(l.done)
		for {
			select {
			case <-l.stop:
				return
			default:
			}
			start := time.Now()
			a, err := d.dial(ns, addr)
			l.mu.Lock()
			if err != nil {
				l.failures = append(l.failures, fmt.Sprintf("%s (after %v): %v", start.Format("15:04:05.000"), since(start), err))
				l.failedAt = append(l.failedAt, start)
			} else {
				l.ok++
				l.seen[a.Endpoint]++
			}
			l.mu.Unlock()
			time.Sleep(pause)
		}
	}()
	return l
}

// answered is how many requests were answered so far.
func (l *loop) answered() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ok
}

// finish stops the loop and returns (answered, failures, answers by endpoint).
func (l *loop) finish() (int, []string, map[string]int) {
	close(l.stop)
	<-l.done
	return l.ok, l.failures, l.seen
}

// finishWithNoFailure stops the loop, logs what it saw under what, and fails
// the test (not at once) if any of its connections failed.
func (l *loop) finishWithNoFailure(t *testing.T, what string) {
	t.Helper()
	l.finishWithNoFailureOutside(t, what, time.Time{}, time.Time{})
}

// finishWithNoFailureOutside is finishWithNoFailure tolerating (logging) the
// failures of connections begun from from to to, while the test itself broke
// the rules.
func (l *loop) finishWithNoFailureOutside(t *testing.T, what string, from, to time.Time) {
	t.Helper()
	ok, all, seen := l.finish()
	var failures []string
	for i, f := range all {
		if began := l.failedAt[i]; !began.Before(from) && began.Before(to) {
			t.Logf("%s: tolerated, begun while the test broke the rules: %s", what, f)
			continue
		}
		failures = append(failures, f)
	}
	t.Logf("%s: %d connections answered, %d failed, by endpoint %v", what, ok, len(failures), seen)
	if len(failures) > 0 {
		t.Errorf("%s: %d of %d connections failed:\n%s", what, len(failures), ok+len(all), strings.Join(failures, "\n"))
	}
}

func since(start time.Time) time.Duration { return time.Since(start).Round(time.Millisecond) }

// answeringEcho sets up the common case: a TCP echo service on port 80 with
// endpoints on pods 1 and 2, already answering from the client pod. It returns
// the test's env, the service, its ClusterIP:80 and the client's namespace.
func answeringEcho(t *testing.T) (*env, *corev1.Service, string, string) {
	t.Helper()
	e := setup(t)
	svc, addr, client := e.answeringEcho()
	return e, svc, addr, client
}

// answeringEcho is answeringEcho in e's namespace, with kpipe as it runs.
func (e *env) answeringEcho() (*corev1.Service, string, string) {
	e.t.Helper()
	svc := e.service("echo", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2)
	addr := testbed.ClusterAddr(svc, 80)
	client := tb.Pod(clientPod).NS
	waitAnswer(e.t, tcp(2*time.Second), client, addr, 20*time.Second)
	return svc, addr, client
}

// keepNodeSysctl puts the node namespace's sysctl at path (/proc/sys/...) back
// to its value now when the test ends.
func keepNodeSysctl(t *testing.T, path string) {
	t.Helper()
	before, err := tb.Exec(tb.NodeNS, "cat", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := tb.Exec(tb.NodeNS, "sh", "-c", "echo "+strings.TrimSpace(before)+" > "+path); err != nil {
			t.Errorf("cleanup: put %s back: %v", path, err)
		}
	})
}

// runOnce runs a one-shot command and returns its exit code and output; one
// that runs on past timeout, or cannot run, fails the test.
func runOnce(t *testing.T, timeout time.Duration, name string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, string(out)
	case errors.As(err, &exit) && ctx.Err() == nil:
		return exit.ExitCode(), string(out)
	}
	t.Fatalf("%s %q: %v\n%s", name, args, err, out)
	return 0, ""
}
