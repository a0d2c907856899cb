package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// TestMetricsPerFamily: on the dual-stack node each family's sync is its own
// series, labelled as kube-proxy labels it, so a dashboard built on
// kube-proxy's metrics reads kpipe's.
func TestMetricsPerFamily(t *testing.T) {
	e := setup(t)
	svc := e.create(dualStack(testbed.Service(e.ns, "metrics-families", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))))
	e.setEndpoints(svc, tb.ReadyEndpoints(1))
	e.setEndpoints(svc, tb.ReadyEndpoints6(1))
	for _, family := range []string{"IPv4", "IPv6"} {
		labels := map[string]string{"ip_family": family}
		testbed.Eventually(t, 15*time.Second, func() error {
			if n := metricSum(t, "kubeproxy_sync_proxy_rules_duration_seconds_count", labels); n < 1 {
				return fmt.Errorf("no %s sync in kubeproxy_sync_proxy_rules_duration_seconds", family)
			}
			if ts := metricSum(t, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", labels); ts <= 0 {
				return fmt.Errorf("kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=%q} = %v", family, ts)
			}
			if n := metricSum(t, "kubeproxy_sync_proxy_rules_iptables_total", map[string]string{"ip_family": family, "table": "nat"}); n < 1 {
				return fmt.Errorf("kubeproxy_sync_proxy_rules_iptables_total{ip_family=%q,table=\"nat\"} = %v", family, n)
			}
			return nil
		})
	}
	// Every series carries a family: the families are never summed into one.
	m, err := kpipeMetrics()
	if err != nil {
		t.Fatal(err)
	}
	for key := range m {
		if testbed.SampleOf(key, "kubeproxy_sync_proxy_rules_duration_seconds_count", nil) &&
			!strings.Contains(key, `ip_family="IPv4"`) && !strings.Contains(key, `ip_family="IPv6"`) {
			t.Errorf("a sync duration series without a family: %s", key)
		}
	}
}

// TestMetricsBuildInfo: the running kpipe's /metrics says which build it is
// (the test bed's is unstamped, built by this Go), as kube-proxy's
// kubernetes_build_info does.
func TestMetricsBuildInfo(t *testing.T) {
	setup(t)
	labels := map[string]string{"git_version": "v0.0.0-dev", "go_version": runtime.Version(), "platform": runtime.GOOS + "/" + runtime.GOARCH}
	if n := metricSum(t, "kpipe_build_info", labels); n != 1 {
		t.Errorf("kpipe_build_info%v = %v, want 1", labels, n)
	}
}

// TestMetricsNetworkProgrammingLatency: an EndpointSlice carrying the
// endpoints.kubernetes.io/last-change-trigger-time annotation is counted, once
// programmed, in its own family's kubeproxy_network_programming_duration_seconds.
func TestMetricsNetworkProgrammingLatency(t *testing.T) {
	e := setup(t)
	svc := e.create(dualStack(testbed.Service(e.ns, "metrics-programming", testbed.Port("http", corev1.ProtocolTCP, 80, testbed.EchoPort))))
	for _, c := range []struct {
		family string
		eps    []testbed.Endpoint
	}{{"IPv4", tb.ReadyEndpoints(1)}, {"IPv6", tb.ReadyEndpoints6(1)}} {
		labels := map[string]string{"ip_family": c.family}
		before := metricSum(t, "kubeproxy_network_programming_duration_seconds_count", labels)
		slice := testbed.EndpointSlice(svc, "", c.eps)
		// RFC 3339 with fractions, as the EndpointSlice controller writes it: whole
		// seconds could date the change before kpipe started, which is not counted.
		slice.Annotations = map[string]string{corev1.EndpointsLastChangeTriggerTime: time.Now().UTC().Format(time.RFC3339Nano)}
		if _, err := tb.ApplyEndpointSlice(e.ctx, slice); err != nil {
			t.Fatal(err)
		}
		testbed.Eventually(t, 15*time.Second, func() error {
			if n := metricSum(t, "kubeproxy_network_programming_duration_seconds_count", labels); n <= before {
				return fmt.Errorf("no new %s sample in kubeproxy_network_programming_duration_seconds (count %v)", c.family, n)
			}
			return nil
		})
		// The sample is the time from the trigger to the commit: seconds at most
		// here, counted in the buckets kube-proxy uses.
		if n := metricSum(t, "kubeproxy_network_programming_duration_seconds_bucket", map[string]string{"ip_family": c.family, "le": "300"}); n <= before {
			t.Errorf("%s: the new sample is not in the le=300 bucket", c.family)
		}
	}
}

// TestMetricsOfAKubernetesComponent: kpipe's /metrics has the series
// kubernetes-mixin's kube-proxy dashboard and alerts read besides
// kubeproxy_*, labelled as kube-proxy's (the same component-base
// collectors): client-go's requests to the real apiserver (KubeClientErrors),
// kubernetes_build_info (KubeVersionMismatch), kubernetes_feature_enabled and
// the Go runtime and process set; /metrics/slis has the healthz SLI.
func TestMetricsOfAKubernetesComponent(t *testing.T) {
	setup(t)
	m, err := kpipeMetrics()
	if err != nil {
		t.Fatal(err)
	}
	apiserver := map[string]string{"host": strings.TrimPrefix(testbed.APIServerURL, "https://")}
	if n := testbed.Sum(m, "rest_client_requests_total", withLabels(apiserver, "method", "GET", "code", "200")); n < 1 {
		t.Errorf("rest_client_requests_total%v = %v: kpipe's list and watch requests to the apiserver are not counted", apiserver, n)
	}
	if n := testbed.Sum(m, "rest_client_request_duration_seconds_count", withLabels(apiserver, "verb", "GET")); n < 1 {
		t.Errorf("rest_client_request_duration_seconds_count%v = %v", apiserver, n)
	}
	major, minor, version := kubernetesRelease(t)
	build := map[string]string{"major": major, "minor": minor, "git_version": version, "go_version": runtime.Version(),
		"platform": runtime.GOOS + "/" + runtime.GOARCH}
	if n := testbed.Sum(m, "kubernetes_build_info", build); n != 1 {
		t.Errorf("kubernetes_build_info%v = %v, want 1", build, n)
	}
	for _, name := range []string{"kubernetes_feature_enabled", "go_goroutines", "go_sched_gomaxprocs_threads",
		"go_gc_duration_seconds_count", "process_resident_memory_bytes", "process_cpu_seconds_total", "process_start_time_seconds"} {
		if !hasSample(m, name) {
			t.Errorf("no %s in kpipe's /metrics", name)
		}
	}
	for key := range m {
		if testbed.SampleOf(key, "kubernetes_feature_enabled", nil) && (!strings.Contains(key, `name="`) || !strings.Contains(key, `stage="`)) {
			t.Errorf("feature series without kube-proxy's name and stage labels: %s", key)
		}
	}
}

// TestMetricsSLIs: /metrics/slis on the metrics address counts the
// healthz checks answered there, as kube-proxy's does.
func TestMetricsSLIs(t *testing.T) {
	setup(t)
	if code, body, err := tb.HTTPGet(tb.NodeNS, testbed.MetricsURL+"/healthz"); err != nil || code != 200 {
		t.Fatalf("GET /healthz on the metrics address: %d %s %v", code, body, err)
	}
	slis, err := tb.ScrapeMetrics(tb.NodeNS, testbed.MetricsURL+"/metrics/slis")
	if err != nil {
		t.Fatal(err)
	}
	ping := map[string]string{"name": "ping", "type": "healthz"}
	if v := testbed.Sum(slis, "kubernetes_healthcheck", ping); v != 1 {
		t.Errorf("kubernetes_healthcheck%v = %v, want 1", ping, v)
	}
	if n := testbed.Sum(slis, "kubernetes_healthchecks_total", withLabels(ping, "status", "success")); n < 1 {
		t.Errorf("kubernetes_healthchecks_total%v = %v, want the GET counted", ping, n)
	}
}

// TestLogIsJSONLines: with --log-format=json every line the running kpipe
// has written, its own and client-go's (klog's), is a JSON object. With
// --profiling, PUT /debug/flags/v raises the verbosity to 4, at which
// client-go logs each watch the stopped apiserver refuses.
func TestLogIsJSONLines(t *testing.T) {
	e := setup(t)
	e.restoreKpipeAtEnd()
	if err := e.k.Restart("--profiling"); err != nil {
		t.Fatalf("restart kpipe with --profiling: %v", err)
	}
	putVerbosity(t, "4")
	controlPlaneBackAtEnd(t)
	failed := map[string]string{"host": strings.TrimPrefix(testbed.APIServerURL, "https://"), "code": "<error>"}
	before := metricSum(t, "rest_client_requests_total", failed)
	if err := tb.StopAPIServer(); err != nil {
		t.Fatalf("stop kube-apiserver: %v", err)
	}
	// Two refused requests: client-go has logged the first before it retries.
	testbed.Eventually(t, 30*time.Second, func() error {
		if n := metricSum(t, "rest_client_requests_total", failed); n < before+2 {
			return fmt.Errorf("%v failed requests to the stopped apiserver counted, want %v", n, before+2)
		}
		return nil
	})
	if err := tb.StartAPIServer(e.ctx); err != nil {
		t.Fatalf("start kube-apiserver again: %v", err)
	}
	putVerbosity(t, "0")
	b, err := os.ReadFile(tb.Kpipe().LogPath)
	if err != nil {
		t.Fatal(err)
	}
	// The test bed marks each start and exit with a "=== " line of its own
	// (testbed/proc.go): the running kpipe's lines follow the last one.
	log := "\n" + string(b)
	_, log, _ = strings.Cut(log[strings.LastIndex(log, "\n=== ")+1:], "\n")
	lines := strings.Split(strings.TrimSuffix(log, "\n"), "\n")
	bad := 0
	for i, line := range lines {
		var obj map[string]any
		if err := json.Unmarshal([]byte(line), &obj); err != nil {
			if bad++; bad <= 5 {
				t.Errorf("kpipe.log line %d since the start is not JSON (%v): %q", i+1, err, line)
			}
		}
	}
	t.Logf("%d log lines since kpipe started, %d not JSON", len(lines), bad)
}

// putVerbosity PUTs v to kpipe's /debug/flags/v, which must take it.
func putVerbosity(t *testing.T, v string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, testbed.MetricsURL+"/debug/flags/v", strings.NewReader(v))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := tb.HTTPClient(tb.NodeNS, 5*time.Second).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("PUT /debug/flags/v %s: %d %s", v, resp.StatusCode, body)
	}
}

// kubernetesRelease is the Kubernetes release of the client libraries
// go.mod requires (k8s.io/client-go v0.X.Y is Kubernetes v1.X.Y): the one
// kpipe's kubernetes_build_info names.
func kubernetesRelease(t *testing.T) (major, minor, version string) {
	t.Helper()
	b, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "k8s.io/client-go" {
			minorPatch := strings.TrimPrefix(f[1], "v0.")
			minor, _, _ = strings.Cut(minorPatch, ".")
			return "1", minor, "v1." + minorPatch
		}
	}
	t.Fatal("go.mod requires no k8s.io/client-go")
	return
}

func withLabels(base map[string]string, kv ...string) map[string]string {
	out := maps.Clone(base)
	for i := 0; i+1 < len(kv); i += 2 {
		out[kv[i]] = kv[i+1]
	}
	return out
}

func hasSample(m map[string]float64, name string) bool {
	for key := range m {
		if testbed.SampleOf(key, name, nil) {
			return true
		}
	}
	return false
}
