package main

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
)

// TestBindAddressHardFail: kube-proxy's bindAddressHardFail (file) and
// --bind-address-hard-fail (flag, ignored beside a file, as in kube-proxy)
// reach the options the health stage is built from; kubeadm's file leaves it
// off.
func TestBindAddressHardFail(t *testing.T) {
	kubeadm := readKubeadmConfig(t)
	hardFail := writeFile(t, strings.Replace(kubeadm, "bindAddressHardFail: false", "bindAddressHardFail: true", 1))
	for _, c := range []struct {
		name string
		args []string
		want bool
	}{
		{"kubeadm file", []string{"--config=" + kubeadmConfig}, false},
		{"file", []string{"--config=" + hardFail}, true},
		{"flag", []string{"--bind-address-hard-fail"}, true},
		{"flag beside the file", []string{"--config=" + hardFail, "--bind-address-hard-fail=false"}, true},
	} {
		o, code, stderr := resolved(t, append(c.args, "--hostname-override=n")...)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", c.name, code, stderr)
		}
		if o.BindAddressHardFail != c.want {
			t.Errorf("%s: BindAddressHardFail = %v, want %v", c.name, o.BindAddressHardFail, c.want)
		}
	}
}

// TestBindHardFailStopsAtOnce: with bindAddressHardFail, a healthz or metrics
// port that is taken stops kpipe with the bind error (exit 1) before the
// supervisor restarts anything, and the Node carries kube-proxy's Warning for
// that server (after Starting) by the time kpipe returns.
func TestBindHardFailStopsAtOnce(t *testing.T) {
	for _, c := range []struct{ listener, reason string }{
		{"healthz", "FailedToStartProxierHealthcheck"},
		{"metrics", "FailedToStartMetricServer"},
	} {
		t.Run(c.listener, func(t *testing.T) {
			busy, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer busy.Close()
			taken := busy.Addr().String()
			o := defaultOptions()
			o.HostnameOverride, o.HealthzBindAddress, o.MetricsBindAddress = "node-1", "127.0.0.1:0", "127.0.0.1:0"
			if c.listener == "healthz" {
				o.HealthzBindAddress = taken
			} else {
				o.MetricsBindAddress = taken
			}
			o.BindAddressHardFail = true
			if err := o.complete(); err != nil {
				t.Fatal(err)
			}
			client := fake.NewClientset()
			var logs syncBuffer
			d := fakeDeps(client, fakekernel.New(), slog.New(slog.NewTextHandler(&logs, nil)))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- runReloading(ctx, o, d, nil, nil) }()

			err = waitStopOrRestart(t, done, func() float64 {
				return testutil.ToFloat64(d.metrics.StageRestarts.WithLabelValues(string(bus.Health)))
			}, &logs)
			if err == nil || !strings.Contains(err.Error(), taken) {
				t.Fatalf("kpipe stopped with %v, want the bind error naming %s", err, taken)
			}
			// Recorded before runReloading returned: a process that exits now keeps it.
			evs := nodeEventsNow(t, client, "node-1")
			if evs["Starting"] == nil {
				t.Errorf("no Starting event on the Node; events: %v", evs)
			}
			ev := evs[c.reason]
			if ev == nil {
				t.Fatalf("no %s event on the Node when kpipe stopped; events: %v", c.reason, evs)
			}
			if ev.Type != "Warning" || ev.Action != "StartKubeProxy" || ev.ReportingController != "kube-proxy" || ev.Note != err.Error() {
				t.Errorf("%s event: type %q action %q controller %q note %q, want Warning StartKubeProxy kube-proxy %q",
					c.reason, ev.Type, ev.Action, ev.ReportingController, ev.Note, err.Error())
			}
		})
	}
}

// waitStopOrRestart waits for done, failing the test if restarts() counts a
// restart first: a hard fail must not go through the supervisor's backoff.
func waitStopOrRestart(t *testing.T, done <-chan error, restarts func() float64, logs *syncBuffer) error {
	t.Helper()
	poll := time.NewTicker(5 * time.Millisecond)
	defer poll.Stop()
	hang := time.After(2 * time.Minute) // a guard against a hang, not a measure
	for {
		select {
		case err := <-done:
			return err
		case <-poll.C:
			if n := restarts(); n > 0 {
				t.Fatalf("the supervisor restarted the health stage (%v restarts) instead of kpipe stopping\n%s", n, logs.String())
			}
		case <-hang:
			t.Fatalf("kpipe neither stopped nor restarted the health stage\n%s", logs.String())
		}
	}
}

// nodeEventsNow are the events about Node node in "default" as they are now, by reason.
func nodeEventsNow(t *testing.T, client *fake.Clientset, node string) map[string]*eventsv1.Event {
	t.Helper()
	list, err := client.EventsV1().Events("default").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*eventsv1.Event{}
	for i, e := range list.Items {
		if e.Regarding.Kind == "Node" && e.Regarding.Name == node {
			out[e.Reason] = &list.Items[i]
		}
	}
	return out
}
