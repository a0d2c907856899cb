package e2e

import (
	"fmt"
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
