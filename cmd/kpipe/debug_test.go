package main

import (
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"github.com/kpipe/kpipe/stages/commit/fakekernel"
)

// TestListenerDefaults: metrics on 127.0.0.1:10249; the debug handlers nowhere
// without --enable-debug-handlers, and on loopback with it unless an address is
// given; --profiling (kube-proxy's) never enables them.
func TestListenerDefaults(t *testing.T) {
	for _, tt := range []struct {
		args      []string
		debug     string
		profiling bool
	}{
		{args: nil, debug: ""},
		{args: []string{"--debug-bind-address", "0.0.0.0:7000"}, debug: ""},
		{args: []string{"--profiling"}, debug: "", profiling: true},
		{args: []string{"--enable-debug-handlers"}, debug: "127.0.0.1:10247"},
		{args: []string{"--enable-debug-handlers", "--debug-bind-address", "10.1.2.3"}, debug: "10.1.2.3:10247"},
		{args: []string{"--enable-debug-handlers", "--debug-bind-address", "::1"}, debug: "[::1]:10247"},
		{args: []string{"--enable-debug-handlers", "--debug-bind-address", "0.0.0.0:7000"}, debug: "0.0.0.0:7000"},
	} {
		o, err := parse(t, append([]string{"--hostname-override", "n"}, tt.args...)...)
		if err != nil {
			t.Fatal(err)
		}
		if o.MetricsBindAddress != "127.0.0.1:10249" {
			t.Errorf("%q: metrics on %s; want 127.0.0.1:10249", tt.args, o.MetricsBindAddress)
		}
		if got := o.debugAddr(); got != tt.debug {
			t.Errorf("%q: debug handlers on %q; want %q", tt.args, got, tt.debug)
		}
		if o.EnableProfiling != tt.profiling {
			t.Errorf("%q: profiling %v; want %v", tt.args, o.EnableProfiling, tt.profiling)
		}
	}
	o := defaultOptions()
	if ap, err := netip.ParseAddrPort(o.DebugBindAddress); err != nil || !ap.Addr().IsLoopback() {
		t.Errorf("default --debug-bind-address %q: want a loopback address", o.DebugBindAddress)
	}
}

// TestKillEndpointOnlyWithDebugHandlers runs the real tree on real listeners: with
// kpipe's defaults no listener answers GET /debug/stages or the kill endpoint;
// --profiling adds pprof to the metrics listener and still no stages;
// --enable-debug-handlers serves both on the debug listener only.
func TestKillEndpointOnlyWithDebugHandlers(t *testing.T) {
	for _, tt := range []struct {
		name         string
		profiling    bool
		debug        bool
		metricsPprof int
	}{
		{name: "defaults", metricsPprof: http.StatusNotFound},
		{name: "profiling", profiling: true, metricsPprof: http.StatusOK},
		{name: "debug handlers", debug: true, metricsPprof: http.StatusNotFound},
	} {
		t.Run(tt.name, func(t *testing.T) {
			healthz, metrics, debug := freeAddr(t), freeAddr(t), freeAddr(t)
			o := defaultOptions()
			o.HostnameOverride, o.HealthzBindAddress, o.MetricsBindAddress = "node-1", healthz, metrics
			o.EnableProfiling, o.EnableDebugHandlers, o.DebugBindAddress = tt.profiling, tt.debug, debug
			if err := o.complete(); err != nil {
				t.Fatal(err)
			}
			var logs syncBuffer
			client, _ := watchedClient()
			runInBackground(t, &logs, buildTree(o, fakeDeps(client, fakekernel.New(), slog.New(slog.NewTextHandler(&logs, nil)))).Run)
			waitServing(t, "http://"+healthz+"/healthz")
			waitServing(t, "http://"+metrics+"/metrics")

			for _, addr := range []string{healthz, metrics} {
				checkCode(t, http.MethodPost, "http://"+addr+"/debug/stages/watch/kill", http.StatusNotFound)
				checkCode(t, http.MethodGet, "http://"+addr+"/debug/stages", http.StatusNotFound)
			}
			checkCode(t, http.MethodGet, "http://"+metrics+"/debug/pprof/", tt.metricsPprof)
			if !tt.debug {
				// Held over half a second, not seen once: a listener bound late is caught too.
				for range 5 {
					if conn, err := net.DialTimeout("tcp", debug, time.Second); err == nil {
						conn.Close()
						t.Fatalf("something listens on the debug address %s without --enable-debug-handlers", debug)
					}
					time.Sleep(100 * time.Millisecond)
				}
				return
			}
			waitServing(t, "http://"+debug+"/debug/stages")
			checkCode(t, http.MethodGet, "http://"+debug+"/debug/pprof/", http.StatusOK)
			checkCode(t, http.MethodPost, "http://"+debug+"/debug/stages/canary/kill", http.StatusOK)
		})
	}
}

// freeAddr is a 127.0.0.1 address with a port free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(ln.Addr().(*net.TCPAddr).Port))
}

func waitServing(t *testing.T, url string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not served: %v", url, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func checkCode(t *testing.T, method, url string, want int) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Errorf("%s %s: %v", method, url, err)
		return
	}
	resp.Body.Close()
	if resp.StatusCode != want {
		t.Errorf("%s %s: %d; want %d", method, url, resp.StatusCode, want)
	}
}
