package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// nodeEventsSince lists the events with reason about the test bed's Node in
// namespace default (where kube-proxy's events about its Node go) dated from since.
func (e *env) nodeEventsSince(reason string, since time.Time) ([]eventsv1.Event, error) {
	ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
	defer cancel()
	list, err := tb.Client().EventsV1().Events("default").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var out []eventsv1.Event
	for _, ev := range list.Items {
		if ev.Reason == reason && ev.Regarding.Kind == "Node" && ev.Regarding.Name == testbed.NodeName && !ev.EventTime.Time.Before(since) {
			out = append(out, ev)
		}
	}
	return out, nil
}

// waitNodeEvent waits for an event with reason about the Node dated from since.
func (e *env) waitNodeEvent(reason string, since time.Time) eventsv1.Event {
	e.t.Helper()
	var got eventsv1.Event
	testbed.Eventually(e.t, 30*time.Second, func() error {
		evs, err := e.nodeEventsSince(reason, since)
		if err != nil {
			return err
		}
		if len(evs) == 0 {
			return fmt.Errorf("no %s event about Node %s since %s", reason, testbed.NodeName, since.Format(time.RFC3339))
		}
		got = evs[0]
		return nil
	})
	return got
}

// TestEventsStarting: a started kpipe records kube-proxy's Starting event on its
// Node in the apiserver — events.k8s.io/v1, namespace default, reported by
// kube-proxy — so `kubectl events` and dashboards made for kube-proxy see it.
func TestEventsStarting(t *testing.T) {
	e := setup(t)
	// A fresh start, dated: the event must come from this process.
	started := time.Now().Add(-time.Second)
	if err := tb.Kpipe().Restart(); err != nil {
		t.Fatalf("restart kpipe: %v", err)
	}
	ev := e.waitNodeEvent("Starting", started)
	if ev.Type != "Normal" || ev.ReportingController != "kube-proxy" || ev.Action != "StartKubeProxy" {
		t.Fatalf("Starting event %s: type %q controller %q action %q, want Normal kube-proxy StartKubeProxy",
			ev.Name, ev.Type, ev.ReportingController, ev.Action)
	}
}

const conntrackMaxSysctl = "/proc/sys/net/netfilter/nf_conntrack_max"

// A node set-up step that fails (nf_conntrack_max is global: the node's network
// namespace cannot write it) is a Warning event on the Node once kpipe has its
// client; a start whose set-up all succeeds (--conntrack-max-per-core=0 leaves
// nf_conntrack_max alone) records none.
func TestEventsNodeSetupFailure(t *testing.T) {
	e := setup(t)
	e.restoreKpipeAtEnd()
	if out, err := tb.Exec(tb.NodeNS, "sh", "-c", "cat "+conntrackMaxSysctl+" > "+conntrackMaxSysctl); err == nil {
		t.Fatalf("%s is writable in the node namespace: this test needs a set-up step that fails (%s)", conntrackMaxSysctl, out)
	}
	// The OOM score kpipe inherits: lowering it needs CAP_SYS_RESOURCE, which a
	// test machine in a container may lack.
	oom, err := os.ReadFile("/proc/self/oom_score_adj")
	if err != nil {
		t.Fatal(err)
	}
	oomFlag := "--oom-score-adj=" + strings.TrimSpace(string(oom))

	started := time.Now() // the events of earlier starts are older
	if err := e.k.Restart("--conntrack-max-per-core=0", oomFlag); err != nil {
		t.Fatalf("restart kpipe: %v", err)
	}
	e.waitNodeEvent("Starting", started)
	for range 6 { // the set-up events are recorded right after Starting
		if evs, err := e.nodeEventsSince("NodeSetupFailed", started); err != nil || len(evs) > 0 {
			t.Fatalf("set-up events after a start with nothing failing: %v %v", evs, err)
		}
		time.Sleep(500 * time.Millisecond)
	}

	started = time.Now()
	if err := e.k.Restart(oomFlag); err != nil { // the default 32768 per core: nf_conntrack_max is written
		t.Fatalf("restart kpipe: %v", err)
	}
	ev := e.waitNodeEvent("NodeSetupFailed", started)
	if ev.Type != "Warning" || ev.ReportingController != "kube-proxy" || ev.Action != "SetSysctl/net/netfilter/nf_conntrack_max" ||
		!strings.Contains(ev.Note, "nf_conntrack_max") {
		t.Fatalf("set-up event %s: type %q controller %q action %q note %q, want a Warning from kube-proxy about nf_conntrack_max",
			ev.Name, ev.Type, ev.ReportingController, ev.Action, ev.Note)
	}
	t.Logf("set-up event: %s", ev.Note)
	if evs, err := e.nodeEventsSince("NodeSetupFailed", started); err != nil || len(evs) != 1 {
		t.Errorf("%d set-up events (%v), want 1 (only nf_conntrack_max fails): %v", len(evs), err, evs)
	}
}

// occupyPort binds addr (TCP) in the node's namespace, as another program
// would, until release is called or the test ends.
func occupyPort(t *testing.T, addr string) (release func()) {
	t.Helper()
	var ln net.Listener
	if err := tb.InNamespace(tb.NodeNS, func() (err error) {
		ln, err = net.Listen("tcp", addr)
		return err
	}); err != nil {
		t.Fatalf("occupy %s in the node namespace: %v", addr, err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	var once sync.Once
	release = func() { once.Do(func() { ln.Close() }) }
	t.Cleanup(release)
	return release
}

// healthzAddr is where the test bed's kpipe serves /healthz.
const healthzAddr = "0.0.0.0:10256"

// With --bind-address-hard-fail, a healthz port another program holds stops
// kpipe at once with exit 1, and kube-proxy's Warning
// FailedToStartProxierHealthcheck is on the Node by the time it has exited.
func TestEventsBindHardFail(t *testing.T) {
	e := setup(t)
	e.restoreKpipeAtEnd()
	if err := e.k.Stop(); err != nil {
		t.Fatalf("stop kpipe: %v", err)
	}
	occupyPort(t, healthzAddr)
	started := time.Now()
	code, out := runKpipeOnce(t, append(e.k.Args, "--bind-address-hard-fail")...)
	if code != 1 {
		t.Fatalf("kpipe with the healthz port taken and --bind-address-hard-fail: exit %d, want 1; output:\n%s", code, out)
	}
	t.Logf("kpipe exited 1 %v after it started", since(started))
	evs, err := e.nodeEventsSince("FailedToStartProxierHealthcheck", started)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 1 {
		t.Fatalf("%d FailedToStartProxierHealthcheck events on the Node once kpipe exited, want 1: %v", len(evs), evs)
	}
	ev := evs[0]
	if ev.Type != "Warning" || ev.ReportingController != "kube-proxy" || ev.Action != "StartKubeProxy" ||
		!strings.Contains(ev.Note, "10256") || !strings.Contains(ev.Note, "address already in use") {
		t.Errorf("event %s: type %q controller %q action %q note %q, want a Warning from kube-proxy, action StartKubeProxy, naming port 10256 in use",
			ev.Name, ev.Type, ev.ReportingController, ev.Action, ev.Note)
	}
	t.Logf("event: %s", ev.Note)
}

// Without --bind-address-hard-fail, as kube-proxy, kpipe keeps running with its
// healthz port taken: it programs rules, records no Warning (kube-proxy records
// FailedToStartProxierHealthcheck only when it exits for it), and serves
// /healthz once the port is free (tried every 5 s).
func TestEventsBindRetriedWithoutHardFail(t *testing.T) {
	e := setup(t)
	e.restoreKpipeAtEnd()
	if err := e.k.Stop(); err != nil {
		t.Fatalf("stop kpipe: %v", err)
	}
	release := occupyPort(t, healthzAddr)
	started := time.Now()
	startErr := make(chan error, 1)
	go func() { startErr <- e.k.Start() }() // returns once /healthz answers: after release
	e.answeringEcho()
	for range 6 {
		if !e.k.Running() {
			t.Fatalf("kpipe exited with its healthz port taken:\n%s", e.k.LogTail(30))
		}
		if evs, err := e.nodeEventsSince("FailedToStartProxierHealthcheck", started); err != nil || len(evs) > 0 {
			t.Fatalf("FailedToStartProxierHealthcheck without --bind-address-hard-fail: %v %v", evs, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	release()
	if err := <-startErr; err != nil {
		t.Fatalf("kpipe did not serve /healthz once the port was free: %v", err)
	}
}

// A healthCheckNodePort another program holds on the node is kube-proxy's
// Warning FailedToStartServiceHealthcheck on the Service (action Listen); the
// service's NodePort keeps working, and the health check is served once the
// port is free.
func TestEventsServiceHealthcheckBindFailure(t *testing.T) {
	e := setup(t)
	const hcPort = 32123
	release := occupyPort(t, fmt.Sprintf("0.0.0.0:%d", hcPort))
	spec := typed(e.ns, "hc-taken", corev1.ServiceTypeLoadBalancer, testbed.Port("tcp", corev1.ProtocolTCP, 80, testbed.EchoPort))
	spec.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	spec.Spec.HealthCheckNodePort = hcPort
	svc := e.create(spec)
	e.setEndpoints(svc, local(1, 2))

	var ev eventsv1.Event
	testbed.Eventually(t, 30*time.Second, func() error {
		list, err := tb.Client().EventsV1().Events(e.ns).List(e.ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, x := range list.Items {
			if x.Reason == "FailedToStartServiceHealthcheck" && x.Regarding.Kind == "Service" && x.Regarding.Name == svc.Name {
				ev = x
				return nil
			}
		}
		return fmt.Errorf("no FailedToStartServiceHealthcheck event about Service %s/%s (%d events)", e.ns, svc.Name, len(list.Items))
	})
	wantNote := fmt.Sprintf("node %s failed to start healthcheck %q on port %d", testbed.NodeName, e.ns+"/"+svc.Name, hcPort)
	if ev.Type != "Warning" || ev.ReportingController != "kube-proxy" || ev.Action != "Listen" || !strings.HasPrefix(ev.Note, wantNote) {
		t.Errorf("event %s: type %q controller %q action %q note %q, want a Warning from kube-proxy, action Listen, note %q...",
			ev.Name, ev.Type, ev.ReportingController, ev.Action, ev.Note, wantNote)
	}
	t.Logf("event: %s", ev.Note)

	np := testbed.NodePortOf(svc, "tcp")
	expectExactly(t, "NodePort with the healthCheckNodePort taken", tcp2, tb.ClientNS,
		testbed.HostPort(testbed.NodeIPv4, np), podIPs(1, 2), testbed.ClientIPv4)

	release()
	url := "http://" + net.JoinHostPort(testbed.NodeIPv4, strconv.Itoa(hcPort)) + "/healthz"
	testbed.Eventually(t, 30*time.Second, func() error {
		resp, err := tb.HTTPClient(tb.ClientNS, 2*time.Second).Get(url)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("GET %s: HTTP %d, want 200", url, resp.StatusCode)
		}
		return nil
	})
}
