package health

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	"github.com/kpipe/kpipe/metrics"
)

// harness is a Health wired to fresh bus values, with a fixed clock.
type harness struct {
	h       *Health
	board   *bus.Board
	reg     *prometheus.Registry
	metrics *metrics.Metrics
	checks  *bus.Mailbox[bus.HealthCheckUpdates]
	now     time.Time
}

var (
	testStarted = time.Date(2025, 1, 2, 3, 0, 0, 0, time.UTC)
	testNow     = testStarted.Add(10 * time.Minute)
)

func newHarness(t *testing.T, cfg Config, stages http.Handler) *harness {
	t.Helper()
	reg := prometheus.NewRegistry()
	hs := &harness{
		board:   bus.NewBoard(),
		reg:     reg,
		metrics: metrics.New(reg),
		checks:  bus.NewMergingMailbox(bus.MergeHealthCheckUpdates),
		now:     testNow,
	}
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	hs.h = NewStage(Params{Config: cfg, Board: hs.board, Gatherer: reg, Checks: hs.checks, Stages: stages,
		Env: bus.Env{Log: log, Metrics: hs.metrics}})
	hs.h.started = testStarted
	hs.h.now = func() time.Time { return testNow }
	hs.h.grace = time.Second
	return hs
}

// run starts Run and returns a stop function that cancels it and returns its error.
func (hs *harness) run(t *testing.T) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- hs.h.Run(ctx) }()
	stopped := false
	var err error
	stop = func() error {
		if stopped {
			return err
		}
		stopped = true
		cancel()
		select {
		case err = <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not return after cancel")
		}
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// addr waits for the named listener to be bound and returns its address.
func (hs *harness) addr(t *testing.T, name string) string {
	t.Helper()
	var a net.Addr
	bustest.Eventually(t, func() bool { a = hs.h.boundAddr(name); return a != nil }, "listener %s bound", name)
	return a.String()
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

var client = &http.Client{
	Timeout: 10 * time.Second,
	CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	},
	Transport: &http.Transport{DisableKeepAlives: true},
}

type response struct {
	code   int
	header http.Header
	body   string
}

func do(t *testing.T, method, url string) response { t.Helper(); return doBody(t, method, url, "") }

func doBody(t *testing.T, method, url, payload string) response {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(payload))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, url, err)
	}
	return response{code: resp.StatusCode, header: resp.Header, body: string(body)}
}

func get(t *testing.T, url string) response { t.Helper(); return do(t, http.MethodGet, url) }

func counter(t *testing.T, reg *prometheus.Registry, name, code string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "code" && l.GetValue() == code {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func checkJSONHeaders(t *testing.T, r response) {
	t.Helper()
	if got := r.header.Values("Content-Type"); len(got) != 1 || got[0] != "application/json" {
		t.Errorf("Content-Type = %q, want application/json", got)
	}
	if got := r.header.Values("X-Content-Type-Options"); len(got) != 1 || got[0] != "nosniff" {
		t.Errorf("X-Content-Type-Options = %q, want nosniff", got)
	}
}

func TestHealthzAndLivez(t *testing.T) {
	const timeout = 2 * time.Minute
	ago := func(d time.Duration) time.Time { return testNow.Add(-d) }
	tests := []struct {
		name        string
		families    []bus.Family
		reports     map[bus.StageName]bus.Report
		healthzCode int
		livezCode   int
		healthz     string // exact /healthz body
		livez       string // exact /livez body
	}{{
		name:        "starting",
		healthzCode: http.StatusOK,
		livezCode:   http.StatusOK,
		healthz:     `{"lastUpdated":"2025-01-02T03:10:00Z","currentTime":"2025-01-02T03:10:00Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:00:00Z","healthy":true}}}`,
		livez:       `{"lastUpdated":"2025-01-02T03:10:00Z","currentTime":"2025-01-02T03:10:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:00:00Z","healthy":true}}}`,
	}, {
		name: "synced",
		reports: map[bus.StageName]bus.Report{
			"commit-ipv4":   {LastSync: ago(30 * time.Second)},
			"coalesce-ipv4": {LastQueued: ago(31 * time.Second)},
		},
		healthzCode: http.StatusOK,
		livezCode:   http.StatusOK,
		healthz:     `{"lastUpdated":"2025-01-02T03:10:00Z","currentTime":"2025-01-02T03:10:00Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true}}}`,
		livez:       `{"lastUpdated":"2025-01-02T03:10:00Z","currentTime":"2025-01-02T03:10:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true}}}`,
	}, {
		name: "pending too long",
		reports: map[bus.StageName]bus.Report{
			"commit-ipv4":   {LastSync: ago(5 * time.Minute)},
			"coalesce-ipv4": {PendingSince: ago(timeout + time.Second)},
		},
		healthzCode: http.StatusServiceUnavailable,
		livezCode:   http.StatusServiceUnavailable,
		healthz:     `{"lastUpdated":"2025-01-02T03:05:00Z","currentTime":"2025-01-02T03:10:00Z","nodeEligible":true,"healthy":false,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:05:00Z","healthy":false}}}`,
		livez:       `{"lastUpdated":"2025-01-02T03:05:00Z","currentTime":"2025-01-02T03:10:00Z","healthy":false,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:05:00Z","healthy":false}}}`,
	}, {
		name: "node deleting",
		reports: map[bus.StageName]bus.Report{
			"watch":       {NodeDeleting: true},
			"commit-ipv4": {LastSync: ago(30 * time.Second)},
		},
		healthzCode: http.StatusServiceUnavailable,
		livezCode:   http.StatusOK,
		healthz:     `{"lastUpdated":"2025-01-02T03:09:30Z","currentTime":"2025-01-02T03:10:00Z","nodeEligible":false,"healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true}}}`,
		livez:       `{"lastUpdated":"2025-01-02T03:10:00Z","currentTime":"2025-01-02T03:10:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true}}}`,
	}, {
		name:     "dual-stack, IPv6 late",
		families: []bus.Family{bus.IPv4, bus.IPv6},
		reports: map[bus.StageName]bus.Report{
			"commit-ipv4":   {LastSync: ago(30 * time.Second)},
			"commit-ipv6":   {LastSync: ago(5 * time.Minute)},
			"coalesce-ipv6": {PendingSince: ago(4 * time.Minute)},
		},
		healthzCode: http.StatusServiceUnavailable,
		livezCode:   http.StatusServiceUnavailable,
		healthz:     `{"lastUpdated":"2025-01-02T03:09:30Z","currentTime":"2025-01-02T03:10:00Z","nodeEligible":true,"healthy":false,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true},"IPv6":{"lastUpdated":"2025-01-02T03:05:00Z","healthy":false}}}`,
		livez:       `{"lastUpdated":"2025-01-02T03:09:30Z","currentTime":"2025-01-02T03:10:00Z","healthy":false,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true},"IPv6":{"lastUpdated":"2025-01-02T03:05:00Z","healthy":false}}}`,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hs := newHarness(t, Config{HealthzAddr: "127.0.0.1:0", SyncPeriod: time.Minute, Families: tt.families}, nil)
			for name, r := range tt.reports {
				hs.board.Publish(name, r)
			}
			hs.run(t)
			base := "http://" + hs.addr(t, healthzListener)

			r := get(t, base+"/healthz")
			if r.code != tt.healthzCode {
				t.Errorf("/healthz code = %d, want %d", r.code, tt.healthzCode)
			}
			checkJSONHeaders(t, r)
			if r.body != tt.healthz {
				t.Errorf("/healthz body:\n got %s\nwant %s", r.body, tt.healthz)
			}
			if got := counter(t, hs.reg, "kubeproxy_proxy_healthz_total", "200"); got != b2f(tt.healthzCode == 200) {
				t.Errorf("healthz_total{code=200} = %v", got)
			}
			if got := counter(t, hs.reg, "kubeproxy_proxy_healthz_total", "503"); got != b2f(tt.healthzCode == 503) {
				t.Errorf("healthz_total{code=503} = %v", got)
			}

			r = get(t, base+"/livez")
			if r.code != tt.livezCode {
				t.Errorf("/livez code = %d, want %d", r.code, tt.livezCode)
			}
			checkJSONHeaders(t, r)
			if r.body != tt.livez {
				t.Errorf("/livez body:\n got %s\nwant %s", r.body, tt.livez)
			}
			if got := counter(t, hs.reg, "kubeproxy_proxy_livez_total", "200"); got != b2f(tt.livezCode == 200) {
				t.Errorf("livez_total{code=200} = %v", got)
			}
			if got := counter(t, hs.reg, "kubeproxy_proxy_livez_total", "503"); got != b2f(tt.livezCode == 503) {
				t.Errorf("livez_total{code=503} = %v", got)
			}

			// Any method, as kube-proxy; other paths are not found.
			if r := do(t, http.MethodHead, base+"/healthz"); r.code != tt.healthzCode {
				t.Errorf("HEAD /healthz code = %d, want %d", r.code, tt.healthzCode)
			}
			if r := get(t, base+"/metrics"); r.code != http.StatusNotFound {
				t.Errorf("/metrics on the healthz listener: code %d, want 404", r.code)
			}
		})
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func TestHealthzFollowsBoard(t *testing.T) {
	hs := newHarness(t, Config{HealthzAddr: "127.0.0.1:0", SyncPeriod: time.Minute}, nil)
	hs.run(t)
	url := "http://" + hs.addr(t, healthzListener) + "/healthz"
	if r := get(t, url); r.code != http.StatusOK {
		t.Fatalf("starting: code %d", r.code)
	}
	hs.board.Publish("coalesce-ipv4", bus.Report{PendingSince: testNow.Add(-3 * time.Minute)})
	if r := get(t, url); r.code != http.StatusServiceUnavailable {
		t.Fatalf("pending too long: code %d", r.code)
	}
	hs.board.Publish("coalesce-ipv4", bus.Report{})
	hs.board.Publish("commit-ipv4", bus.Report{LastSync: testNow.Add(-time.Second)})
	if r := get(t, url); r.code != http.StatusOK {
		t.Fatalf("synced again: code %d", r.code)
	}
	hs.board.Update("watch", func(r *bus.Report) { r.NodeDeleting = true })
	if r := get(t, url); r.code != http.StatusServiceUnavailable {
		t.Fatalf("node deleting: code %d", r.code)
	}
	if got := counter(t, hs.reg, "kubeproxy_proxy_healthz_total", "200"); got != 2 {
		t.Errorf("healthz_total{code=200} = %v, want 2", got)
	}
	if got := counter(t, hs.reg, "kubeproxy_proxy_healthz_total", "503"); got != 2 {
		t.Errorf("healthz_total{code=503} = %v, want 2", got)
	}
}

type fakeStages struct{ calls chan string }

func (f fakeStages) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	select {
	case f.calls <- r.Method + " " + r.URL.Path:
	default:
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `[{"name":"watch"}]`)
}

func TestMetricsListener(t *testing.T) {
	stages := fakeStages{calls: make(chan string, 10)}
	hs := newHarness(t, Config{
		MetricsAddr: "127.0.0.1:0",
		Configz:     map[string]any{"mode": "iptables", "syncPeriod": "30s"},
	}, stages)
	hs.metrics.LastSync.WithLabelValues("IPv4").Set(1234)
	hs.run(t)
	base := "http://" + hs.addr(t, metricsListener)

	r := get(t, base+"/proxyMode")
	if r.code != http.StatusOK || r.body != "iptables" {
		t.Errorf("/proxyMode = %d %q, want 200 iptables", r.code, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "text/plain; charset=utf-8" {
		t.Errorf("/proxyMode Content-Type = %q", ct)
	}
	if v := r.header.Get("X-Content-Type-Options"); v != "nosniff" {
		t.Errorf("/proxyMode X-Content-Type-Options = %q", v)
	}

	r = get(t, base+"/metrics")
	if r.code != http.StatusOK {
		t.Errorf("/metrics code %d", r.code)
	}
	if !strings.Contains(r.body, `kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1234`) {
		t.Errorf("/metrics lacks the registered gauge:\n%s", r.body)
	}

	r = get(t, base+"/configz")
	if r.code != http.StatusOK {
		t.Errorf("/configz code %d", r.code)
	}
	checkJSONHeaders(t, r)
	if want := `{"kubeproxy.config.k8s.io":{"mode":"iptables","syncPeriod":"30s"}}`; r.body != want {
		t.Errorf("/configz body = %s, want %s", r.body, want)
	}

	r = get(t, base+"/healthz")
	if r.code != http.StatusOK || r.body != "ok" {
		t.Errorf("/healthz = %d %q, want 200 ok", r.code, r.body)
	}
	if r := get(t, base+"/healthz?verbose"); r.body != "[+]ping ok\nhealthz check passed\n" {
		t.Errorf("/healthz?verbose = %q", r.body)
	}
	if r := get(t, base+"/healthz/ping"); r.code != http.StatusOK || r.body != "ok" {
		t.Errorf("/healthz/ping = %d %q", r.code, r.body)
	}

	// Without Profiling: no pprof; never the stages handler.
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/goroutine", "/debug/pprof/profile"} {
		if r := get(t, base+path); r.code != http.StatusNotFound {
			t.Errorf("%s without Profiling: code %d, want 404", path, r.code)
		}
	}
	checkNoStages(t, base, stages)
	if r := get(t, base+"/livez"); r.code != http.StatusNotFound {
		t.Errorf("/livez on the metrics listener: code %d, want 404", r.code)
	}
}

func TestConfigzEmpty(t *testing.T) {
	hs := newHarness(t, Config{MetricsAddr: "127.0.0.1:0"}, nil)
	hs.run(t)
	r := get(t, "http://"+hs.addr(t, metricsListener)+"/configz")
	if r.code != http.StatusOK || r.body != "{}" {
		t.Errorf("/configz = %d %s, want 200 {}", r.code, r.body)
	}
}

// checkPprof: the profiling handlers answer on base.
func checkPprof(t *testing.T, base string) {
	t.Helper()
	r := get(t, base+"/debug/pprof/")
	if r.code != http.StatusOK || !strings.Contains(r.body, "goroutine") {
		t.Errorf("/debug/pprof/ = %d, body lacks goroutine:\n%s", r.code, r.body)
	}
	r = get(t, base+"/debug/pprof/goroutine?debug=1")
	if r.code != http.StatusOK || !strings.Contains(r.body, "goroutine profile:") {
		t.Errorf("/debug/pprof/goroutine?debug=1 = %d %.200q", r.code, r.body)
	}
	if r := get(t, base+"/debug/pprof/symbol"); r.code != http.StatusOK {
		t.Errorf("/debug/pprof/symbol code %d", r.code)
	}
	r = get(t, base+"/debug/pprof")
	if r.code != http.StatusFound || r.header.Get("Location") != "/debug/pprof/" {
		t.Errorf("/debug/pprof = %d Location %q, want 302 /debug/pprof/", r.code, r.header.Get("Location"))
	}
}

// checkNoStages: neither GET /debug/stages nor the kill endpoint reach the stages
// handler on base.
func checkNoStages(t *testing.T, base string, stages fakeStages) {
	t.Helper()
	for _, req := range [][2]string{{http.MethodGet, "/debug/stages"}, {http.MethodPost, "/debug/stages/commit-ipv4/kill"}} {
		if r := do(t, req[0], base+req[1]); r.code != http.StatusNotFound {
			t.Errorf("%s %s: code %d, want 404", req[0], req[1], r.code)
		}
	}
	select {
	case c := <-stages.calls:
		t.Errorf("stages handler called on %s: %s", base, c)
	default:
	}
}

// TestDebugListener: the debug listener serves pprof, /debug/stages and the kill
// endpoint; the metrics listener beside it serves none of them.
func TestDebugListener(t *testing.T) {
	stages := fakeStages{calls: make(chan string, 10)}
	hs := newHarness(t, Config{MetricsAddr: "127.0.0.1:0", DebugAddr: "127.0.0.1:0"}, stages)
	hs.run(t)
	base := "http://" + hs.addr(t, debugListener)
	checkPprof(t, base)

	r := get(t, base+"/debug/stages")
	if r.code != http.StatusOK || r.body != `[{"name":"watch"}]` {
		t.Errorf("/debug/stages = %d %s", r.code, r.body)
	}
	if c := <-stages.calls; c != "GET /debug/stages" {
		t.Errorf("stages handler saw %q", c)
	}
	if r := do(t, http.MethodPost, base+"/debug/stages/commit-ipv4/kill"); r.code != http.StatusOK {
		t.Errorf("POST /debug/stages/commit-ipv4/kill code %d", r.code)
	}
	if c := <-stages.calls; c != "POST /debug/stages/commit-ipv4/kill" {
		t.Errorf("stages handler saw %q", c)
	}
	for _, path := range []string{"/metrics", "/healthz", "/configz"} {
		if r := get(t, base+path); r.code != http.StatusNotFound {
			t.Errorf("%s on the debug listener: code %d, want 404", path, r.code)
		}
	}

	metrics := "http://" + hs.addr(t, metricsListener)
	checkNoStages(t, metrics, stages)
	if r := get(t, metrics+"/debug/pprof/"); r.code != http.StatusNotFound {
		t.Errorf("/debug/pprof/ on the metrics listener without Profiling: code %d, want 404", r.code)
	}
}

// TestProfilingOnMetrics: kube-proxy's --profiling serves pprof on the metrics
// listener, and never the stages handler (nor a debug listener).
func TestProfilingOnMetrics(t *testing.T) {
	stages := fakeStages{calls: make(chan string, 10)}
	hs := newHarness(t, Config{MetricsAddr: "127.0.0.1:0", HealthzAddr: "127.0.0.1:0", Profiling: true}, stages)
	hs.run(t)
	base := "http://" + hs.addr(t, metricsListener)
	checkPprof(t, base)
	checkNoStages(t, base, stages)
	checkNoStages(t, "http://"+hs.addr(t, healthzListener), stages)
	if a := hs.h.boundAddr(debugListener); a != nil {
		t.Errorf("debug listener bound at %v without DebugAddr", a)
	}
}

func TestRunReleasesPorts(t *testing.T) {
	port := freePort(t)
	key := bus.ServiceKey{Namespace: "ns", Name: "svc"}
	hs := newHarness(t, Config{
		HealthzAddr: "127.0.0.1:0",
		MetricsAddr: "127.0.0.1:0",
		DebugAddr:   "127.0.0.1:0",
	}, nil)
	hs.checks.Put(checks(bus.IPv4, map[bus.ServiceKey]bus.HealthCheck{key: {NodePort: port, LocalEndpoints: 1}}))
	stop := hs.run(t)
	healthz, metrics, debug := hs.addr(t, healthzListener), hs.addr(t, metricsListener), hs.addr(t, debugListener)
	hcURL := "http://" + hcAddr(port) + "/"
	bustest.Eventually(t, func() bool { _, err := tryGet(hcURL); return err == nil }, "healthcheck port open")
	if r := get(t, "http://"+healthz+"/healthz"); r.code != http.StatusOK {
		t.Fatalf("/healthz code %d", r.code)
	}

	if err := stop(); err != nil {
		t.Fatalf("Run after cancel = %v, want nil", err)
	}
	if a := hs.h.boundAddr(healthzListener); a != nil {
		t.Errorf("healthz still reported bound at %v", a)
	}
	for _, addr := range []string{healthz, metrics, debug, hcAddr(port)} {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Errorf("rebind %s after Run returned: %v", addr, err)
			continue
		}
		ln.Close()
	}

	// A restarted Run serves again, reopening the healthcheck servers from what the
	// first Run took, though the mailbox is now empty.
	hs.h.cfg.HealthzAddr, hs.h.cfg.MetricsAddr, hs.h.cfg.DebugAddr = healthz, metrics, debug
	stop = hs.run(t)
	if got := hs.addr(t, healthzListener); got != healthz {
		t.Errorf("restarted healthz on %s, want %s", got, healthz)
	}
	hs.addr(t, metricsListener)
	var r response
	bustest.Eventually(t, func() bool { var err error; r, err = tryGet(hcURL); return err == nil }, "healthcheck reopened")
	if r.code != http.StatusOK {
		t.Errorf("reopened healthcheck code %d", r.code)
	}
	if err := stop(); err != nil {
		t.Fatalf("second Run = %v", err)
	}
}

// TestRunRetriesBindInBackground: without BindHardFail a listener whose port is
// taken does not stop the stage; it binds and serves once the port is freed, and the
// other listener serves meanwhile.
func TestRunRetriesBindInBackground(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := busy.Addr().String()
	hs := newHarness(t, Config{HealthzAddr: "127.0.0.1:0", MetricsAddr: metricsAddr}, nil)
	hs.h.after = func(time.Duration) <-chan time.Time { return time.After(20 * time.Millisecond) }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- hs.h.Run(ctx) }()
	healthzURL := "http://" + hs.addr(t, healthzListener) + "/healthz"
	// The stage keeps running and serving healthz while the metrics port is taken.
	for range 10 {
		select {
		case err := <-done:
			t.Fatalf("Run returned %v with the metrics port taken; want it to keep retrying", err)
		case <-time.After(50 * time.Millisecond):
		}
		if _, err := tryGet(healthzURL); err != nil {
			t.Fatalf("healthz not served while metrics retries: %v", err)
		}
		if a := hs.h.boundAddr(metricsListener); a != nil {
			t.Fatalf("metrics bound to %v while the port is taken", a)
		}
	}
	busy.Close()
	bustest.Eventually(t, func() bool {
		r, err := tryGet("http://" + metricsAddr + "/metrics")
		return err == nil && r.code == http.StatusOK
	}, "metrics served after the port was freed")
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run = %v after cancel", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

// TestRunListenErrorHardFail: with BindHardFail (kube-proxy's bindAddressHardFail)
// a taken port makes Run fail, releasing the listener it had bound.
func TestRunListenErrorHardFail(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	// healthz binds first, so Run must release it when metrics fails.
	healthz := hcAddr(freePort(t))
	hs := newHarness(t, Config{HealthzAddr: healthz, MetricsAddr: busy.Addr().String(), BindHardFail: true}, nil)
	done := make(chan error, 1)
	go func() { done <- hs.h.Run(context.Background()) }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Run = nil with the metrics port taken")
		}
		var opErr *net.OpError
		if !errors.As(err, &opErr) {
			t.Errorf("Run = %v, want a wrapped *net.OpError", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not fail with the metrics port taken")
	}
	ln, err := net.Listen("tcp", healthz)
	if err != nil {
		t.Fatalf("healthz port not released: %v", err)
	}
	ln.Close()
}

// TestHealthzNamesDegradedSideStagesWithoutTheirErrors: a side stage that failed
// within the health timeout is named in the /healthz and /livez bodies, never with
// its error (the healthz port listens on 0.0.0.0, where every pod can read it: the
// errors stay on the debug listener's /debug/stages and in the log), and never
// changes the code.
func TestHealthzNamesDegradedSideStagesWithoutTheirErrors(t *testing.T) {
	ago := func(d time.Duration) time.Time { return testNow.Add(-d) }
	hs := newHarness(t, Config{HealthzAddr: "127.0.0.1:0", SyncPeriod: time.Minute,
		SideStages: []bus.StageName{"conntrack-ipv4", "canary", "conntrack-ipv6"}}, nil)
	const secret = "iptables: stderr secret"
	hs.board.Publish("commit-ipv4", bus.Report{LastSync: ago(30 * time.Second), Errors: 1, LastError: "restore failed: " + secret, LastErrorAt: ago(time.Second)})
	hs.board.Publish("conntrack-ipv4", bus.Report{Errors: 3, LastError: "conntrack: " + secret, LastErrorAt: ago(10 * time.Second)})
	hs.board.Publish("canary", bus.Report{Errors: 1, LastError: "canary: old failure", LastErrorAt: ago(2*time.Minute + time.Second)})
	hs.run(t)
	base := "http://" + hs.addr(t, healthzListener)
	noSecret := func(path string, r response) {
		t.Helper()
		if strings.Contains(r.body, "secret") {
			t.Errorf("%s body carries a stage's error text: %s", path, r.body)
		}
	}

	const degraded = `"degraded":["conntrack-ipv4"]`
	r := get(t, base+"/healthz")
	noSecret("/healthz", r)
	if want := `{"lastUpdated":"2025-01-02T03:10:00Z","currentTime":"2025-01-02T03:10:00Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true}},` + degraded + `}`; r.code != http.StatusOK || r.body != want {
		t.Errorf("/healthz = %d\n got %s\nwant 200 %s", r.code, r.body, want)
	}
	r = get(t, base+"/livez")
	noSecret("/livez", r)
	if want := `{"lastUpdated":"2025-01-02T03:10:00Z","currentTime":"2025-01-02T03:10:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2025-01-02T03:09:30Z","healthy":true}},` + degraded + `}`; r.code != http.StatusOK || r.body != want {
		t.Errorf("/livez = %d\n got %s\nwant 200 %s", r.code, r.body, want)
	}

	// Unhealthy for kube-proxy's reasons: still 503, still naming the side stage,
	// still without its error.
	hs.board.Publish("coalesce-ipv4", bus.Report{PendingSince: ago(3 * time.Minute)})
	for _, path := range []string{"/healthz", "/livez"} {
		r := get(t, base+path)
		noSecret(path, r)
		if r.code != http.StatusServiceUnavailable || !strings.Contains(r.body, degraded) {
			t.Errorf("%s with a change pending too long = %d %s; want 503 naming conntrack-ipv4", path, r.code, r.body)
		}
	}

	// The failure ages out of the timeout: the field goes away.
	hs.board.Publish("coalesce-ipv4", bus.Report{})
	hs.board.Update("conntrack-ipv4", func(r *bus.Report) { r.LastErrorAt = ago(2 * time.Minute) })
	for _, path := range []string{"/healthz", "/livez"} {
		if r := get(t, base+path); r.code != http.StatusOK || strings.Contains(r.body, "degraded") {
			t.Errorf("%s after the failure aged out = %d %s; want 200 without degraded", path, r.code, r.body)
		}
	}
}

// TestBindRetryEveryFiveSeconds: without BindHardFail a taken port is tried
// again every 5 s, as kube-proxy's servers are (wait.Until's period), not with
// a growing backoff.
func TestBindRetryEveryFiveSeconds(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	hs := newHarness(t, Config{MetricsAddr: busy.Addr().String()}, nil)
	waits := make(chan time.Duration)
	hs.h.after = func(d time.Duration) <-chan time.Time {
		waits <- d
		fired := make(chan time.Time, 1)
		fired <- time.Time{}
		return fired
	}
	stop := hs.run(t)
	for i := range 4 {
		if d := <-waits; d != 5*time.Second {
			t.Errorf("wait %d before binding again = %v, want 5s", i+1, d)
		}
	}
	go func() { // let Run's retry loop see the cancel
		for range waits {
		}
	}()
	if err := stop(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	close(waits)
}
