package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
)

// TestServedMetricsAreKubeProxys: what /metrics serves has, besides kpipe's
// own, what kube-proxy's has from component-base, each name once: client-go's
// requests to the apiserver as it made them, kubernetes_build_info,
// kubernetes_feature_enabled, the Go runtime and process set.
func TestServedMetricsAreKubeProxys(t *testing.T) {
	apiserver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"kind":"NodeList","apiVersion":"v1","items":[]}`)
	}))
	defer apiserver.Close()
	o := defaultOptions()
	o.Master = apiserver.URL
	if err := o.complete(); err != nil {
		t.Fatal(err)
	}
	reg, _ := registerMetrics(o, []bus.Family{bus.IPv4}, slog.New(slog.DiscardHandler))
	host := strings.TrimPrefix(apiserver.URL, "http://")
	requests := map[string]string{"host": host, "method": "GET", "code": "200"}
	before := value(t, metrics.Served(reg), "rest_client_requests_total", requests)
	client, err := newClient(o)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := client.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if got := value(t, metrics.Served(reg), "rest_client_requests_total", requests); got != before+3 {
		t.Errorf("rest_client_requests_total%v = %v after 3 lists, want %v", requests, got, before+3)
	}
	major, minor, version := metrics.KubernetesRelease()
	for _, c := range []struct {
		name   string
		labels map[string]string
	}{
		{"rest_client_request_duration_seconds", map[string]string{"host": host, "verb": "GET"}},
		{"kubernetes_build_info", map[string]string{"major": major, "minor": minor, "git_version": version, "git_commit": getBuildInfo().GitCommit}},
		{"kubernetes_feature_enabled", map[string]string{"name": "ComponentSLIs", "stage": ""}},
		{"go_goroutines", nil},
		{"go_sched_gomaxprocs_threads", nil},
		{"process_start_time_seconds", nil},
		{"kpipe_build_info", nil},
	} {
		if got := value(t, metrics.Served(reg), c.name, c.labels); got <= 0 {
			t.Errorf("%s%v = %v, want a positive sample", c.name, c.labels, got)
		}
	}
}

// value is the sum of name's samples (a histogram's count) whose labels
// include labels; Gather failing (e.g. one name from both registries) fails t.
func value(t *testing.T, g interface {
	Gather() ([]*dto.MetricFamily, error)
}, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if hasLabels(m, labels) {
				sum += m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// hasLabels says whether m has labels (a label m lacks counts as "").
func hasLabels(m *dto.Metric, labels map[string]string) bool {
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	for k, v := range labels {
		if got[k] != v {
			return false
		}
	}
	return true
}
