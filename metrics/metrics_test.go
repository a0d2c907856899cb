package metrics

import (
	"log/slog"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// upstream is kube-proxy v1.34's iptables-mode metrics (pkg/proxy/metrics), copied
// by hand: a drift on either side fails TestKubeProxyMetrics.
var upstream = []struct {
	name    string
	typ     dto.MetricType
	help    string
	labels  []string
	buckets string // "sync" or "programming" for histograms
}{
	{"kubeproxy_sync_proxy_rules_duration_seconds", dto.MetricType_HISTOGRAM, "SyncProxyRules latency in seconds", []string{"ip_family"}, "sync"},
	{"kubeproxy_sync_full_proxy_rules_duration_seconds", dto.MetricType_HISTOGRAM, "SyncProxyRules latency in seconds for full resyncs", []string{"ip_family"}, "sync"},
	{"kubeproxy_sync_partial_proxy_rules_duration_seconds", dto.MetricType_HISTOGRAM, "SyncProxyRules latency in seconds for partial resyncs", []string{"ip_family"}, "sync"},
	{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", dto.MetricType_GAUGE, "The last time proxy rules were successfully synced", []string{"ip_family"}, ""},
	{"kubeproxy_network_programming_duration_seconds", dto.MetricType_HISTOGRAM, "In Cluster Network Programming Latency in seconds", []string{"ip_family"}, "programming"},
	{"kubeproxy_sync_proxy_rules_endpoint_changes_pending", dto.MetricType_GAUGE, "Pending proxy rules Endpoint changes", nil, ""},
	{"kubeproxy_sync_proxy_rules_endpoint_changes_total", dto.MetricType_COUNTER, "Cumulative proxy rules Endpoint changes", nil, ""},
	{"kubeproxy_sync_proxy_rules_service_changes_pending", dto.MetricType_GAUGE, "Pending proxy rules Service changes", nil, ""},
	{"kubeproxy_sync_proxy_rules_service_changes_total", dto.MetricType_COUNTER, "Cumulative proxy rules Service changes", nil, ""},
	{"kubeproxy_sync_proxy_rules_iptables_restore_failures_total", dto.MetricType_COUNTER, "Cumulative proxy iptables restore failures", []string{"ip_family"}, ""},
	{"kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", dto.MetricType_COUNTER, "Cumulative proxy iptables partial restore failures", []string{"ip_family"}, ""},
	{"kubeproxy_sync_proxy_rules_iptables_total", dto.MetricType_GAUGE, "Total number of iptables rules owned by kube-proxy", []string{"table", "ip_family"}, ""},
	{"kubeproxy_sync_proxy_rules_iptables_last", dto.MetricType_GAUGE, "Number of iptables rules written by kube-proxy in last sync", []string{"table", "ip_family"}, ""},
	{"kubeproxy_proxy_healthz_total", dto.MetricType_COUNTER, "Cumulative proxy healthz HTTP status", []string{"code"}, ""},
	{"kubeproxy_proxy_livez_total", dto.MetricType_COUNTER, "Cumulative proxy livez HTTP status", []string{"code"}, ""},
	{"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", dto.MetricType_GAUGE, "The last time a sync of proxy rules was queued", []string{"ip_family"}, ""},
	{"kubeproxy_sync_proxy_rules_no_local_endpoints_total", dto.MetricType_GAUGE, "Number of services with a Local traffic policy and no endpoints", []string{"traffic_policy", "ip_family"}, ""},
	{"kubeproxy_conntrack_reconciler_sync_duration_seconds", dto.MetricType_HISTOGRAM, "ReconcileConntrackFlowsLatency latency in seconds", []string{"ip_family"}, "sync"},
	{"kubeproxy_conntrack_reconciler_deleted_entries_total", dto.MetricType_COUNTER, "Cumulative conntrack flows deleted by conntrack reconciler", []string{"ip_family"}, ""},
	{"kubeproxy_iptables_ct_state_invalid_dropped_packets_total", dto.MetricType_COUNTER, "packets dropped by iptables to work around conntrack problems", nil, ""},
	{"kubeproxy_iptables_localhost_nodeports_accepted_packets_total", dto.MetricType_COUNTER, "Number of packets accepted on nodeports of loopback interface", nil, ""},
}

// upstreamBuckets are kube-proxy's bucket boundaries, written out rather than
// computed so that they do not share a formula with the code under test.
var upstreamBuckets = map[string][]float64{
	// ExponentialBuckets(0.001, 2, 15)
	"sync": {0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096, 8.192, 16.384},
	// MergeBuckets(LinearBuckets(0.25, 0.25, 2), LinearBuckets(1, 1, 59),
	// LinearBuckets(60, 5, 12), LinearBuckets(120, 30, 7)): MergeBuckets starts with 0.
	"programming": {0, 0.25, 0.5,
		1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
		31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
		60, 65, 70, 75, 80, 85, 90, 95, 100, 105, 110, 115,
		120, 150, 180, 210, 240, 270, 300},
}

// newTouched makes the collectors in a fresh registry and one series of each, so
// that Gather lists every family with its label names.
func newTouched(t *testing.T) *prometheus.Registry {
	t.Helper()
	rec := recorder{reg: prometheus.NewRegistry()}
	New(&rec)
	rec.reg.MustRegister(NFAcct{Reader: fakeNFAcct{"a": 1, "b": 2}, InvalidDropped: "a", LocalhostNodePorts: "b", Log: slog.New(slog.DiscardHandler)})
	rec.reg.MustRegister(BuildInfo(prometheus.Labels{"git_version": "v1.2.3"}))
	for _, c := range rec.cs {
		switch v := c.(type) {
		case *prometheus.HistogramVec:
			m, _ := withAnyLabels(v.GetMetricWithLabelValues)
			m.(prometheus.Histogram).Observe(0)
		case *prometheus.GaugeVec:
			m, _ := withAnyLabels(v.GetMetricWithLabelValues)
			m.(prometheus.Gauge).Set(0)
		case *prometheus.CounterVec:
			m, _ := withAnyLabels(v.GetMetricWithLabelValues)
			m.(prometheus.Counter).Add(0)
		}
	}
	return rec.reg
}

// withAnyLabels gets a vector's child for placeholder values of however many
// labels it has.
func withAnyLabels[M any](get func(...string) (M, error)) (any, error) {
	var err error
	for n := 0; n < 5; n++ {
		var m M
		if m, err = get(slices.Repeat([]string{"x"}, n)...); err == nil {
			return m, nil
		}
	}
	return nil, err
}

func TestKubeProxyMetrics(t *testing.T) {
	reg := newTouched(t)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*dto.MetricFamily{}
	for _, f := range families {
		byName[f.GetName()] = f
	}
	for _, want := range upstream {
		f := byName[want.name]
		if f == nil {
			t.Errorf("%s: not registered", want.name)
			continue
		}
		if f.GetType() != want.typ {
			t.Errorf("%s: type %v, kube-proxy's is %v", want.name, f.GetType(), want.typ)
		}
		// component-base prefixes the help of ALPHA metrics; kube-proxy's scrape shows it.
		if got := f.GetHelp(); got != "[ALPHA] "+want.help {
			t.Errorf("%s: help %q, kube-proxy's is %q", want.name, got, "[ALPHA] "+want.help)
		}
		metric := f.GetMetric()[0]
		var labels []string
		for _, l := range metric.GetLabel() {
			labels = append(labels, l.GetName())
		}
		if !sameSet(labels, want.labels) {
			t.Errorf("%s: labels %v, kube-proxy's are %v", want.name, labels, want.labels)
		}
		if want.typ != dto.MetricType_HISTOGRAM {
			continue
		}
		var bounds []float64
		for _, b := range metric.GetHistogram().GetBucket() {
			bounds = append(bounds, b.GetUpperBound())
		}
		if !slices.Equal(bounds, upstreamBuckets[want.buckets]) {
			t.Errorf("%s: buckets %v, kube-proxy's are %v", want.name, bounds, upstreamBuckets[want.buckets])
		}
	}
}

// TestOwnMetricsKeepPrefix: everything that is not kube-proxy's is kpipe's own.
func TestOwnMetricsKeepPrefix(t *testing.T) {
	reg := newTouched(t)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, u := range upstream {
		known[u.name] = true
	}
	for _, f := range families {
		if !known[f.GetName()] && !hasPrefix(f.GetName(), "kpipe_") {
			t.Errorf("%s: neither kube-proxy's nor prefixed kpipe_", f.GetName())
		}
	}
}

// TestBuildInfo: kpipe_build_info is a gauge at 1 with the labels given
// (kube-proxy's kubernetes_build_info is 1 with Kubernetes' build as labels).
func TestBuildInfo(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(BuildInfo(prometheus.Labels{"git_version": "v1.2.3", "git_commit": "abc"}))
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(families) != 1 || families[0].GetName() != "kpipe_build_info" || families[0].GetType() != dto.MetricType_GAUGE {
		t.Fatalf("gathered %v, want the gauge kpipe_build_info alone", families)
	}
	m := families[0].GetMetric()[0]
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	if len(got) != 2 || got["git_version"] != "v1.2.3" || got["git_commit"] != "abc" || m.GetGauge().GetValue() != 1 {
		t.Errorf("kpipe_build_info%v %v, want {git_version=v1.2.3, git_commit=abc} 1", got, m.GetGauge().GetValue())
	}
}

func hasPrefix(s, p string) bool { return len(s) >= len(p) && s[:len(p)] == p }

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// recorder registers with reg and remembers what it registered.
type recorder struct {
	reg *prometheus.Registry
	cs  []prometheus.Collector
}

func (r *recorder) Register(c prometheus.Collector) error {
	r.cs = append(r.cs, c)
	return r.reg.Register(c)
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	r.cs = append(r.cs, cs...)
	r.reg.MustRegister(cs...)
}

func (r *recorder) Unregister(c prometheus.Collector) bool { return r.reg.Unregister(c) }
