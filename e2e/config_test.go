package e2e

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// kubeadmConfig is the KubeProxyConfiguration kubeadm v1.34 writes into the
// kube-proxy ConfigMap, pointed at this test bed (its kubeconfig and pod CIDR).
func kubeadmConfig(t *testing.T, extra ...string) string {
	t.Helper()
	b, err := os.ReadFile("../cmd/kpipe/testdata/kubeadm-kube-proxy.conf")
	if err != nil {
		t.Fatal(err)
	}
	cfg := strings.NewReplacer(
		"kubeconfig: /var/lib/kube-proxy/kubeconfig.conf", "kubeconfig: "+tb.Kubeconfig,
		"clusterCIDR: 10.244.0.0/16", "clusterCIDR: "+testbed.ClusterCIDR,
		`metricsBindAddress: ""`, "metricsBindAddress: 127.0.0.1:10249",
	).Replace(string(b)) + strings.Join(extra, "")
	path := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
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
// kpipe runs from the same two flags and the same file, and proxies.
func TestConfigKubeadmFile(t *testing.T) {
	e := setup(t)
	e.startWith("--config="+kubeadmConfig(t), "--hostname-override="+testbed.NodeName)
	e.clusterIPAndNodePortAnswer()
}

// A field kube-proxy's configuration does not have is an error naming it, and
// kpipe exits 2 (as for a bad flag) instead of running with half a configuration.
func TestConfigUnknownFieldExits2(t *testing.T) {
	if kpipeErr != nil {
		t.Fatalf("kpipe unavailable: %v", kpipeErr)
	}
	bin := tb.Kpipe().Bin
	cfg := kubeadmConfig(t, "masqueradeEverything: true\n")
	cmd := exec.Command(bin, "--config="+cfg, "--hostname-override="+testbed.NodeName)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("kpipe with an unknown field: %v, want exit 2; output:\n%s", err, out)
	}
	if !strings.Contains(string(out), "masqueradeEverything") {
		t.Errorf("output does not name the unknown field masqueradeEverything:\n%s", out)
	}
}

// kube-proxy's own command line, as an upstream harness passes it (other modes'
// flags included), runs kpipe, which syncs and proxies.
func TestKubeProxyCommandLine(t *testing.T) {
	e := setup(t)
	e.startWith("--v=2", "--conntrack-max-per-core=0", "--kubeconfig="+tb.Kubeconfig, "--hostname-override="+testbed.NodeName)
	e.clusterIPAndNodePortAnswer()
}
