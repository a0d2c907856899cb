package e2e

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

func TestKillEachStageLosesNoConnection(t *testing.T) {
	e := setup(t)
	svc := e.service("echo", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2, 3)
	addr := testbed.ClusterAddr(svc, 80)
	client := tb.Pod(clientPod).NS
	waitAnswer(t, tcp(2*time.Second), client, addr, 20*time.Second)

	var stages []stageStatus
	testbed.Eventually(t, 10*time.Second, func() error {
		var err error
		stages, err = getStages()
		return err
	})
	names := make([]string, len(stages))
	for i, s := range stages {
		names[i] = s.Name
	}
	t.Logf("stages: %v", names)

	l := startLoop(tcp(2*time.Second), client, addr, 10*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	for _, name := range names {
		before := -1
		for _, s := range stages {
			if s.Name == name {
				before = s.Restarts
			}
		}
		// Killing the stage that serves HTTP may cut this very response.
		code, body, err := tb.HTTPPost(tb.NodeNS, testbed.DebugURL+"/debug/stages/"+name+"/kill")
		if err == nil && code/100 != 2 {
			t.Errorf("POST /debug/stages/%s/kill: HTTP %d: %s", name, code, body)
		}
		start := time.Now()
		var after stageStatus
		testbed.Eventually(t, 30*time.Second, func() error {
			st, err := getStages()
			if err != nil {
				return err
			}
			stages = st
			for _, s := range st {
				if s.Name == name {
					after = s
					if s.Restarts <= before {
						return fmt.Errorf("stage %s: restarts %d, was %d before the kill (state %q)", name, s.Restarts, before, s.State)
					}
					return nil
				}
			}
			return fmt.Errorf("stage %s no longer listed", name)
		})
		t.Logf("killed %s: restarts %d -> %d in %v, state %q, lastError %q", name, before, after.Restarts, since(start), after.State, after.LastError)
		// let traffic run against the restarted pipeline
		keepsAnswering(t, l, "since the kill of "+name)
	}
	l.finishWithNoFailure(t, "connections during the kills")
	l = nil

	// The restarted pipeline still follows changes.
	e.endpoints(svc, 1, 2, 3, 4)
	testbed.Eventually(t, 15*time.Second, func() error {
		a, err := tb.DialTCP(client, addr, 2*time.Second)
		if err != nil {
			return err
		}
		if a.Endpoint != podIP(4) {
			return fmt.Errorf("endpoint added after the kills (%s) has not answered", podIP(4))
		}
		return nil
	})
}

func TestProcessRestartKeepsTraffic(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)

	l := startLoop(tcp(2*time.Second), client, addr, 10*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	start := time.Now()
	err := e.k.Stop()
	t.Logf("kpipe stopped by SIGTERM in %v (exit: %v)", since(start), err)
	if e.k.Running() {
		t.Fatal("kpipe still running after Stop")
	}

	// kpipe is down: the rules stay and traffic flows.
	n := l.answered()
	time.Sleep(3 * time.Second)
	if got := l.answered() - n; got < 10 {
		t.Errorf("only %d connections answered in 3s while kpipe was down", got)
	}
	if nat := e.iptablesSave("nat"); !strings.Contains(nat, testbed.ServiceComment(e.ns, svc.Name, "http")) {
		t.Errorf("service rules gone while kpipe is down:\n%s", filterRules(nat, e.ns+"/"))
	}

	start = time.Now()
	if err := e.k.Start(); err != nil {
		t.Fatal(err)
	}
	t.Logf("kpipe healthy again %v after start", since(start))
	keepsAnswering(t, l, "since the restart")

	// A change made after the restart is programmed.
	e.endpoints(svc, 1, 2, 3)
	start = time.Now()
	testbed.Eventually(t, 15*time.Second, func() error {
		a, err := tb.DialTCP(client, addr, 2*time.Second)
		if err != nil {
			return err
		}
		if a.Endpoint != podIP(3) {
			return fmt.Errorf("endpoint added after the restart (%s) has not answered", podIP(3))
		}
		return nil
	})
	t.Logf("endpoint added after the restart answered within %v", since(start))

	l.finishWithNoFailure(t, "connections across the restart")
	l = nil
}

func TestHealthzAndMetrics(t *testing.T) {
	e := setup(t)

	code, body, err := tb.HTTPGet(tb.NodeNS, testbed.HealthzURL+"/healthz")
	if err != nil {
		t.Fatal(err)
	}
	if code != 200 {
		t.Fatalf("/healthz: HTTP %d: %s", code, body)
	}
	var hz map[string]any
	if err := json.Unmarshal(body, &hz); err != nil {
		t.Fatalf("/healthz body is not JSON: %v: %s", err, body)
	}
	for _, field := range []string{"lastUpdated", "currentTime"} {
		v, ok := hz[field].(string)
		if !ok || v == "" {
			t.Errorf("/healthz: field %q missing or not a string: %s", field, body)
			continue
		}
		if _, err := time.Parse(time.RFC3339Nano, v); err != nil {
			t.Errorf("/healthz: %s = %q is not a timestamp: %v", field, v, err)
		}
	}
	t.Logf("/healthz: %s", strings.TrimSpace(string(body)))

	code, body, err = tb.HTTPGet(tb.NodeNS, testbed.HealthzURL+"/livez")
	if err != nil || code != 200 {
		t.Errorf("/livez: HTTP %d, %v: %s", code, err, body)
	}

	code, body, err = tb.HTTPGet(tb.NodeNS, testbed.MetricsURL+"/proxyMode")
	if err != nil || code != 200 || strings.TrimSpace(string(body)) != "iptables" {
		t.Errorf("/proxyMode: HTTP %d, %v: %q, want iptables", code, err, body)
	}

	metrics := func() (map[string]float64, error) {
		code, body, err := tb.HTTPGet(tb.NodeNS, testbed.MetricsURL+"/metrics")
		if err != nil {
			return nil, err
		}
		if code != 200 {
			return nil, fmt.Errorf("/metrics: HTTP %d: %s", code, body)
		}
		return parseMetrics(string(body)), nil
	}
	m, err := metrics()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{
		"kubeproxy_sync_proxy_rules_duration_seconds_count",
		"kubeproxy_sync_proxy_rules_last_timestamp_seconds",
		"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
	} {
		if _, ok := m[name]; !ok {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	last := m["kubeproxy_sync_proxy_rules_last_timestamp_seconds"]
	if last <= 0 {
		t.Errorf("kubeproxy_sync_proxy_rules_last_timestamp_seconds = %v after a sync", last)
	}
	t.Logf("sync count %v, last sync %v, last queued %v", m["kubeproxy_sync_proxy_rules_duration_seconds_count"], last, m["kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"])
	if t.Failed() {
		return
	}

	// A change moves the sync metrics on.
	svc := e.service("metrics-probe", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1)
	testbed.Eventually(t, 15*time.Second, func() error {
		m, err := metrics()
		if err != nil {
			return err
		}
		if now := m["kubeproxy_sync_proxy_rules_last_timestamp_seconds"]; now <= last {
			return fmt.Errorf("last sync timestamp still %v after a service was created", now)
		}
		return nil
	})
}

// parseMetrics reads Prometheus text: sample name (labels dropped; the first
// sample of a name wins) to value.
func parseMetrics(text string) map[string]float64 {
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		name := f[0]
		if i := strings.IndexByte(name, '{'); i >= 0 {
			name = name[:i]
			// labels may contain spaces: the value is after the closing brace
			if j := strings.LastIndexByte(l, '}'); j >= 0 {
				f = strings.Fields(l[j+1:])
				if len(f) < 1 {
					continue
				}
				f = append([]string{name}, f...)
			}
		}
		v, err := strconv.ParseFloat(f[1], 64)
		if err != nil {
			continue
		}
		if _, seen := out[name]; !seen {
			out[name] = v
		}
	}
	return out
}

// firstAnswerBound is how soon after an EndpointSlice is created a user may
// expect its service to answer, with the test bed's 100 ms min sync period.
const firstAnswerBound = 5 * time.Second

// TestEndpointSliceToFirstAnswerLatency measures how long after an
// EndpointSlice is created its service first answers, over several rounds.
// Each round must answer within firstAnswerBound, and from the first answer
// on, the service must answer every one of 200 requests, by exactly the
// slice's endpoints.
func TestEndpointSliceToFirstAnswerLatency(t *testing.T) {
	e := setup(t)
	svc := e.service("latency", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	addr := testbed.ClusterAddr(svc, 80)
	client := tb.Pod(clientPod).NS
	pods := make([]int, endpointPods)
	for i := range pods {
		pods[i] = i + 1
	}
	slices := tb.Client().DiscoveryV1().EndpointSlices(e.ns)

	const rounds = 5
	var lat []time.Duration
	for r := 1; r <= rounds; r++ {
		// Wait until the service is programmed without endpoints (refused), so
		// what is measured is the EndpointSlice alone.
		testbed.Eventually(t, 20*time.Second, func() error {
			_, err := tb.DialTCP(client, addr, time.Second)
			if !errors.Is(err, testbed.ErrRefused) {
				return fmt.Errorf("service without endpoints: want refused, got %v", err)
			}
			return nil
		})
		slice := testbed.EndpointSlice(svc, "", tb.ReadyEndpoints(pods...))
		start := time.Now()
		if _, err := slices.Create(e.ctx, slice, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		created := time.Since(start)
		first, d, outcomes := firstAnswer(t, client, addr, start, 30*time.Second)
		lat = append(lat, d)
		t.Logf("round %d: EndpointSlice with %d endpoints created at %s (API call %v); first answer, from %s, %v after the create call started; attempts started before it: %v",
			r, endpointPods, start.UTC().Format("15:04:05.000"), created.Round(time.Millisecond), first.Endpoint, d.Round(time.Millisecond), outcomes)
		if d > firstAnswerBound {
			t.Errorf("round %d: first answer %v after the EndpointSlice was created, want within %v", r, d.Round(time.Millisecond), firstAnswerBound)
		}
		seen := spread(t, tcp(2*time.Second), client, addr, 200)
		t.Logf("round %d: 200 requests after the first answer, all answered, by endpoint: %v", r, seen)
		requireExactly(t, seen, podIPs(pods...))
		if r == rounds {
			break
		}
		if err := slices.Delete(e.ctx, slice.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	sorted := append([]time.Duration(nil), lat...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i] < sorted[j] })
	t.Logf("EndpointSlice creation to first answer over %d rounds: min %v, median %v, max %v (min sync period 100ms, bound %v)",
		rounds, sorted[0].Round(time.Millisecond), sorted[rounds/2].Round(time.Millisecond), sorted[rounds-1].Round(time.Millisecond), firstAnswerBound)
}

// firstAnswer starts a TCP connection attempt from ns to addr every 10 ms, each
// in its own goroutine with a 1 s timeout (so one lost attempt does not delay
// the next), until one is answered. It returns that answer, when it came
// (measured from start) and the outcomes of the attempts started before it.
func firstAnswer(t *testing.T, ns, addr string, start time.Time, timeout time.Duration) (testbed.Answer, time.Duration, map[string]int) {
	t.Helper()
	type result struct {
		began time.Time
		ended time.Time
		a     testbed.Answer
		err   error
	}
	results := make(chan result, 1024)
	var wg sync.WaitGroup
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(timeout)
	var first *result
	var all []result
loop:
	for {
		select {
		case <-tick.C:
			if first != nil {
				break loop
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				began := time.Now()
				a, err := tb.DialTCP(ns, addr, time.Second)
				results <- result{began, time.Now(), a, err}
			}()
		case r := <-results:
			all = append(all, r)
			if r.err == nil && (first == nil || r.ended.Before(first.ended)) {
				first = &r
			}
		case <-deadline:
			t.Fatalf("no answer from %s within %v", addr, timeout)
		}
	}
	wg.Wait()
	close(results)
	for r := range results {
		all = append(all, r)
		if r.err == nil && r.ended.Before(first.ended) {
			first = &r
		}
	}
	outcomes := map[string]int{}
	for _, r := range all {
		if !r.began.Before(first.ended) {
			continue
		}
		switch {
		case r.err == nil:
			outcomes["answered"]++
		case errors.Is(r.err, testbed.ErrRefused):
			outcomes["refused"]++
		case errors.Is(r.err, testbed.ErrTimeout):
			outcomes["lost (timed out after 1s)"]++
		default:
			outcomes["error: "+r.err.Error()]++
		}
	}
	return first.a, first.ended.Sub(start), outcomes
}
