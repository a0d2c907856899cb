package health

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/netip"
	"strconv"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	kpevents "github.com/kpipe/kpipe/stages/events"
)

func loopback() []netip.Addr { return []netip.Addr{netip.MustParseAddr("127.0.0.1")} }

func hcAddr(port int32) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))) }

// freePort finds a loopback port nothing listens on (it may be taken again by the
// time it is used, which the tests would report as a failure to bind).
func freePort(t *testing.T) int32 {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return int32(ln.Addr().(*net.TCPAddr).Port)
}

func tryGet(url string) (response, error) {
	resp, err := client.Get(url)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{code: resp.StatusCode, header: resp.Header, body: string(body)}, nil
}

func hcBody(ns, name string, endpoints int, healthy bool) string {
	return fmt.Sprintf("{\n\t\"service\": {\n\t\t\"namespace\": %q,\n\t\t\"name\": %q\n\t},\n\t\"localEndpoints\": %d,\n\t\"serviceProxyHealthy\": %v\n}",
		ns, name, endpoints, healthy)
}

// waitAnswer polls a healthcheck port until it answers with body.
func waitAnswer(t *testing.T, port int32, body string) response {
	t.Helper()
	var r response
	bustest.Eventually(t, func() bool {
		var err error
		r, err = tryGet("http://" + hcAddr(port) + "/")
		return err == nil && r.body == body
	}, "port %d to answer %q", port, body)
	return r
}

// waitClosed polls until nothing answers on the port, then checks it can be bound.
func waitClosed(t *testing.T, port int32) {
	t.Helper()
	bustest.Eventually(t, func() bool {
		_, err := tryGet("http://" + hcAddr(port) + "/")
		return err != nil
	}, "port %d to close", port)
	ln, err := net.Listen("tcp", hcAddr(port))
	if err != nil {
		t.Fatalf("port %d closed but cannot be bound: %v", port, err)
	}
	ln.Close()
}

// checks are one family's health checks, served on loopback only.
func checks(f bus.Family, svcs map[bus.ServiceKey]bus.HealthCheck) bus.HealthCheckUpdates {
	return bus.HealthCheckUpdates{f: {Family: f, Services: svcs, Addrs: loopback()}}
}

func TestServiceHealthServers(t *testing.T) {
	hs := newHarness(t, Config{Families: []bus.Family{bus.IPv4, bus.IPv6}}, nil)
	hs.run(t)
	a := bus.ServiceKey{Namespace: "ns-a", Name: "a"}
	b := bus.ServiceKey{Namespace: "ns-b", Name: "b"}
	c := bus.ServiceKey{Namespace: "ns-c", Name: "c"}
	pa, pb, pa2 := freePort(t), freePort(t), freePort(t)

	// Opened: 503 without local endpoints, 200 with; c has no healthCheckNodePort.
	hs.checks.Put(checks(bus.IPv4, map[bus.ServiceKey]bus.HealthCheck{
		a: {NodePort: pa, LocalEndpoints: 0},
		b: {NodePort: pb, LocalEndpoints: 2},
		c: {NodePort: 0, LocalEndpoints: 1},
	}))
	r := waitAnswer(t, pa, hcBody("ns-a", "a", 0, true))
	if r.code != http.StatusServiceUnavailable {
		t.Errorf("a with 0 endpoints: code %d, want 503", r.code)
	}
	checkJSONHeaders(t, r)
	if w := r.header.Get("X-Load-Balancing-Endpoint-Weight"); w != "0" {
		t.Errorf("a: X-Load-Balancing-Endpoint-Weight = %q, want 0", w)
	}
	r = waitAnswer(t, pb, hcBody("ns-b", "b", 2, true))
	if r.code != http.StatusOK {
		t.Errorf("b with 2 endpoints: code %d, want 200", r.code)
	}
	checkJSONHeaders(t, r)
	if w := r.header.Get("X-Load-Balancing-Endpoint-Weight"); w != "2" {
		t.Errorf("b: X-Load-Balancing-Endpoint-Weight = %q, want 2", w)
	}
	// Any path, any method.
	if r := do(t, http.MethodPost, "http://"+hcAddr(pb)+"/some/path"); r.code != http.StatusOK || r.body != hcBody("ns-b", "b", 2, true) {
		t.Errorf("POST /some/path on b = %d %q", r.code, r.body)
	}

	// Keep a connection to a open, to see that updates do not reopen its server.
	var reused []bool
	keep := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{}}
	defer keep.CloseIdleConnections()
	getKeep := func() response {
		t.Helper()
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused = append(reused, i.Reused) }}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace),
			http.MethodGet, "http://"+hcAddr(pa)+"/", nil)
		resp, err := keep.Do(req)
		if err != nil {
			t.Fatalf("keep-alive GET: %v", err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return response{code: resp.StatusCode, body: string(body)}
	}
	getKeep()

	// The other family: the larger count wins, in place.
	hs.checks.Put(checks(bus.IPv6, map[bus.ServiceKey]bus.HealthCheck{
		a: {NodePort: pa, LocalEndpoints: 3},
	}))
	bustest.Eventually(t, func() bool { return getKeep().body == hcBody("ns-a", "a", 3, true) }, "a to count IPv6 endpoints")
	if r := getKeep(); r.code != http.StatusOK {
		t.Errorf("a with 3 endpoints: code %d", r.code)
	}
	r = waitAnswer(t, pb, hcBody("ns-b", "b", 2, true)) // IPv4's b is kept
	for i, ok := range reused[1:] {
		if !ok {
			t.Errorf("request %d on a did not reuse its connection: server reopened?", i+1)
		}
	}

	// Update IPv4: b drops to 0 endpoints, a moves port.
	hs.checks.Put(checks(bus.IPv4, map[bus.ServiceKey]bus.HealthCheck{
		a: {NodePort: pa2, LocalEndpoints: 1},
		b: {NodePort: pb, LocalEndpoints: 0},
	}))
	r = waitAnswer(t, pb, hcBody("ns-b", "b", 0, true))
	if r.code != http.StatusServiceUnavailable {
		t.Errorf("b with 0 endpoints: code %d, want 503", r.code)
	}
	// IPv6 still says a is on pa: the lowest family's port wins until IPv6 catches up.
	hs.checks.Put(checks(bus.IPv6, map[bus.ServiceKey]bus.HealthCheck{
		a: {NodePort: pa2, LocalEndpoints: 3},
	}))
	waitClosed(t, pa)
	if r := waitAnswer(t, pa2, hcBody("ns-a", "a", 3, true)); r.code != http.StatusOK {
		t.Errorf("a on its new port: code %d", r.code)
	}

	// Services gone from every family: their servers close and free the ports.
	hs.checks.Put(checks(bus.IPv6, nil))
	waitAnswer(t, pa2, hcBody("ns-a", "a", 1, true))
	hs.checks.Put(checks(bus.IPv4, map[bus.ServiceKey]bus.HealthCheck{}))
	waitClosed(t, pa2)
	waitClosed(t, pb)
}

func TestServiceHealthProxyUnhealthy(t *testing.T) {
	hs := newHarness(t, Config{SyncPeriod: time.Minute}, nil)
	hs.run(t)
	key := bus.ServiceKey{Namespace: "ns", Name: "svc"}
	port := freePort(t)
	hs.checks.Put(checks(bus.IPv4, map[bus.ServiceKey]bus.HealthCheck{key: {NodePort: port, LocalEndpoints: 4}}))
	if r := waitAnswer(t, port, hcBody("ns", "svc", 4, true)); r.code != http.StatusOK {
		t.Fatalf("healthy proxy: code %d", r.code)
	}

	// A node being deleted fails /healthz but not the proxy's own health.
	hs.board.Publish("watch", bus.Report{NodeDeleting: true})
	if r := waitAnswer(t, port, hcBody("ns", "svc", 4, true)); r.code != http.StatusOK {
		t.Errorf("node deleting: code %d, want 200", r.code)
	}

	// A change pending too long does.
	hs.board.Publish("coalesce-ipv4", bus.Report{PendingSince: testNow.Add(-3 * time.Minute)})
	if r := waitAnswer(t, port, hcBody("ns", "svc", 4, false)); r.code != http.StatusServiceUnavailable {
		t.Errorf("unhealthy proxy: code %d, want 503", r.code)
	}
	hs.board.Publish("coalesce-ipv4", bus.Report{})
	if r := waitAnswer(t, port, hcBody("ns", "svc", 4, true)); r.code != http.StatusOK {
		t.Errorf("healthy again: code %d", r.code)
	}
}

func TestServiceHealthBindFailure(t *testing.T) {
	hs := newHarness(t, Config{}, nil)
	stop := hs.run(t)
	a := bus.ServiceKey{Namespace: "ns", Name: "a"}
	b := bus.ServiceKey{Namespace: "ns", Name: "b"}
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pa := int32(busy.Addr().(*net.TCPAddr).Port)
	pb := freePort(t)
	want := map[bus.ServiceKey]bus.HealthCheck{
		a: {NodePort: pa, LocalEndpoints: 1},
		b: {NodePort: pb, LocalEndpoints: 1},
	}

	hs.checks.Put(checks(bus.IPv4, want))
	waitAnswer(t, pb, hcBody("ns", "b", 1, true)) // b serves although a cannot bind
	busy.Close()

	// The next update tries a again.
	hs.checks.Put(checks(bus.IPv4, want))
	waitAnswer(t, pa, hcBody("ns", "a", 1, true))
	waitAnswer(t, pb, hcBody("ns", "b", 1, true))
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	waitClosed(t, pa)
	waitClosed(t, pb)
}

func TestServiceHealthAllAddresses(t *testing.T) {
	hs := newHarness(t, Config{}, nil)
	stop := hs.run(t)
	key := bus.ServiceKey{Namespace: "ns", Name: "svc"}
	port := freePort(t)
	// No Addrs: every address.
	hs.checks.Put(bus.HealthCheckUpdates{bus.IPv4: {Family: bus.IPv4,
		Services: map[bus.ServiceKey]bus.HealthCheck{key: {NodePort: port, LocalEndpoints: 1}}}})
	waitAnswer(t, port, hcBody("ns", "svc", 1, true))
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, port)
	// Bound on every address: the wildcard must be free too.
	ln, err := net.Listen("tcp", net.JoinHostPort("", strconv.Itoa(int(port))))
	if err != nil {
		t.Fatalf("wildcard port %d not released: %v", port, err)
	}
	ln.Close()
}

// TestServiceHealthBindFailureRecordsEvent: a healthCheckNodePort that cannot be
// bound is kube-proxy's Warning FailedToStartServiceHealthcheck on the Service
// (action Listen, its note naming node, service and port); the service whose port
// binds gets none.
func TestServiceHealthBindFailureRecordsEvent(t *testing.T) {
	client := fake.NewClientset()
	b, rec, _ := kpevents.NewRecorder(client)
	defer b.Shutdown()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := b.StartRecordingToSinkWithContext(ctx); err != nil {
		t.Fatal(err)
	}
	hs := newHarness(t, Config{NodeName: "node-1"}, nil)
	hs.h.recorder = rec
	hs.run(t)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	pa, pb := int32(busy.Addr().(*net.TCPAddr).Port), freePort(t)
	hs.checks.Put(bus.HealthCheckUpdates{bus.IPv4: {Addrs: loopback(), Services: map[bus.ServiceKey]bus.HealthCheck{
		{Namespace: "ns", Name: "a"}: {NodePort: pa, LocalEndpoints: 1},
		{Namespace: "ns", Name: "b"}: {NodePort: pb, LocalEndpoints: 1},
	}}})
	waitAnswer(t, pb, hcBody("ns", "b", 1, true))

	var got []eventsv1.Event
	bustest.Eventually(t, func() bool {
		list, err := client.EventsV1().Events("ns").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got = list.Items
		return len(got) > 0
	}, "an event in namespace ns")
	ev := got[0]
	wantNote := fmt.Sprintf(`node node-1 failed to start healthcheck "ns/a" on port %d: listen tcp 127.0.0.1:%d: bind: address already in use`, pa, pa)
	if ev.Regarding.Kind != "Service" || ev.Regarding.Namespace != "ns" || ev.Regarding.Name != "a" || ev.Type != "Warning" ||
		ev.Reason != "FailedToStartServiceHealthcheck" || ev.Action != "Listen" || ev.Note != wantNote {
		t.Errorf("event: regarding %s %s/%s, type %q reason %q action %q note %q;\nwant Service ns/a, Warning FailedToStartServiceHealthcheck Listen %q",
			ev.Regarding.Kind, ev.Regarding.Namespace, ev.Regarding.Name, ev.Type, ev.Reason, ev.Action, ev.Note, wantNote)
	}
	for range 5 { // the service that serves never gets one
		list, err := client.EventsV1().Events("ns").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range list.Items {
			if e.Regarding.Name != "a" {
				t.Fatalf("event about %s/%s, which binds: %s", e.Regarding.Namespace, e.Regarding.Name, e.Note)
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
}
