package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// kubeadmConfigText is the KubeProxyConfiguration kubeadm v1.34 writes into the
// kube-proxy ConfigMap (cmd/kpipe/testdata says how it was made), pointed at this
// test bed: its kubeconfig and its pod CIDR.
func kubeadmConfigText(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../cmd/kpipe/testdata/kubeadm-kube-proxy.conf")
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	for _, old := range []string{"kubeconfig: /var/lib/kube-proxy/kubeconfig.conf", "clusterCIDR: 10.244.0.0/16"} {
		if !strings.Contains(text, old) {
			t.Fatalf("the kubeadm file has no %q to point at the test bed", old)
		}
	}
	return strings.NewReplacer(
		"kubeconfig: /var/lib/kube-proxy/kubeconfig.conf", "kubeconfig: "+tb.Kubeconfig,
		"clusterCIDR: 10.244.0.0/16", "clusterCIDR: "+testbed.ClusterCIDR,
	).Replace(text)
}

// configFile writes a configuration file for the test and returns its path.
func configFile(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// startWith restarts kpipe with only args, as a DaemonSet would run it; kpipe is
// restarted with the test bed's defaults when the test ends.
func (e *env) startWith(args ...string) {
	e.t.Helper()
	e.restoreKpipeAtEnd()
	if err := e.k.Stop(); err != nil {
		e.t.Fatalf("stop kpipe: %v", err)
	}
	start := time.Now()
	if err := e.k.StartWith(args...); err != nil {
		e.t.Fatalf("start kpipe with %q: %v", args, err)
	}
	e.t.Logf("kpipe started with %q, synced after %v", args, since(start))
}

// clusterIPAndNodePortAnswer checks a ClusterIP from a pod and a NodePort from
// outside the node, each answered by exactly its endpoints.
func (e *env) clusterIPAndNodePortAnswer() {
	e.t.Helper()
	svc := e.create(typed(e.ns, "np", corev1.ServiceTypeNodePort, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort)))
	e.endpoints(svc, 1, 2)
	want := podIPs(1, 2)
	expectExactly(e.t, "TCP ClusterIP from a pod", tcp2, tb.Pod(clientPod).NS, testbed.ClusterAddr(svc, 80), want)
	expectExactly(e.t, "TCP NodePort from the client", tcp2, tb.ClientNS, testbed.HostPort(testbed.NodeIPv4, testbed.NodePortOf(svc, "tcp")), want)
}

// kubeadm's DaemonSet runs `kube-proxy --config=... --hostname-override=$(NODE_NAME)`:
// kpipe runs from the same two flags and the same file (kube-proxy's defaults
// throughout: 30 s sync and canary period), proxies ClusterIP, NodePort and
// externalTrafficPolicy Local, and brings back nat rules flushed behind its back.
func TestConfigKubeadmFile(t *testing.T) {
	e := setup(t)
	e.startWith("--config="+configFile(t, kubeadmConfigText(t)), "--hostname-override="+testbed.NodeName)
	e.clusterIPAndNodePortAnswer()
	e.externalTrafficPolicyLocal()
	svc, addr, client := e.answeringEcho()
	e.repairsFlushedNAT(svc, addr, client, 45*time.Second) // the canary runs every syncPeriod (30 s)
}

// A field kube-proxy's configuration does not have is an error naming it, and
// kpipe exits 1 (as for a bad flag, as kube-proxy exits) instead of running with half a configuration.
func TestConfigUnknownFieldExits1(t *testing.T) {
	if kpipeErr != nil {
		t.Fatalf("kpipe unavailable: %v", kpipeErr)
	}
	bin := tb.Kpipe().Bin
	cfg := configFile(t, kubeadmConfigText(t)+"masqueradeEverything: true\n")
	cmd := exec.Command(bin, "--config="+cfg, "--hostname-override="+testbed.NodeName)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("kpipe with an unknown field: %v, want exit 1; output:\n%s", err, out)
	}
	if !strings.Contains(string(out), "masqueradeEverything") {
		t.Errorf("output does not name the unknown field masqueradeEverything:\n%s", out)
	}
}

// configz reads /configz from the node's metrics address (kube-proxy's default,
// 127.0.0.1:10249), waiting for it to answer.
func configz(t *testing.T) map[string]any {
	t.Helper()
	var doc map[string]any
	testbed.Eventually(t, 60*time.Second, func() error {
		code, body, err := tb.HTTPGet(tb.NodeNS, testbed.MetricsURL+"/configz")
		if err != nil {
			return err
		}
		if code != 200 {
			return fmt.Errorf("/configz: HTTP %d: %s", code, body)
		}
		return json.Unmarshal(body, &doc)
	})
	return doc
}

// configzDiff lists where b differs from a: keys one of them lacks (at any
// depth), and leaf values that differ.
func configzDiff(path string, a, b any) []string {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if !aok || !bok {
		if !reflect.DeepEqual(a, b) {
			return []string{fmt.Sprintf("%s: %v, kpipe %v", path, a, b)}
		}
		return nil
	}
	var out []string
	for k, v := range am {
		if w, ok := bm[k]; ok {
			out = append(out, configzDiff(path+"."+k, v, w)...)
		} else {
			out = append(out, path+"."+k+": missing in kpipe's")
		}
	}
	for k := range bm {
		if _, ok := am[k]; !ok {
			out = append(out, path+"."+k+": kpipe's only")
		}
	}
	return out
}

// conntrackSysctls are the node namespace's conntrack sysctls that kube-proxy
// and kpipe set from a configuration.
var conntrackSysctls = []string{"nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait",
	"nf_conntrack_tcp_be_liberal", "nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"}

// keepConntrackSysctls puts the node namespace's conntrack sysctls back when
// the test ends.
func keepConntrackSysctls(t *testing.T) {
	t.Helper()
	for _, name := range conntrackSysctls {
		keepNodeSysctl(t, "/proc/sys/net/netfilter/"+name)
	}
}

// Upstream kube-proxy and kpipe, each run with the same file and the hostname
// flag of kubeadm's DaemonSet, answer /configz with the same document: the same
// keys at every level (kube-proxy's internal configuration, under
// "kubeproxy.config.k8s.io") and the same values. Files: kubeadm's, and
// kubeadm's with a value other than the default for every field kpipe honours
// (and some it does not, which it shows as read).
func TestConfigzLikeKubeProxy(t *testing.T) {
	e := setup(t)
	keepConntrackSysctls(t)
	// kube-proxy exits when it cannot set nf_conntrack_max, which the node's
	// namespace cannot: maxPerCore 0 leaves it alone, in both.
	kubeadm := strings.Replace(kubeadmConfigText(t), "maxPerCore: null", "maxPerCore: 0", 1)
	changed := strings.NewReplacer(
		"bindAddressHardFail: false", "bindAddressHardFail: true", "enableProfiling: false", "enableProfiling: true",
		"qps: 0", "qps: 7", "burst: 0", "burst: 9", "contentType: \"\"", "contentType: application/json",
		"syncPeriod: 0s", "syncPeriod: 20s", "minSyncPeriod: 0s", "minSyncPeriod: 2s", "configSyncPeriod: 0s", "configSyncPeriod: 5m",
		"masqueradeAll: false", "masqueradeAll: true", "masqueradeBit: null", "masqueradeBit: 13",
		"localhostNodePorts: null", "localhostNodePorts: false", "nodePortAddresses: null", "nodePortAddresses: [10.0.0.0/8]",
		"min: null", "min: 1000", "tcpEstablishedTimeout: null", "tcpEstablishedTimeout: 2h", "tcpCloseWaitTimeout: null", "tcpCloseWaitTimeout: 30m",
		"tcpBeLiberal: false", "tcpBeLiberal: true", "udpTimeout: 0s", "udpTimeout: 40s", "udpStreamTimeout: 0s", "udpStreamTimeout: 150s",
		"oomScoreAdj: null", "oomScoreAdj: -500", "verbosity: 0", "verbosity: 2", "interfaceNamePrefix: \"\"", "interfaceNamePrefix: veth",
	).Replace(kubeadm)
	e.restoreKpipeAtEnd()
	for _, file := range []struct{ name, text string }{{"kubeadm", kubeadm}, {"changed", changed}} {
		args := []string{"--config=" + configFile(t, file.text), "--hostname-override=" + testbed.NodeName}
		if err := e.k.Stop(); err != nil {
			t.Fatalf("stop kpipe: %v", err)
		}
		kp := e.kubeProxy("iptables")
		if err := kp.StartWith(args...); err != nil {
			t.Fatalf("start kube-proxy: %v", err)
		}
		upstream := configz(t)
		if err := kp.Stop(); err != nil {
			t.Fatalf("stop kube-proxy: %v", err)
		}
		e.startWith(args...)
		ours := configz(t)

		doc, _ := json.Marshal(upstream)
		t.Logf("%s: kube-proxy's /configz: %s", file.name, doc)
		if _, ok := upstream["kubeproxy.config.k8s.io"]; !ok {
			t.Fatalf("%s: kube-proxy's /configz has no kubeproxy.config.k8s.io", file.name)
		}
		if diff := configzDiff("", upstream, ours); len(diff) > 0 {
			sort.Strings(diff)
			got, _ := json.Marshal(ours)
			t.Errorf("%s: kpipe's /configz differs from kube-proxy's:\n%s\n--- kpipe's:\n%s", file.name, strings.Join(diff, "\n"), got)
		}
	}
}

// kube-proxy's own command line, as an upstream harness passes it (other modes'
// flags included), runs kpipe, which syncs and proxies.
func TestKubeProxyCommandLine(t *testing.T) {
	e := setup(t)
	e.startWith("--v=2", "--conntrack-max-per-core=0", "--kubeconfig="+tb.Kubeconfig, "--hostname-override="+testbed.NodeName)
	e.clusterIPAndNodePortAnswer()
}
