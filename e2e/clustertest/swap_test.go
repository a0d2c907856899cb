package clustertest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/cluster"
)

// TestSwapAndRollback hands the node from kubeadm's kube-proxy to kpipe's
// image and back, as deploy/README.md says, while a client pod makes a new
// connection every 10 ms through a ClusterIP, a NodePort and DNS (UDP and
// TCP), and reaches the apiserver through the kubernetes Service: not one
// may fail. After each hand-over the new proxy must program a change, and
// the operator's kube-proxy ConfigMap changes must still be there and in
// force. Under kpipe, the image is checked as a drop-in (kube-proxy's path,
// the iptables wrapper, the stamped version) and a new pod must reach DNS
// and the apiserver from its first attempts.
//
// Smoke: deploy/ applied, then `rollout undo`. Full run: then `kubectl set
// image` on kubeadm's DaemonSet, and back with kubeadm's own addon phase.
func TestSwapAndRollback(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	if _, err := c.Kubectl(ctx, "", "-n", "kube-system", "get", "ds", "kube-proxy"); err != nil {
		t.Fatal(err)
	}
	handOver(t, ctx, onKubeProxy)
	customiseProxyConfig(t, ctx)
	e := deployEcho(t, ctx, "swap-echo", 2)
	waitServed(t, ctx, e)
	probeIP := startProbe(t, ctx, "swap-client", trafficTargets(e, "10ms")...)
	time.Sleep(3 * time.Second)
	before := countsNow(t, ctx, probeIP)
	requireNoFailures(t, "kube-proxy before any swap", map[string]targetCounts{}, before)
	programsAChange(t, ctx, e, "kube-proxy")

	ways := [][2]handover{{toKpipeDeploy, toKubeProxyUndo}}
	if !cluster.SmokeOnly() {
		ways = append(ways, [2]handover{toKpipeSetImage, toKubeProxyKubeadm})
	}
	for i, way := range ways {
		pod := handOver(t, ctx, way[0])
		requireDropIn(t, ctx, pod)
		metrics := requireCustomisationsKept(t, ctx, "kpipe")
		if !strings.Contains(metrics, `kpipe_build_info{`) || !strings.Contains(metrics, `git_version="`+imageTag()+`"`) {
			t.Errorf("kpipe's /metrics has no kpipe_build_info for %s", imageTag())
		}
		programsAChange(t, ctx, e, "kpipe")
		requireFreshPodServed(t, ctx, e, fmt.Sprintf("fresh-client-%d", i))

		handOver(t, ctx, way[1])
		metrics = requireCustomisationsKept(t, ctx, "kube-proxy")
		if strings.Contains(metrics, "kpipe_build_info") || !strings.Contains(metrics, `kubernetes_build_info{`) {
			t.Errorf("after %s, /metrics is not kube-proxy's (no kubernetes_build_info, or kpipe_build_info)", way[1].name)
		}
		programsAChange(t, ctx, e, "kube-proxy")
	}
	after := countsNow(t, ctx, probeIP)
	requireNoFailures(t, "through every swap", before, after)
}

func imageTag() string {
	_, tag, _ := strings.Cut(c.Images.Kpipe.Ref[strings.LastIndexByte(c.Images.Kpipe.Ref, '/')+1:], ":")
	return tag
}

// requireDropIn checks the running kpipe pod from inside, as kube-proxy's
// image would be: kpipe at kube-proxy's path, stamped with the image's
// version, and the iptables commands handed to the host's backend by the
// wrapper (this node's rules are nf_tables).
func requireDropIn(t *testing.T, ctx context.Context, pod corev1.Pod) {
	t.Helper()
	exec := func(argv ...string) string {
		out, err := c.Kubectl(ctx, "", append([]string{"-n", "kube-system", "exec", pod.Name, "--"}, argv...)...)
		if err != nil {
			t.Error(err)
		}
		return strings.TrimSpace(out)
	}
	if v := exec("/usr/local/bin/kube-proxy", "--version"); !strings.HasPrefix(v, "kpipe "+imageTag()) {
		t.Errorf("kube-proxy --version in kpipe's pod: %q, want kpipe %s", v, imageTag())
	}
	if v := exec("iptables", "-V"); !strings.Contains(v, "nf_tables") {
		t.Errorf("iptables -V in kpipe's pod: %q, want the host's nf_tables backend", v)
	}
	for _, cmd := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		if target := exec("readlink", "-f", "/usr/sbin/"+cmd); target != "/usr/sbin/xtables-nft-multi" {
			t.Errorf("%s in kpipe's pod is %q, want the wrapper to have linked it to xtables-nft-multi", cmd, target)
		}
	}
}

// requireFreshPodServed starts a new client pod under kpipe and requires
// its very first attempts, DNS over UDP and TCP and the apiserver through
// the kubernetes Service, to succeed.
func requireFreshPodServed(t *testing.T, ctx context.Context, e echo, name string) {
	t.Helper()
	targets := trafficTargets(e, "10ms")
	var fresh []string
	for _, tg := range targets {
		if strings.HasPrefix(tg, "dns") || strings.HasPrefix(tg, "apiserver") {
			fresh = append(fresh, tg)
		}
	}
	ip := startProbe(t, ctx, name, fresh...)
	time.Sleep(2 * time.Second)
	requireNoFailures(t, "a new pod under kpipe, from its first attempt", map[string]targetCounts{}, countsNow(t, ctx, ip))
}
