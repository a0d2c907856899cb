package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// TestConfigFileEditTakesEffect: kpipe runs from kubeadm's config file. While a
// pod loops over a ClusterIP, the file is edited (replaced by rename, as an
// editor or a config manager does) from masqueradeAll: false to true: the pod's
// connections are masqueraded from then on, by the same process, and none
// fails. Then an edit with a field of the wrong type is rejected: kpipe goes on
// with the previous configuration (still masqueraded, every time), counts the
// rejection and records a Warning on its Node naming the field. An edit back to
// masqueradeAll: false with an unknown field applies (decoded leniently, as
// kube-proxy restarted on it would).
func TestConfigFileEditTakesEffect(t *testing.T) {
	e := setup(t)
	path := configFile(t, kubeadmConfigText(t))
	e.startWith("--config="+path, "--hostname-override="+testbed.NodeName)
	pid := e.k.PID()
	svc := e.service("echo", testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(svc, 1, 2)
	addr, pod := testbed.ClusterAddr(svc, 80), tb.Pod(clientPod)
	expectExactly(t, "masqueradeAll: false, a pod keeps its source", tcp2, pod.NS, addr, podIPs(1, 2), pod.IPv4)

	l := startLoop(tcp(2*time.Second), pod.NS, addr, 10*time.Millisecond)
	defer func() {
		if l != nil {
			l.finish()
		}
	}()
	original := readFile(t, path)
	masqAll := strings.Replace(original, "masqueradeAll: false", "masqueradeAll: true", 1)
	if masqAll == original {
		t.Fatalf("no 'masqueradeAll: false' in the kubeadm config:\n%s", original)
	}
	edited := time.Now()
	replaceFile(t, path, masqAll)
	expectExactly(t, "masqueradeAll: true after the edit, masqueraded", tcp2, pod.NS, addr, podIPs(1, 2), nodeAddrs4...)
	t.Logf("masqueradeAll: true in effect %v after the edit", since(edited))
	keepsAnswering(t, l, "after the edit")

	rejected := time.Now()
	wrongType := strings.Replace(original, "masqueradeBit: null", "masqueradeBit: fourteen", 1)
	if wrongType == original {
		t.Fatalf("no 'masqueradeBit: null' in the kubeadm config:\n%s", original)
	}
	replaceFile(t, path, wrongType)
	ev := e.waitNodeEvent("ConfigReloadFailed", rejected)
	if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Note, "masqueradeBit") {
		t.Errorf("ConfigReloadFailed event: type %q note %q, want a Warning naming the field of the wrong type", ev.Type, ev.Note)
	}
	if n := metricSum(t, "kpipe_config_reloads_total", map[string]string{"result": "failure"}); n != 1 {
		t.Errorf("kpipe_config_reloads_total{result=failure} = %v, want 1", n)
	}
	if v := metricSum(t, "kpipe_config_last_reload_successful", nil); v != 0 {
		t.Errorf("kpipe_config_last_reload_successful = %v after a rejected edit, want 0", v)
	}
	// The rejected file's masqueradeAll: false never applies: every series is
	// masqueraded at its first try (expectExactly would retry a lapse away).
	for i := range 5 {
		h, err := sample(tcp2, pod.NS, addr, samples(2))
		if err == nil {
			err = h.exactly(podIPs(1, 2))
		}
		if err == nil {
			err = h.sourcesIn(nodeAddrs4)
		}
		if err != nil {
			t.Fatalf("rejected edit, check %d: %v", i+1, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("rejected edit: 5 series of %d requests, every one masqueraded", samples(2))
	keepsAnswering(t, l, "after the rejected edit")

	replaceFile(t, path, original+"udpIdleTimeout: 250ms\n")
	expectExactly(t, "masqueradeAll: false again (with an unknown field), a pod keeps its source", tcp2, pod.NS, addr, podIPs(1, 2), pod.IPv4)
	keepsAnswering(t, l, "after the edit with an unknown field")

	l.finishWithNoFailure(t, "connections across the config edits")
	l = nil
	if got := e.k.PID(); got != pid {
		t.Errorf("kpipe's PID went from %d to %d: it restarted instead of reloading", pid, got)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// replaceFile replaces path's content at once: written beside it, renamed over it.
func replaceFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".new")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}
