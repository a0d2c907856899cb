package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// renderArgs are the daemon's flags the render tests run with.
var renderArgs = []string{"--hostname-override", "n1", "--cluster-cidr", "10.244.0.0/16,fd00:10:244::/48"}

// runRenderCaptured runs `kpipe render args...` and returns its exit code,
// stdout and stderr.
func runRenderCaptured(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	code, stderr = captureStderr(t, func() int {
		var c int
		c, stdout = captureStdout(t, func() int { return run(append([]string{"render"}, args...)) })
		return c
	})
	return code, stdout, stderr
}

// kpipe render --manifests prints, per family, the rules the daemon renders for
// the directory's objects: the Services it proxies (not another proxy's), an
// endpoint on this node behind its own chain, one on another node inline, the
// invalid parts skipped and counted.
func TestRenderManifests(t *testing.T) {
	code, out, stderr := runRenderCaptured(t, append([]string{"--manifests", "testdata/render"}, renderArgs...)...)
	if code != 0 {
		t.Fatalf("exit %d; stderr %q", code, stderr)
	}
	if want := "kpipe render: 1 invalid parts of objects skipped, as the daemon skips them\n"; stderr != want {
		t.Errorf("stderr %q; want %q", stderr, want)
	}
	sets, err := nf.ParseRulesets([]byte(out))
	if err != nil {
		t.Fatalf("the output does not read back: %v\n%s", err, out)
	}
	if len(sets) == 0 || sets[0].Family != bus.IPv4 || !strings.HasPrefix(out, "# kpipe render IPv4\n*nat\n") {
		t.Fatalf("the output does not start with IPv4's nat table:\n%s", out)
	}
	nat := sets[0].Table(nf.TableNAT)
	web := nat.Chain(nf.ServiceChain(nf.PrefixService, bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: "default", Name: "web"}, Port: "http", Protocol: bus.TCP}))
	sep := nat.Chain(nf.EndpointName(bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: "default", Name: "web"}, Port: "http", Protocol: bus.TCP}, "10.244.0.10:8080"))
	dns := nat.Chain(nf.ServiceChain(nf.PrefixService, bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: "kube-system", Name: "dns"}, Port: "dns", Protocol: bus.UDP}))
	switch {
	case web == nil || sep == nil || dns == nil:
		t.Fatalf("web's service chain, its endpoint's chain or dns's service chain missing:\n%s", out)
	case !strings.Contains(strings.Join(sep.Rules, "\n"), "-j DNAT --to-destination 10.244.0.10:8080"):
		t.Errorf("web's endpoint chain does not DNAT to its pod: %q", sep.Rules)
	case !strings.Contains(strings.Join(dns.Rules, "\n"), "-j DNAT --to-destination 10.244.9.5:53"):
		t.Errorf("dns's endpoint on another node is not DNATed inline: %q", dns.Rules)
	case strings.Contains(out, "10.96.0.20"):
		t.Errorf("the Service of another proxy is rendered:\n%s", out)
	case nat.Chain("PREROUTING") == nil || !strings.Contains(out, `-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`):
		t.Errorf("no jump from PREROUTING:\n%s", out)
	}
}

// A node the manifests have no Node for is rendered as the daemon renders
// before it sees its Node, and said so.
func TestRenderManifestsWithoutTheNode(t *testing.T) {
	code, _, stderr := runRenderCaptured(t, "--manifests", "testdata/render", "--hostname-override", "n2", "--cluster-cidr", "10.244.0.0/16")
	if code != 0 || !strings.Contains(stderr, `kpipe render: no Node "n2"`) {
		t.Errorf("exit %d, stderr %q; want 0 and the missing Node named", code, stderr)
	}
}

// Bad input is one line on stderr naming what is wrong, exit 1, nothing on stdout.
func TestRenderBadInput(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		sub := filepath.Join(dir, strings.TrimSuffix(name, filepath.Ext(name)))
		if err := os.MkdirAll(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sub, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return sub
	}
	unreachable := filepath.Join(write("kubeconfig.yaml", `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
users: [{name: u, user: {token: t}}]
current-context: c
`), "kubeconfig.yaml")
	t.Setenv("KUBERNETES_SERVICE_HOST", "") // not in a cluster
	for _, tc := range []struct {
		name    string
		args    []string
		mention string
	}{
		{"no such directory", []string{"--manifests", filepath.Join(dir, "none")}, "no such file or directory"},
		{"not YAML", []string{"--manifests", write("bad.yaml", "kind: [unclosed\n")}, "bad.yaml: not a Kubernetes object"},
		{"another kind", []string{"--manifests", write("pod.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")},
			"pod.yaml: a Pod (v1) is not a Service, EndpointSlice or Node"},
		{"both sources", []string{"--manifests", "testdata/render", "--kubeconfig", unreachable}, "give one source of objects"},
		{"neither source", nil, "give --kubeconfig or --manifests"},
		{"apiserver unreachable", []string{"--kubeconfig", unreachable}, "list Services"},
		{"bad daemon flag", []string{"--manifests", "testdata/render", "--iptables-masquerade-bit", "40"}, "--iptables-masquerade-bit"},
		{"arguments", []string{"--manifests", "testdata/render", "extra"}, "extra"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runRenderCaptured(t, append(tc.args, "--hostname-override", "n1")...)
			if code != 1 || stdout != "" {
				t.Errorf("exit %d, stdout %q; want 1 and nothing", code, stdout)
			}
			if !strings.HasPrefix(stderr, "kpipe: render: ") || strings.Count(stderr, "\n") != 1 || !strings.Contains(stderr, tc.mention) {
				t.Errorf("stderr %q; want one line \"kpipe: render: ...\" naming %q", stderr, tc.mention)
			}
		})
	}
}
