package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// The swap tests hand the node between kpipe and upstream kube-proxy (the
// version e2e/controlplane pins, iptables mode) while a client loops TCP
// connections to a ClusterIP service: neither flushes the other's rules at
// start, so no connection may fail.

// restoreFailuresMetric counts kube-proxy's failed iptables-restore runs.
const restoreFailuresMetric = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"

// startKubeProxy starts upstream kube-proxy in the node namespace (kpipe must be
// stopped) and makes sure that, when the test ends, kube-proxy is stopped and
// kpipe runs with its default flags again. Without args it runs with the test
// bed's flags and is waited for until it synced; with args, with only those,
// not waited for.
func (e *env) startKubeProxy(args ...string) *testbed.KubeProxy {
	e.t.Helper()
	kp, err := tb.KubeProxy(e.t.Logf)
	if err != nil {
		e.t.Fatalf("kube-proxy unavailable: %v", err)
	}
	e.t.Cleanup(func() {
		if e.t.Failed() {
			e.t.Logf("--- kube-proxy log (%s):\n%s", kp.LogPath, kp.LogTail(60))
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
	start := time.Now()
	if len(args) > 0 {
		err = kp.StartWith(args...)
	} else {
		err = kp.Start()
	}
	if err != nil {
		e.t.Fatalf("start kube-proxy: %v", err)
	}
	e.t.Logf("kube-proxy started (%v)", since(start))
	return kp
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

// restoreFailures is kube-proxy's count of failed iptables-restore runs, all
// IP families (absent until the first failure).
func restoreFailures(t *testing.T, kp *testbed.KubeProxy) float64 {
	t.Helper()
	samples, err := kp.Metric(restoreFailuresMetric)
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, v := range samples {
		sum += v
	}
	return sum
}

// TestSwapKpipeKubeProxyKpipeKeepsTraffic: kpipe → kube-proxy → kpipe, with
// connections to a ClusterIP service all along: none fails.
func TestSwapKpipeKubeProxyKpipeKeepsTraffic(t *testing.T) {
	e, _, addr, client := answeringEcho(t)
	l := startLoop(tcp(2*time.Second), client, addr, 10*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	keepsAnswering(t, l, "kpipe running")

	if err := e.k.Stop(); err != nil {
		t.Logf("kpipe stopped (exit: %v)", err)
	}
	keepsAnswering(t, l, "kpipe stopped")
	kp := e.startKubeProxy()
	keepsAnswering(t, l, "kube-proxy running")
	if err := kp.Stop(); err != nil {
		t.Fatalf("stop kube-proxy: %v", err)
	}
	keepsAnswering(t, l, "kube-proxy stopped")
	start := time.Now()
	if err := e.k.Start(); err != nil {
		t.Fatal(err)
	}
	t.Logf("kpipe synced %v after start", since(start))
	keepsAnswering(t, l, "kpipe running again")

	ok, failures, seen := l.finish()
	l = nil
	t.Logf("kpipe → kube-proxy → kpipe: %d connections answered, %d failed, by endpoint %v", ok, len(failures), seen)
	if len(failures) > 0 {
		t.Fatalf("%d of %d connections failed across the swaps:\n%s", len(failures), ok+len(failures), strings.Join(failures, "\n"))
	}
}

// TestSwapToKubeProxyThenDeleteAService: kpipe → kube-proxy with traffic
// flowing (none fails); kube-proxy removes kpipe's dispatch chains, so deleting
// a Service kpipe had programmed leaves kube-proxy's iptables-restore working
// (its failure counter stays 0 over later syncs); then kpipe takes the node
// back.
func TestSwapToKubeProxyThenDeleteAService(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)
	doomed := e.service("doomed", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(doomed, 3)
	waitAnswer(t, tcp(2*time.Second), client, testbed.ClusterAddr(doomed, 80), 20*time.Second)

	l := startLoop(tcp(2*time.Second), client, addr, 10*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	if err := e.k.Stop(); err != nil {
		t.Logf("kpipe stopped (exit: %v)", err)
	}
	kp := e.startKubeProxy()
	keepsAnswering(t, l, "kube-proxy running")
	if n := restoreFailures(t, kp); n != 0 {
		t.Fatalf("kube-proxy's first sync over kpipe's rules: %s = %v", restoreFailuresMetric, n)
	}

	// Delete a Service kpipe programmed; then change another one, for one more
	// sync. Every sync must restore.
	deleted := time.Now()
	if err := tb.DeleteService(e.ctx, e.ns, doomed.Name); err != nil {
		t.Fatal(err)
	}
	if err := kp.WaitSyncedAfter(deleted, 30*time.Second, "IPv4"); err != nil {
		t.Fatalf("kube-proxy's sync after the Service deletion: %v (%s = %v)", err, restoreFailuresMetric, restoreFailures(t, kp))
	}
	changed := time.Now()
	e.endpoints(svc, 1, 2, 4)
	if err := kp.WaitSyncedAfter(changed, 30*time.Second, "IPv4"); err != nil {
		t.Fatalf("kube-proxy's sync after an endpoint change: %v (%s = %v)", err, restoreFailuresMetric, restoreFailures(t, kp))
	}
	for i := 0; i < 5; i++ {
		if n := restoreFailures(t, kp); n != 0 {
			t.Fatalf("after the Service deletion: %s = %v", restoreFailuresMetric, n)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("kube-proxy synced after deleting %s/%s and after an endpoint change; %s = 0", e.ns, doomed.Name, restoreFailuresMetric)
	for _, f := range []string{"iptables-save", "ip6tables-save"} {
		if left := dispatchChains(t, f); len(left) > 0 {
			t.Errorf("%s: kpipe's dispatch chains still there under kube-proxy: %v", f, left)
		}
	}
	keepsAnswering(t, l, "after the Service deletion")

	ok, failures, seen := l.finish()
	l = nil
	t.Logf("kpipe → kube-proxy: %d connections answered, %d failed, by endpoint %v", ok, len(failures), seen)
	if len(failures) > 0 {
		t.Errorf("%d of %d connections failed across the swap:\n%s", len(failures), ok+len(failures), strings.Join(failures, "\n"))
	}

	// kpipe takes the node back with its defaults.
	if err := kp.Stop(); err != nil {
		t.Fatalf("stop kube-proxy: %v", err)
	}
	if err := e.k.Start(); err != nil {
		t.Fatal(err)
	}
	waitAnswer(t, tcp(2*time.Second), client, addr, 20*time.Second)
}

// kubeChains lists the chains named KUBE-… in every table of one family
// (save is iptables-save or ip6tables-save), as "table/chain".
func kubeChains(t *testing.T, save string) []string {
	t.Helper()
	out, err := tb.Exec(tb.NodeNS, save)
	if err != nil {
		t.Fatalf("%s: %v", save, err)
	}
	var chains []string
	table := ""
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
		case strings.HasPrefix(line, ":KUBE-"):
			chains = append(chains, table+"/"+strings.Fields(line[1:])[0])
		}
	}
	return chains
}

// dispatchChains lists kpipe's dispatch chains (KUBE-SVC-B<bits>-…, an older
// kpipe's KUBE-SVCS-…) in one family.
func dispatchChains(t *testing.T, save string) []string {
	t.Helper()
	var out []string
	for _, c := range kubeChains(t, save) {
		name := c[strings.IndexByte(c, '/')+1:]
		if strings.HasPrefix(name, "KUBE-SVCS-") || isBucketName(name) {
			out = append(out, c)
		}
	}
	return out
}

// isBucketName: "KUBE-SVC-B" digits "-" (never a service chain: its hash has no '-').
func isBucketName(name string) bool {
	rest, ok := strings.CutPrefix(name, "KUBE-SVC-B")
	if !ok {
		return false
	}
	num, _, ok := strings.Cut(rest, "-")
	return ok && num != "" && strings.Trim(num, "0123456789") == ""
}

// missingFrom lists the items of got that want does not have.
func missingFrom(got, want []string) []string {
	var out []string
	for _, g := range got {
		if !slices.Contains(want, g) {
			out = append(out, g)
		}
	}
	return out
}

// TestSwapThenKubeProxyCleanup: after kpipe → kube-proxy, `kube-proxy
// --cleanup` leaves in either family no KUBE- chain that it does not leave
// when it ran alone (its KUBE-FIREWALL, shared with kubelet); then kpipe takes
// the node back with its defaults.
func TestSwapThenKubeProxyCleanup(t *testing.T) {
	e, _, addr, client := answeringEcho(t)
	if err := e.k.Stop(); err != nil {
		t.Logf("kpipe stopped (exit: %v)", err)
	}
	kp := e.startKubeProxy()
	if err := kp.Stop(); err != nil {
		t.Fatalf("stop kube-proxy: %v", err)
	}
	if before := kubeChains(t, "iptables-save"); len(before) < 10 {
		t.Fatalf("only %v before --cleanup: the check below could not fail", before)
	}
	if out, err := kp.Cleanup(); err != nil {
		t.Fatalf("kube-proxy --cleanup: %v\n%s", err, out)
	}
	afterSwap := map[string][]string{}
	for _, f := range []string{"iptables-save", "ip6tables-save"} {
		afterSwap[f] = kubeChains(t, f)
		t.Logf("%s after the swap and kube-proxy --cleanup: KUBE- chains left: %v", f, afterSwap[f])
	}
	// What upstream leaves when it ran alone (KUBE-FIREWALL, which it shares
	// with kubelet) is all it may leave after taking over from kpipe.
	if code, out := runKpipeOnce(t, "--cleanup"); code != 0 {
		t.Fatalf("kpipe --cleanup: exit %d:\n%s", code, out)
	}
	alone := e.startKubeProxy()
	if err := alone.Stop(); err != nil {
		t.Fatalf("stop kube-proxy: %v", err)
	}
	if out, err := alone.Cleanup(); err != nil {
		t.Fatalf("kube-proxy --cleanup: %v\n%s", err, out)
	}
	for _, f := range []string{"iptables-save", "ip6tables-save"} {
		want := kubeChains(t, f)
		t.Logf("%s after kube-proxy alone and its --cleanup: KUBE- chains left: %v", f, want)
		if extra := missingFrom(afterSwap[f], want); len(extra) > 0 {
			t.Errorf("%s: after the swap, kube-proxy --cleanup left %v, which it leaves not when it ran alone", f, extra)
		}
	}

	// kpipe takes the node back with its defaults.
	if err := e.k.Start(); err != nil {
		t.Fatal(err)
	}
	waitAnswer(t, tcp(2*time.Second), client, addr, 20*time.Second)
}
