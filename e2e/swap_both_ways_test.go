package e2e

import (
	"testing"
	"time"
)

// TestSwapKubeProxyNFTablesKpipeBothWays: on a node kube-proxy's nftables mode
// runs, with the swap traffic all along, kube-proxy (nftables) → kpipe →
// kube-proxy (nftables).
//
// kube-proxy (nftables) → kpipe: no request fails (kpipe removes kube-proxy's
// tables only once its own rules are in).
//
// kpipe → kube-proxy (nftables): upstream's nftables mode deletes the
// iptables-mode rules (kpipe's) when it starts, before its own first sync
// (cmd/kube-proxy/app: Options.Run calls platformCleanup before
// newProxyServer), so new connections of that window fail whoever ran before.
// The test measures the same hand-over from upstream's own iptables mode for
// comparison; in both, a request that began after kube-proxy's first sync
// must not fail, and every answer comes from an endpoint. Then, under
// kube-proxy, an endpoint change is followed (nothing of kpipe's still sends
// to the old endpoints).
func TestSwapKubeProxyNFTablesKpipeBothWays(t *testing.T) {
	e := setup(t)
	svc, tr := newSwapTraffic(e)
	kpIPT, kpNFT := e.kubeProxy("iptables"), e.kubeProxy("nftables")
	e.toKubeProxy(kpIPT)
	tr.start(podIPs(1, 2))
	tr.keepsAnswering("kube-proxy (iptables) running")
	tr.endPhase("kube-proxy (iptables) running")

	if err := kpIPT.Stop(); err != nil {
		t.Fatalf("stop kube-proxy (iptables): %v", err)
	}
	synced := e.runKubeProxy(kpNFT)
	tr.keepsAnswering("kube-proxy (nftables) running")
	tr.endPhaseTolerating("kube-proxy (iptables) → kube-proxy (nftables), upstream alone", synced)

	e.toKpipe(kpNFT)
	tr.keepsAnswering("kpipe running")
	tr.endPhase("kube-proxy (nftables) → kpipe")

	synced = e.toKubeProxy(kpNFT)
	tr.keepsAnswering("kube-proxy (nftables) running again")
	tr.endPhaseTolerating("kpipe → kube-proxy (nftables)", synced)
	tr.finish()

	changed := time.Now()
	e.endpoints(svc, 3, 4)
	if err := kpNFT.WaitSyncedAfter(changed, 30*time.Second, "IPv4"); err != nil {
		t.Fatalf("kube-proxy (nftables) sync after an endpoint change: %v", err)
	}
	tr.expectEndpoints("under kube-proxy (nftables) after an endpoint change", 3, 4)
}

// TestSwapKubeProxyIPTablesKpipeBothWays: on a node only kube-proxy (iptables)
// has programmed, with the swap traffic all along, kube-proxy → kpipe →
// kube-proxy: no request fails. Then deleting a Service kpipe had programmed
// leaves kube-proxy syncing (its sync timestamp moves, its restore failures
// stay 0, /healthz 200) and the remaining service answers from its endpoints.
func TestSwapKubeProxyIPTablesKpipeBothWays(t *testing.T) {
	e := setup(t)
	_, tr := newSwapTraffic(e)
	doomed := e.doomedService()

	// A node only kube-proxy has programmed: kpipe's rules removed first.
	kp := e.kubeProxy("iptables")
	if err := e.k.Stop(); err != nil {
		t.Logf("kpipe stopped (exit: %v)", err)
	}
	if code, out := runKpipeOnce(t, "--cleanup"); code != 0 {
		t.Fatalf("kpipe --cleanup: exit %d:\n%s", code, out)
	}
	if left := leftovers(t); len(left) > 0 {
		t.Fatalf("kpipe --cleanup left %v", left)
	}
	removeKubeFirewall(t)
	e.runKubeProxy(kp)
	tr.start(podIPs(1, 2))
	tr.keepsAnswering("kube-proxy (iptables) running")
	tr.endPhase("kube-proxy (iptables) running")

	e.toKpipe(kp)
	tr.keepsAnswering("kpipe running")
	tr.endPhase("kube-proxy (iptables) → kpipe")

	e.toKubeProxy(kp)
	tr.keepsAnswering("kube-proxy (iptables) running again")
	tr.endPhase("kpipe → kube-proxy (iptables)")

	e.deleteUnderKubeProxy(kp, doomed)
	tr.keepsAnswering("after the Service deletion")
	tr.endPhase("kube-proxy (iptables), Service deleted")
	tr.finish()
	if n := restoreFailures(t, kp); n != 0 {
		t.Errorf("%s = %v", restoreFailuresMetric, n)
	}
	kubeProxyHealthy(t, kp)
	tr.expectEndpoints("under kube-proxy (iptables) after the Service deletion", 1, 2)
}
