package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/health"
	"github.com/kpipe/kpipe/supervise"
)

// fakeDaemon serves what a running kpipe's listeners answer: /status and
// /configz on metrics, /healthz (with code) on healthz.
type fakeDaemon struct {
	metrics, healthz *httptest.Server
}

func newFakeDaemon(t *testing.T, st health.Status, ph health.ProxyHealth, healthzCode int) fakeDaemon {
	t.Helper()
	o := defaultOptions()
	o.ClusterCIDR, o.MinSyncPeriod = "10.244.0.0/16", 2*time.Second
	answer := func(code int, v any) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			_ = json.NewEncoder(w).Encode(v)
		}
	}
	metrics := http.NewServeMux()
	metrics.Handle("GET /status", answer(http.StatusOK, st))
	metrics.Handle("GET /configz", answer(http.StatusOK, map[string]any{health.ConfigzKey: o.configz()}))
	healthz := http.NewServeMux()
	healthz.Handle("GET /healthz", answer(healthzCode, ph))
	d := fakeDaemon{metrics: httptest.NewServer(metrics), healthz: httptest.NewServer(healthz)}
	t.Cleanup(d.metrics.Close)
	t.Cleanup(d.healthz.Close)
	return d
}

// args are kpipe status's flags for d's listeners.
func (d fakeDaemon) args() []string {
	return []string{"--metrics-address=" + d.metrics.Listener.Addr().String(), "--healthz-address=" + d.healthz.Listener.Addr().String()}
}

// runStatus runs `kpipe status args...` and returns its exit code, stdout and stderr.
func runStatus(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	code, stderr = captureStderr(t, func() int {
		var c int
		c, stdout = captureStdout(t, func() int {
			return runWith(append([]string{"status"}, args...), func(context.Context, *Options) error {
				t.Error("kpipe status ran the daemon")
				return nil
			})
		})
		return c
	})
	return code, stdout, stderr
}

// busyNode is a node as kpipe status sees it: one stage restarted once, IPv4
// synced with a service port without endpoints and 15 without local ones, a
// change pending, the last reload rejected.
func busyNode(now time.Time) health.Status {
	var remote []string
	for i := range 15 {
		remote = append(remote, fmt.Sprintf("ns/lb-%02d:http", i))
	}
	return health.Status{
		Node: "node-a",
		Stages: []health.StageStatus{
			{Status: supervise.Status{Name: "watch", Path: "kpipe/pipeline/watch", State: "running"}},
			{Status: supervise.Status{Name: "render-ipv4", Path: "kpipe/pipeline/families/ipv4/render-ipv4", State: "running", Restarts: 1,
				LastError: "killed"}, LastErrorAt: now.Add(-5 * time.Second)},
		},
		Families: []health.FamilyStatus{{
			Family: "IPv4", Generation: 42, LastSync: now.Add(-2 * time.Second), LastSyncSeconds: 0.012, LastFullSync: now.Add(-time.Minute),
			PendingSince: now.Add(-300 * time.Millisecond), PendingServices: 1, PendingEndpoints: 2,
			Unserved: bus.Unserved{
				NoEndpoints:      bus.Names{First: []string{"ns/empty:http"}, Total: 1},
				NoLocalEndpoints: bus.Names{First: remote, Total: len(remote)},
			},
		}},
		LastReload: &health.Reload{At: now.Add(-time.Minute), Error: "--config /etc/kpipe/config.conf: masqueradeBit: wrong type"},
	}
}

// TestStatusShowsOneScreen: kpipe status prints the node's health, a row per
// stage with its restarts and last error, each family's last sync, its
// duration and what is pending, the config in force, the last reload and the
// service ports without (local) endpoints, the list cut at 10 with "and N
// more"; exit 0.
func TestStatusShowsOneScreen(t *testing.T) {
	now := time.Now()
	healthy := health.ProxyHealth{Healthy: true, Status: map[string]health.ProxierHealth{"IPv4": {LastUpdated: now, Healthy: true}}}
	d := newFakeDaemon(t, busyNode(now), healthy, http.StatusOK)
	code, out, stderr := runStatus(t, d.args()...)
	if code != 0 || stderr != "" {
		t.Fatalf("kpipe status exited %d, stderr %q; want 0 and nothing", code, stderr)
	}
	t.Logf("kpipe status:\n%s", out)
	for _, want := range []string{
		`(?m)^node node-a: healthy$`,
		`(?m)^STAGE +STATE +RESTARTS +LAST ERROR$`,
		`(?m)^watch +running +0 +-$`,
		`(?m)^render-ipv4 +running +1 +killed \(5(\.\d)?s ago\)$`,
		`(?m)^IPv4 +2(\.\d)?s ago \(generation 42\) +12ms +1m0s ago +1 service, 2 endpoint changes, oldest 3\d\dms ago$`,
		`(?m)^config: mode iptables, clusterCIDR 10\.244\.0\.0/16, detectLocalMode ClusterCIDR, masqueradeAll false, nodePortAddresses all, syncPeriod 30s, minSyncPeriod 2s$`,
		`(?m)^last reload: FAILED 1m0s ago, the previous configuration kept: --config /etc/kpipe/config.conf: masqueradeBit: wrong type$`,
		`(?m)^IPv4 services without endpoints \(1\):\n  ns/empty:http$`,
		`(?m)^IPv4 services without local endpoints \(traffic policy Local\) \(15\):\n  ns/lb-00:http\n(  ns/lb-0\d:http\n){8}  ns/lb-09:http\n  and 5 more$`,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("kpipe status's output does not match %s", want)
		}
	}
}

// TestStatusSaysWhyUnhealthy: a 503 from /healthz is shown, with why (the
// family whose changes are pending too long, the node being deleted, the
// side stages that failed), not taken for an error: exit 0.
func TestStatusSaysWhyUnhealthy(t *testing.T) {
	now := time.Now()
	deleting := false
	sick := health.ProxyHealth{Healthy: false, NodeEligible: &deleting, Degraded: []string{"conntrack-ipv4"},
		Status: map[string]health.ProxierHealth{"IPv4": {LastUpdated: now.Add(-2 * time.Minute)}}}
	d := newFakeDaemon(t, busyNode(now), sick, http.StatusServiceUnavailable)
	code, out, stderr := runStatus(t, d.args()...)
	want := "node node-a: NOT healthy: IPv4 has had changes pending longer than the health timeout; the node is being deleted (degraded: conntrack-ipv4 failed recently)\n"
	if code != 0 || stderr != "" || !strings.HasPrefix(out, want) {
		t.Errorf("kpipe status on an unhealthy node: exit %d, stderr %q, output:\n%s\nwant exit 0, output starting %q", code, stderr, out, want)
	}

	d.healthz.Close() // the metrics listener answers, healthz does not
	code, out, _ = runStatus(t, d.args()...)
	want = fmt.Sprintf("node node-a: health unknown: no kpipe answers at %s: connection refused\n", d.healthz.Listener.Addr())
	if code != 0 || !strings.HasPrefix(out, want) {
		t.Errorf("kpipe status without healthz: exit %d, output:\n%s\nwant exit 0, output starting %q", code, out, want)
	}
}

// TestStatusWithoutDaemon: nothing listening on the metrics address is one
// line on stderr and exit 1, nothing on stdout.
func TestStatusWithoutDaemon(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	code, out, stderr := runStatus(t, "--metrics-address="+addr)
	if want := "kpipe: status: no kpipe answers at " + addr + ": connection refused\n"; code != 1 || stderr != want || out != "" {
		t.Errorf("kpipe status with no daemon: exit %d, stderr %q, stdout %q; want 1, %q and nothing", code, stderr, out, want)
	}
	code, _, stderr = runStatus(t, "--config=/nonexistent/kpipe.conf")
	if want := "kpipe: status: --config: open /nonexistent/kpipe.conf: no such file or directory\n"; code != 1 || stderr != want {
		t.Errorf("kpipe status with an unreadable config file: exit %d, stderr %q; want 1, %q", code, stderr, want)
	}
}

// TestStatusJSONAndConfigFile: --json prints the daemon's answers as one
// object; --config finds the listeners in the daemon's config file.
func TestStatusJSONAndConfigFile(t *testing.T) {
	now := time.Now()
	d := newFakeDaemon(t, busyNode(now), health.ProxyHealth{Healthy: true}, http.StatusOK)
	conf := filepath.Join(t.TempDir(), "config.conf")
	err := os.WriteFile(conf, []byte("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"+
		"metricsBindAddress: "+d.metrics.Listener.Addr().String()+"\nhealthzBindAddress: "+d.healthz.Listener.Addr().String()+"\n"), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	code, out, stderr := runStatus(t, "--json", "--config="+conf)
	var got statusAnswer
	if err := json.Unmarshal([]byte(out), &got); code != 0 || stderr != "" || err != nil {
		t.Fatalf("kpipe status --json: exit %d, stderr %q, %v, output:\n%s", code, stderr, err, out)
	}
	if got.Status.Node != "node-a" || len(got.Status.Stages) != 2 || got.Status.Stages[1].Restarts != 1 ||
		got.Status.Families[0].Unserved.NoLocalEndpoints.Total != 15 || got.Health == nil || !got.Health.Healthy ||
		got.Config == nil || got.Config.MinSyncPeriod.Duration != 2*time.Second {
		t.Errorf("kpipe status --json = %s; want the daemon's status, health and config", out)
	}
}
