package e2e

import (
	"encoding/json"
	"errors"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// TestStatus: `kpipe status`, the built binary run in the node's namespace
// against the running kpipe, with a Service that has an endpoint, one that
// has none and a NodePort with externalTrafficPolicy Local whose only
// endpoint is on another node: the node healthy, every stage of the debug
// listener's list running with no restart, both families' last syncs, the
// two unserved Services listed by name, each in its list, and the served
// one nowhere. After a stage is killed through the debug handler its row
// shows 1 restart and the kill. With no kpipe on the metrics address: one
// line on stderr, exit 1.
func TestStatus(t *testing.T) {
	e := setup(t)
	if err := e.k.Restart(); err != nil { // restart counts from zero: the kill below is the only one
		t.Fatalf("restart kpipe: %v", err)
	}
	port := testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort)
	served := e.service("served", port)
	e.endpoints(served, 1)
	e.service("empty", port)
	remoteOnly := typed(e.ns, "remote-only", corev1.ServiceTypeNodePort, port)
	remoteOnly.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	e.setEndpoints(e.create(remoteOnly), remote(3))
	waitAnswer(t, tcp(2*time.Second), tb.Pod(clientPod).NS, testbed.ClusterAddr(served, 80), 20*time.Second)
	empty, remoteLocal := e.ns+"/empty:http", e.ns+"/remote-only:http"
	waitStatusLists(t, e.k.Bin, empty, remoteLocal)

	out := kpipeStatus(t, e.k.Bin)
	t.Logf("kpipe status:\n%s", out)
	if want := "node " + testbed.NodeName + ": healthy\n"; !strings.HasPrefix(out, want) {
		t.Errorf("kpipe status does not start with %q", want)
	}
	stages, err := getStages()
	if err != nil {
		t.Fatal(err)
	}
	rows := stageRows(out)
	for _, s := range stages {
		if got := rows[s.Name]; !slices.Equal(got, []string{"running", "0", "-"}) {
			t.Errorf("stage %s's row: %q; want running, 0 restarts, no error", s.Name, got)
		}
	}
	if len(rows) != len(stages) {
		t.Errorf("kpipe status lists %d stages, the debug listener %d", len(rows), len(stages))
	}
	for _, family := range []string{"IPv4", "IPv6"} {
		if !regexp.MustCompile(`(?m)^` + family + ` +[0-9.hmµns]+ ago \(generation \d+\) +[0-9.mµs]+ +[0-9.hmµns]+ ago `).MatchString(out) {
			t.Errorf("no last sync, duration and last full sync shown for %s", family)
		}
	}
	if !regexp.MustCompile(`(?m)^IPv4 services without endpoints \(\d+\):\n(  .*\n)*  ` + regexp.QuoteMeta(empty) + `\n`).MatchString(out) {
		t.Errorf("%s not listed under the IPv4 services without endpoints", empty)
	}
	if !regexp.MustCompile(`(?m)^IPv4 services without local endpoints \(traffic policy Local\) \(\d+\):\n(  .*\n)*  ` + regexp.QuoteMeta(remoteLocal) + `\n`).MatchString(out) {
		t.Errorf("%s not listed under the IPv4 services without local endpoints", remoteLocal)
	}
	if strings.Contains(out, e.ns+"/served") || strings.Count(out, e.ns+"/") != 2 {
		t.Errorf("kpipe status lists %s/served, which has an endpoint, or a service twice", e.ns)
	}

	const killed = "conntrack-ipv4" // a side stage: restarted alone
	if killStages(t, []string{killed}) != 1 || !waitRunning([]string{killed}, 10*time.Second) {
		t.Fatalf("%s was not killed and restarted", killed)
	}
	out = kpipeStatus(t, e.k.Bin)
	t.Logf("kpipe status after %s was killed:\n%s", killed, out)
	if !regexp.MustCompile(`(?m)^` + killed + ` +running +1 +killed \([0-9.]+[mµ]?s ago\)$`).MatchString(out) {
		t.Errorf("%s's row does not show it running, restarted once, killed", killed)
	}
	if !strings.Contains(out, "(degraded: "+killed+" failed recently)") {
		t.Errorf("the header does not name %s as degraded", killed)
	}

	_, err = tb.Exec(tb.NodeNS, e.k.Bin, "status", "--metrics-address=127.0.0.1:1")
	var exit *exec.ExitError
	if want := ": kpipe: status: no kpipe answers at 127.0.0.1:1: connection refused"; !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.HasSuffix(err.Error(), want) {
		t.Errorf("kpipe status with nothing on its metrics address: %v; want exit 1 and stderr ending %q", err, want)
	}
}

// kpipeStatus is what `kpipe status` prints on the node.
func kpipeStatus(t *testing.T, bin string, args ...string) string {
	t.Helper()
	out, err := tb.Exec(tb.NodeNS, append([]string{bin, "status"}, args...)...)
	if err != nil {
		t.Fatalf("kpipe status: %v", err)
	}
	return out
}

// waitStatusLists waits until kpipe status --json lists noEndpoints without
// endpoints and noLocal without local endpoints (IPv4): the rules of both are in.
func waitStatusLists(t *testing.T, bin, noEndpoints, noLocal string) {
	t.Helper()
	err := testbed.Poll(20*time.Second, 200*time.Millisecond, func() error {
		var a struct {
			Status struct {
				Families []struct {
					Family   string
					Unserved struct{ NoEndpoints, NoLocalEndpoints struct{ First []string } }
				}
			}
		}
		if err := json.Unmarshal([]byte(kpipeStatus(t, bin, "--json")), &a); err != nil {
			return err
		}
		for _, f := range a.Status.Families {
			if f.Family == "IPv4" && slices.Contains(f.Unserved.NoEndpoints.First, noEndpoints) &&
				slices.Contains(f.Unserved.NoLocalEndpoints.First, noLocal) {
				return nil
			}
		}
		return errors.New("not listed yet")
	})
	if err != nil {
		t.Fatalf("kpipe status --json never listed %s and %s: %v", noEndpoints, noLocal, err)
	}
}

// stageRows are the STAGE table's rows of kpipe status's output: state,
// restarts and last error by stage name.
func stageRows(out string) map[string][]string {
	rows := map[string][]string{}
	table := strings.SplitN(out, "STAGE ", 2)
	if len(table) < 2 {
		return rows
	}
	lines := strings.Split(table[1], "\n")[1:]
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) == 0 {
			break
		}
		rows[f[0]] = []string{f[1], f[2], strings.Join(f[3:], " ")}
	}
	return rows
}
