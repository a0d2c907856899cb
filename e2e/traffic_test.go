package e2e

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// target is where a client loop sends its requests: a kind of request from a
// namespace to an address.
type target struct {
	name     string
	d        dialer
	ns, addr string
}

// echoNodePort creates a NodePort service name with ports "tcp" and "udp" 80,
// endpoints pods 1 and 2: what nodePortTargets reach.
func (e *env) echoNodePort(name string) *corev1.Service {
	e.t.Helper()
	svc := e.create(typed(e.ns, name, corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort), testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	return svc
}

// nodePortTargets are svc's ClusterIP port 80 over TCP and UDP from the client
// pod and its NodePort "tcp" from the client (svc: see echoNodePort).
func nodePortTargets(svc *corev1.Service) []target {
	pod := tb.Pod(clientPod).NS
	return []target{
		{"ClusterIP TCP", tcp2, pod, testbed.ClusterAddr(svc, 80)},
		{"ClusterIP UDP", udp2, pod, testbed.ClusterAddr(svc, 80)},
		{"NodePort TCP", tcp2, tb.ClientNS, testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(svc, "tcp"))},
	}
}

// traffic is a client loop per target, kept up while a test disturbs kpipe:
// each loop makes a new connection every pause. Its answered and failed
// requests are counted per phase; every failure fails the test at finish, as
// does an answer by an endpoint not allowed.
type traffic struct {
	t       *testing.T
	targets []target
	pause   time.Duration
	allowed []string // the endpoints that may answer
	loops   []*loop
	phases  []trafficPhase
	// last is each loop's (answered, failed) at the end of the last phase.
	last [][2]int
}

// trafficPhase is one phase's answered and failed requests, per target, and
// the failures that fail the test.
type trafficPhase struct {
	name         string
	ok, failed   []int
	failureLines []string
}

// newTraffic is traffic to targets, a new connection every pause each,
// answered by allowed; start starts it. Its loops are stopped when the test
// ends.
func newTraffic(t *testing.T, pause time.Duration, allowed []string, targets ...target) *traffic {
	tr := &traffic{t: t, targets: targets, pause: pause, allowed: allowed}
	t.Cleanup(tr.stop)
	return tr
}

// start waits until every target is answered by exactly want, then starts
// the loops.
func (tr *traffic) start(want []string) {
	tr.t.Helper()
	for _, tg := range tr.targets {
		expectExactly(tr.t, tg.name, tg.d, tg.ns, tg.addr, want)
	}
	for _, tg := range tr.targets {
		tr.loops = append(tr.loops, startLoop(tg.d, tg.ns, tg.addr, tr.pause))
		tr.last = append(tr.last, [2]int{})
	}
}

// keepsAnswering: every loop gets answers at this step.
func (tr *traffic) keepsAnswering(step string) {
	tr.t.Helper()
	for i, l := range tr.loops {
		keepsAnswering(tr.t, l, step+": "+tr.targets[i].name)
	}
}

// keepsAnswering fails the test unless the loop gets at least 10 more answers
// within 10 s (traffic flows at this step).
func keepsAnswering(t *testing.T, l *loop, step string) {
	t.Helper()
	n := l.answered()
	testbed.Eventually(t, 10*time.Second, func() error {
		if got := l.answered() - n; got < 10 {
			return fmt.Errorf("%s: only %d connections answered", step, got)
		}
		return nil
	})
}

// endPhase closes the phase that began at the end of the last one (or at
// start): it records and logs its attempted and failed requests per target.
// Every failure fails the test at finish.
func (tr *traffic) endPhase(name string) {
	tr.t.Helper()
	tr.endPhaseTolerating(name, time.Time{})
}

// endPhaseTolerating is endPhase for a phase that leaves a window without
// rules: a hand-over to upstream kube-proxy, whose own start-up does (see
// TestSwapKubeProxyNFTablesKpipeBothWays), or a rule the test deleted itself.
// Requests that began before synced (when the rules were whole again) are
// counted and logged, not failed; any that began later fails the test.
func (tr *traffic) endPhaseTolerating(name string, synced time.Time) {
	tr.t.Helper()
	p := trafficPhase{name: name}
	var counts []string
	for i, l := range tr.loops {
		l.mu.Lock()
		ok, failed := l.ok, len(l.failures)
		tolerated := 0
		for j := tr.last[i][1]; j < failed; j++ {
			if l.failedAt[j].Before(synced) {
				tolerated++
				continue
			}
			p.failureLines = append(p.failureLines, tr.targets[i].name+": "+l.failures[j])
		}
		l.mu.Unlock()
		p.ok = append(p.ok, ok-tr.last[i][0])
		p.failed = append(p.failed, failed-tr.last[i][1])
		tr.last[i] = [2]int{ok, failed}
		c := fmt.Sprintf("%s %d attempted / %d failed", tr.targets[i].name, p.ok[i]+p.failed[i], p.failed[i])
		if !synced.IsZero() {
			c += fmt.Sprintf(" (%d before the rules were whole)", tolerated)
		}
		counts = append(counts, c)
	}
	tr.phases = append(tr.phases, p)
	tr.t.Logf("phase %q: %s", name, strings.Join(counts, ", "))
}

// totals are the requests attempted and failed in all phases so far.
func (tr *traffic) totals() (attempted, failed int) {
	for _, p := range tr.phases {
		for i := range p.ok {
			attempted += p.ok[i] + p.failed[i]
			failed += p.failed[i]
		}
	}
	return attempted, failed
}

// finish stops the loops; it fails the test if a request failed in any phase
// (but the tolerated ones) or was answered by an endpoint not allowed.
func (tr *traffic) finish() {
	tr.t.Helper()
	tr.stop()
	for _, p := range tr.problems() {
		tr.t.Error(p)
	}
}

// problems are, once the loops stopped, the answers by endpoints not allowed
// and the phases' failures, the requests after the last phase in one of
// their own.
func (tr *traffic) problems() []string {
	for i, l := range tr.loops {
		if l.ok+len(l.failures) > tr.last[i][0]+tr.last[i][1] {
			tr.endPhase("after the last phase, until the loops stopped")
			break
		}
	}
	var out []string
	for i, l := range tr.loops {
		if _, extra := compareAnswerers(l.seen, tr.allowed); len(extra) > 0 {
			out = append(out, fmt.Sprintf("%s: answered by %v; only %v are endpoints (answers by endpoint %v)", tr.targets[i].name, extra, tr.allowed, l.seen))
		}
	}
	for _, p := range tr.phases {
		if len(p.failureLines) > 0 {
			out = append(out, fmt.Sprintf("phase %q: %d requests failed:\n%s", p.name, len(p.failureLines), strings.Join(p.failureLines, "\n")))
		}
	}
	return out
}

// stop stops the loops (once).
func (tr *traffic) stop() {
	for _, l := range tr.loops {
		select {
		case <-l.stop:
		default:
			l.finish()
		}
	}
}

// expectEndpoints checks that every target is answered by exactly pods.
func (tr *traffic) expectEndpoints(step string, pods ...int) {
	tr.t.Helper()
	for _, tg := range tr.targets {
		expectExactly(tr.t, step+": "+tg.name, tg.d, tg.ns, tg.addr, podIPs(pods...))
	}
}

// TestTrafficCountsRequestsAfterTheLastPhase: a request that fails after the
// last endPhase (a test ends its last phase, then finishes) fails the test
// too. A fake dialer: this tests the helper, not kpipe.
func TestTrafficCountsRequestsAfterTheLastPhase(t *testing.T) {
	var failing atomic.Bool
	d := func(ns, addr string) (testbed.Answer, error) {
		if failing.Load() {
			return testbed.Answer{}, testbed.ErrRefused
		}
		return testbed.Answer{Endpoint: "10.244.1.11"}, nil
	}
	tr := newTraffic(t, time.Millisecond, []string{"10.244.1.11"}, target{"fake", dialer{dial: d}, "kpe2e-x-client", "10.96.0.10:80"})
	tr.start([]string{"10.244.1.11"})
	keepsAnswering(t, tr.loops[0], "before the failures")
	tr.endPhase("answered")
	failing.Store(true)
	testbed.Eventually(t, 5*time.Second, func() error {
		tr.loops[0].mu.Lock()
		defer tr.loops[0].mu.Unlock()
		if len(tr.loops[0].failures) == 0 {
			return errors.New("no failure yet")
		}
		return nil
	})
	tr.stop()
	if p := tr.problems(); len(p) == 0 {
		t.Fatal("requests failed after the last phase, yet traffic reports no problem")
	} else {
		t.Logf("reported: %.200s", p)
	}
}
