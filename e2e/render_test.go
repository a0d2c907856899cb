package e2e

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/e2e/testbed"
	nf "github.com/kpipe/kpipe/netfilter"
)

// kpipe render --diff in the node namespace, with the daemon's own flags: on
// a node kpipe has synced (ClusterIPs, a LoadBalancer with
// externalTrafficPolicy Local, externalIPs and local and remote endpoints, a
// dual-stack NodePort with session affinity) it prints nothing and exits 0;
// with kpipe stopped
// and one Service changed in the apiserver (its port, then another's
// endpoints) it prints exactly that Service's chains (and the bucket chain
// that dispatches to it) and exits 2; once kpipe runs again it is empty.
func TestRenderDiff(t *testing.T) {
	e := setup(t)
	echo, _, client := e.answeringEcho()
	other := e.service("other", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	e.endpoints(other, 3)
	waitAnswer(t, tcp(2*time.Second), client, testbed.ClusterAddr(other, 80), 20*time.Second)
	e.externalTrafficPolicyLocal()
	sticky := typed(e.ns, "sticky", corev1.ServiceTypeNodePort, testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))
	sticky.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
	sticky = e.create(dualStack(sticky))
	e.setEndpoints(sticky, tb.ReadyEndpoints(1, 2))
	e.setEndpoints(sticky, tb.ReadyEndpoints6(1, 2))
	t.Cleanup(func() {
		if !e.k.Running() {
			if err := e.k.Start(); err != nil {
				t.Errorf("cleanup: start kpipe: %v", err)
			}
		}
	})

	waitNoDiff(t, e)

	if err := e.k.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.UpdateService(e.ctx, e.ns, "other", func(s *corev1.Service) { s.Spec.Ports[0].Port = 81 }); err != nil {
		t.Fatal(err)
	}
	otherPort := portName(e.ns, "other", "http")
	clusterIP := netip.MustParseAddr(other.Spec.ClusterIP)
	requireDiffOf(t, e, []string{nf.ServiceChain(nf.PrefixService, otherPort), nf.BucketChain(nf.Bucket(clusterIP))}, e.ns+"/other:http")

	if err := e.k.Start(); err != nil {
		t.Fatal(err)
	}
	waitNoDiff(t, e)

	// An endpoint moved: pod 2 out, pod 3 in.
	if err := e.k.Stop(); err != nil {
		t.Fatal(err)
	}
	e.endpoints(echo, 1, 3)
	echoPort := portName(e.ns, "echo", "http")
	endpoint := func(pod int) string { return nf.EndpointName(echoPort, testbed.HostPort(podIP(pod), testbed.EchoPort)) }
	requireDiffOf(t, e, []string{nf.ServiceChain(nf.PrefixService, echoPort), endpoint(2), endpoint(3)}, e.ns+"/echo:http")

	if err := e.k.Start(); err != nil {
		t.Fatal(err)
	}
	waitNoDiff(t, e)
}

func portName(ns, name, port string) bus.ServicePortName {
	return bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: ns, Name: name}, Port: port, Protocol: bus.TCP}
}

// renderDiff runs `kpipe render --diff` with the daemon's current flags in
// the node namespace.
func renderDiff(t *testing.T, e *env) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	argv := append([]string{"netns", "exec", tb.NodeNS, e.k.Bin, "render", "--diff"}, e.k.CurrentArgs()...)
	cmd := exec.CommandContext(ctx, "ip", argv...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit) && ctx.Err() == nil:
		code = exit.ExitCode()
	default:
		t.Fatalf("kpipe render --diff: %v\n%s", err, errOut.String())
	}
	return code, out.String(), errOut.String()
}

// waitNoDiff waits (10 s at most, for kpipe's sync) until render --diff
// prints nothing, on stdout or stderr, and exits 0, for quietRuns runs in a
// row: "nothing differs" must not pass on one lucky run.
func waitNoDiff(t *testing.T, e *env) {
	t.Helper()
	const quietRuns = 3
	deadline := time.Now().Add(10 * time.Second)
	for quiet := 0; quiet < quietRuns; {
		code, stdout, stderr := renderDiff(t, e)
		if code == 0 && stdout == "" && stderr == "" {
			quiet++
			continue
		}
		if quiet > 0 || time.Now().After(deadline) {
			t.Fatalf("render --diff on a synced node (after %d quiet runs): exit %d, stdout:\n%s\nstderr:\n%s", quiet, code, stdout, stderr)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

var hunkHeader = regexp.MustCompile(`(?m)^@@ (\S+) (\S+) @@$`)

// requireDiffOf runs render --diff once and requires exit 2 and a diff of
// exactly the chains want (nat), every changed rule one of the Service port
// named in comment's.
func requireDiffOf(t *testing.T, e *env, want []string, comment string) {
	t.Helper()
	code, stdout, stderr := renderDiff(t, e)
	t.Logf("render --diff: exit %d\n%s", code, stdout)
	if code != 2 || stderr != "" || !strings.HasPrefix(stdout, "--- live IPv4\n+++ rendered IPv4\n") {
		t.Fatalf("exit %d, stderr %q; want 2, nothing, and IPv4's diff", code, stderr)
	}
	var got []string
	for _, m := range hunkHeader.FindAllStringSubmatch(stdout, -1) {
		if m[1] != nf.TableNAT {
			t.Errorf("a chain of table %s differs: %s", m[1], m[0])
		}
		got = append(got, m[2])
	}
	slices.Sort(got)
	want = slices.Sorted(slices.Values(want))
	if !slices.Equal(got, want) {
		t.Errorf("chains in the diff %q; want %q", got, want)
	}
	for _, line := range strings.Split(stdout, "\n") {
		if rule, ok := strings.CutPrefix(line, "+-A "); ok && !strings.Contains(rule, comment) {
			t.Errorf("a rendered rule not of %s: %s", comment, line)
		}
		if rule, ok := strings.CutPrefix(line, "--A "); ok && !strings.Contains(rule, comment) {
			t.Errorf("a live rule not of %s: %s", comment, line)
		}
	}
}
