package e2e

import (
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

// runKubeProxy starts kp, waits for its first sync and returns when its IPv4
// rules were in: its own sync timestamp, not when the test saw it (the test
// polls, up to 100 ms and a scrape later).
func (e *env) runKubeProxy(kp *testbed.KubeProxy) time.Time {
	e.t.Helper()
	start := time.Now()
	if err := kp.Start(); err != nil {
		e.t.Fatalf("start kube-proxy (%s): %v", kp.Mode, err)
	}
	samples, err := kp.Metric(testbed.SyncMetric)
	if err != nil {
		e.t.Fatal(err)
	}
	var synced time.Time
	for k, v := range samples {
		if strings.Contains(k, `ip_family="IPv4"`) {
			synced = time.Unix(0, int64(v*1e9))
		}
	}
	if synced.Before(start) {
		e.t.Fatalf("kube-proxy (%s): no IPv4 sync since its start in %v", kp.Mode, samples)
	}
	e.t.Logf("kube-proxy (%s) synced %v after start (seen %v after)", kp.Mode, synced.Sub(start).Round(time.Millisecond), since(start))
	return synced
}

// toKubeProxy stops kpipe and starts kp: kpipe → kube-proxy. It returns when
// kp's IPv4 rules were in (see runKubeProxy).
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

// newSwapTraffic creates a NodePort service "swap" (TCP and UDP port 80,
// endpoints pods 1 and 2; the proxy running now programs it) and the traffic
// kept up across the hand-overs: its ClusterIP over TCP and UDP from a pod and
// its NodePort over TCP from the client, a new connection every 10 ms each.
func newSwapTraffic(e *env) (*corev1.Service, *traffic) {
	e.t.Helper()
	svc := e.echoNodePort("swap")
	return svc, newTraffic(e.t, 10*time.Millisecond, podIPs(1, 2), nodePortTargets(svc)...)
}

// doomedService is a ClusterIP service "doomed" (port 80, endpoint pod 3),
// answering from the client pod: programmed by the proxy running now, to be
// deleted under kube-proxy after a swap (deleteUnderKubeProxy).
func (e *env) doomedService() *corev1.Service {
	e.t.Helper()
	doomed := e.service("doomed", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(doomed, 3)
	waitAnswer(e.t, tcp2, tb.Pod(clientPod).NS, testbed.ClusterAddr(doomed, 80), 20*time.Second)
	return doomed
}

// deleteUnderKubeProxy deletes svc and waits for kube-proxy's next IPv4 sync
// (its timestamp moves only when iptables-restore succeeded).
func (e *env) deleteUnderKubeProxy(kp *testbed.KubeProxy, svc *corev1.Service) {
	e.t.Helper()
	deleted := time.Now()
	if err := tb.DeleteService(e.ctx, e.ns, svc.Name); err != nil {
		e.t.Fatal(err)
	}
	if err := kp.WaitSyncedAfter(deleted, 30*time.Second, "IPv4"); err != nil {
		e.t.Fatalf("kube-proxy's sync after the Service deletion: %v (%s = %v)", err, restoreFailuresMetric, restoreFailures(e.t, kp))
	}
}

// restoreFailuresMetric counts failed iptables-restore runs (kube-proxy's
// metric; kpipe's failed commits count in it too).
const restoreFailuresMetric = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"

// restoreFailures is kube-proxy's count of failed iptables-restore runs, all
// IP families (absent until the first failure).
func restoreFailures(t *testing.T, kp *testbed.KubeProxy) float64 {
	t.Helper()
	m, err := kp.Metrics()
	if err != nil {
		t.Fatal(err)
	}
	return testbed.Sum(m, restoreFailuresMetric, nil)
}
