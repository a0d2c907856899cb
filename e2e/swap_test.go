package e2e

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// TestSwapKpipeKubeProxyKpipeKeepsTraffic: kpipe → kube-proxy (iptables) →
// kpipe, with the swap traffic all along: none fails.
func TestSwapKpipeKubeProxyKpipeKeepsTraffic(t *testing.T) {
	e := setup(t)
	_, tr := newSwapTraffic(e)
	tr.start(podIPs(1, 2))
	tr.keepsAnswering("kpipe running")
	tr.endPhase("kpipe running")
	kp := e.kubeProxy("iptables")
	e.toKubeProxy(kp)
	tr.keepsAnswering("kube-proxy running")
	tr.endPhase("kpipe → kube-proxy (iptables)")
	e.toKpipe(kp)
	tr.keepsAnswering("kpipe running again")
	tr.endPhase("kube-proxy (iptables) → kpipe")
	tr.finish()
}

// TestSwapToKubeProxyThenDeleteAService: kpipe → kube-proxy with traffic
// flowing (none fails); kube-proxy removes kpipe's dispatch chains, so deleting
// a Service kpipe had programmed leaves kube-proxy's iptables-restore working
// (its failure counter stays 0 over later syncs); then kpipe takes the node
// back.
func TestSwapToKubeProxyThenDeleteAService(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)
	doomed := e.doomedService()

	tr := newTraffic(t, 10*time.Millisecond, podIPs(1, 2, 4), target{"ClusterIP TCP", tcp2, client, addr})
	tr.start(podIPs(1, 2))
	kp := e.kubeProxy("iptables")
	e.toKubeProxy(kp)
	tr.keepsAnswering("kube-proxy running")
	if n := restoreFailures(t, kp); n != 0 {
		t.Fatalf("kube-proxy's first sync over kpipe's rules: %s = %v", restoreFailuresMetric, n)
	}

	// Delete a Service kpipe programmed; then change another one, for one more
	// sync. Every sync must restore.
	e.deleteUnderKubeProxy(kp, doomed)
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
	tr.keepsAnswering("after the Service deletion")
	tr.endPhase("kpipe → kube-proxy (iptables), a Service deleted")
	tr.finish()

	// kpipe takes the node back with its defaults.
	e.toKpipe(kp)
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
	kp := e.kubeProxy("iptables")
	e.toKubeProxy(kp)
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
	alone := e.startKubeProxy("iptables")
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
