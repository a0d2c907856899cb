package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// The swap tests hand the node between kpipe and upstream kube-proxy (the
// version e2e/controlplane pins) while clients loop new connections to a
// service: neither may leave a moment without working rules, so no connection
// may fail.

// kubeProxy is upstream kube-proxy in mode ("iptables" or "nftables"), not yet
// started. When the test ends it is stopped and kpipe runs with its default
// flags again.
func (e *env) kubeProxy(mode string) *testbed.KubeProxy {
	e.t.Helper()
	kp, err := tb.KubeProxy(mode, e.t.Logf)
	if err != nil {
		e.t.Fatalf("kube-proxy unavailable: %v", err)
	}
	e.t.Cleanup(func() {
		if e.t.Failed() {
			e.t.Logf("--- kube-proxy %s log (%s):\n%s", mode, kp.LogPath, kp.LogTail(60))
		}
		if err := kp.Stop(); err != nil {
			e.t.Errorf("stop kube-proxy: %v", err)
		}
		if !e.k.Running() {
			if err := e.k.Start(); err != nil {
				e.t.Errorf("start kpipe again: %v", err)
			}
		}
	})
	return kp
}

// startKubeProxy starts kube-proxy in mode (kpipe must be stopped) and waits
// for its first sync.
func (e *env) startKubeProxy(mode string) *testbed.KubeProxy {
	e.t.Helper()
	kp := e.kubeProxy(mode)
	e.runKubeProxy(kp)
	return kp
}

// runKubeProxy starts kp and returns when its first sync was seen.
func (e *env) runKubeProxy(kp *testbed.KubeProxy) time.Time {
	e.t.Helper()
	start := time.Now()
	if err := kp.Start(); err != nil {
		e.t.Fatalf("start kube-proxy (%s): %v", kp.Mode, err)
	}
	e.t.Logf("kube-proxy (%s) synced %v after start", kp.Mode, since(start))
	return time.Now()
}

// toKubeProxy stops kpipe and starts kp: kpipe → kube-proxy. It returns when
// kp's first sync was seen.
func (e *env) toKubeProxy(kp *testbed.KubeProxy) time.Time {
	e.t.Helper()
	if err := e.k.Stop(); err != nil {
		e.t.Logf("kpipe stopped (exit: %v)", err)
	}
	return e.runKubeProxy(kp)
}

// toKpipe stops kp and starts kpipe with its default flags: kube-proxy → kpipe.
func (e *env) toKpipe(kp *testbed.KubeProxy) {
	e.t.Helper()
	if err := kp.Stop(); err != nil {
		e.t.Fatalf("stop kube-proxy (%s): %v", kp.Mode, err)
	}
	start := time.Now()
	if err := e.k.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.t.Logf("kpipe synced %v after start", since(start))
}

// kubeProxyHealthy fails the test unless kube-proxy's /healthz answers 200.
func kubeProxyHealthy(t *testing.T, kp *testbed.KubeProxy) {
	t.Helper()
	code, body, err := tb.HTTPGet(tb.NodeNS, testbed.KubeProxyHealthzURL+"/healthz")
	if err != nil || code != 200 {
		t.Fatalf("kube-proxy (%s) /healthz: HTTP %d %v: %s", kp.Mode, code, err, body)
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

// swapTraffic is the traffic kept up across the hand-overs: a NodePort
// service "swap" (TCP and UDP port 80, endpoints pods 1 and 2), looped at its
// ClusterIP over TCP and UDP from a pod and at its NodePort over TCP from the
// client, each a new connection every 10 ms. Its requests and failures are
// counted per phase.
type swapTraffic struct {
	t       *testing.T
	svc     *corev1.Service
	targets []swapTarget
	loops   []*loop
	phases  []swapPhase
	// last is each loop's (answered, failed) at the end of the last phase.
	last [][2]int
}

type swapTarget struct {
	name     string
	d        dialer
	ns, addr string
}

// swapPhase is one phase's answered and failed requests, per target, and
// the failures that fail the test.
type swapPhase struct {
	name         string
	ok, failed   []int
	failureLines []string
}

// newSwapTraffic creates the service (the proxy running now programs it); start
// starts the loops.
func newSwapTraffic(e *env) *swapTraffic {
	e.t.Helper()
	svc := e.create(typed(e.ns, "swap", corev1.ServiceTypeNodePort,
		testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort), testbed.Port("udp", corev1.ProtocolUDP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	pod := tb.Pod(clientPod).NS
	s := &swapTraffic{t: e.t, svc: svc, targets: []swapTarget{
		{"ClusterIP TCP", tcp2, pod, testbed.ClusterAddr(svc, 80)},
		{"ClusterIP UDP", udp2, pod, testbed.ClusterAddr(svc, 80)},
		{"NodePort TCP", tcp2, tb.ClientNS, testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(svc, "tcp"))},
	}}
	e.t.Cleanup(s.stop)
	return s
}

// start waits until every target answers, then starts the loops.
func (s *swapTraffic) start() {
	s.t.Helper()
	for _, tg := range s.targets {
		waitAnswer(s.t, tg.d, tg.ns, tg.addr, 20*time.Second)
	}
	for _, tg := range s.targets {
		s.loops = append(s.loops, startLoop(tg.d, tg.ns, tg.addr, 10*time.Millisecond))
		s.last = append(s.last, [2]int{})
	}
}

// keepsAnswering: every loop gets answers at this step.
func (s *swapTraffic) keepsAnswering(step string) {
	s.t.Helper()
	for i, l := range s.loops {
		keepsAnswering(s.t, l, step+": "+s.targets[i].name)
	}
}

// endPhase closes the phase that began at the end of the last one (or at
// start): it records and logs its attempted and failed requests per target.
// Every failure fails the test at finish.
func (s *swapTraffic) endPhase(name string) {
	s.t.Helper()
	s.endPhaseTolerating(name, time.Time{})
}

// endPhaseTolerating is endPhase for a hand-over to upstream kube-proxy whose
// own start-up leaves a window without rules (see
// TestSwapKubeProxyNFTablesKpipeBothWays): requests that began before synced
// (when kube-proxy's first sync was seen) are counted and logged, not failed;
// any that began later fails the test.
func (s *swapTraffic) endPhaseTolerating(name string, synced time.Time) {
	s.t.Helper()
	p := swapPhase{name: name}
	var counts []string
	for i, l := range s.loops {
		l.mu.Lock()
		ok, failed := l.ok, len(l.failures)
		tolerated := 0
		for j := s.last[i][1]; j < failed; j++ {
			if l.failedAt[j].Before(synced) {
				tolerated++
				continue
			}
			p.failureLines = append(p.failureLines, s.targets[i].name+": "+l.failures[j])
		}
		l.mu.Unlock()
		p.ok = append(p.ok, ok-s.last[i][0])
		p.failed = append(p.failed, failed-s.last[i][1])
		s.last[i] = [2]int{ok, failed}
		c := fmt.Sprintf("%s %d attempted / %d failed", s.targets[i].name, p.ok[i]+p.failed[i], p.failed[i])
		if !synced.IsZero() {
			c += fmt.Sprintf(" (%d before kube-proxy's first sync)", tolerated)
		}
		counts = append(counts, c)
	}
	s.phases = append(s.phases, p)
	s.t.Logf("phase %q: %s", name, strings.Join(counts, ", "))
}

// finish stops the loops; it fails the test if a request failed in any phase
// or was answered by another than the service's endpoints (pods 1 and 2).
func (s *swapTraffic) finish() {
	s.t.Helper()
	s.stop()
	want := podIPs(1, 2)
	for i, l := range s.loops {
		if _, extra := compareAnswerers(l.seen, want); len(extra) > 0 {
			s.t.Errorf("%s: answered by %v; only %v are endpoints (answers by endpoint %v)", s.targets[i].name, extra, want, l.seen)
		}
	}
	for _, p := range s.phases {
		if len(p.failureLines) > 0 {
			s.t.Errorf("phase %q: %d requests failed:\n%s", p.name, len(p.failureLines), strings.Join(p.failureLines, "\n"))
		}
	}
}

// stop stops the loops (once).
func (s *swapTraffic) stop() {
	for _, l := range s.loops {
		select {
		case <-l.stop:
		default:
			l.finish()
		}
	}
}

// expectEndpoints checks that every target is answered by exactly pods.
func (s *swapTraffic) expectEndpoints(step string, pods ...int) {
	s.t.Helper()
	for _, tg := range s.targets {
		expectExactly(s.t, step+": "+tg.name, tg.d, tg.ns, tg.addr, podIPs(pods...))
	}
}
