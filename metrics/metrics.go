// Package metrics holds the Prometheus collectors the stages report to.
package metrics

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the collectors the stages report to, named as kube-proxy names them
// so dashboards and alerts carry over. Prometheus collectors are safe for
// concurrent use; the registry they live in is made by cmd/kpipe.
type Metrics struct {
	SyncDuration        prometheus.Histogram
	NetworkProgramming  prometheus.Histogram
	SyncFullDuration    prometheus.Histogram
	SyncPartialDuration prometheus.Histogram
	LastSync            prometheus.Gauge
	LastQueued          prometheus.Gauge
	RestoreFailures     prometheus.Counter
	RulesTotal          *prometheus.GaugeVec // by table
	ServiceChanges      prometheus.Counter
	EndpointChanges     prometheus.Counter
	ServicesPending     prometheus.Gauge
	EndpointsPending    prometheus.Gauge
	NoLocalEndpoints    *prometheus.GaugeVec // by traffic_policy
	HealthzTotal        *prometheus.CounterVec
	LivezTotal          *prometheus.CounterVec
	ConntrackDeleted    prometheus.Counter
	ConntrackDuration   prometheus.Histogram
	Skipped             *prometheus.CounterVec // kpipe: invalid API objects skipped, by kind and reason
	StageRestarts       *prometheus.CounterVec // kpipe: supervisor restarts, by stage
}

// New makes the collectors and registers them with reg.
func New(reg prometheus.Registerer) *Metrics {
	buckets := prometheus.ExponentialBuckets(0.001, 2, 15)
	m := &Metrics{
		SyncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kubeproxy_sync_proxy_rules_duration_seconds", Help: "SyncProxyRules latency in seconds", Buckets: buckets}),
		NetworkProgramming: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kubeproxy_network_programming_duration_seconds", Help: "In Cluster Network Programming Latency in seconds",
			Buckets: programmingBuckets()}),
		SyncFullDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kubeproxy_sync_full_proxy_rules_duration_seconds", Help: "SyncProxyRules latency in seconds for full resyncs", Buckets: buckets}),
		SyncPartialDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kubeproxy_sync_partial_proxy_rules_duration_seconds", Help: "SyncProxyRules latency in seconds for partial resyncs", Buckets: buckets}),
		LastSync: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kubeproxy_sync_proxy_rules_last_timestamp_seconds", Help: "The last time proxy rules were successfully synced"}),
		LastQueued: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", Help: "The last time a sync of proxy rules was queued"}),
		RestoreFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", Help: "Cumulative proxy iptables restore failures"}),
		RulesTotal: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kubeproxy_sync_proxy_rules_iptables_total", Help: "Total number of iptables rules owned by kube-proxy"}, []string{"table"}),
		ServiceChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kubeproxy_sync_proxy_rules_service_changes_total", Help: "Cumulative proxy rules Service changes"}),
		EndpointChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kubeproxy_sync_proxy_rules_endpoint_changes_total", Help: "Cumulative proxy rules Endpoint changes"}),
		ServicesPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kubeproxy_sync_proxy_rules_service_changes_pending", Help: "Pending proxy rules Service changes"}),
		EndpointsPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kubeproxy_sync_proxy_rules_endpoint_changes_pending", Help: "Pending proxy rules Endpoint changes"}),
		NoLocalEndpoints: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kubeproxy_sync_proxy_rules_no_local_endpoints_total", Help: "Number of services with a Local traffic policy and no endpoints"}, []string{"traffic_policy"}),
		HealthzTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kubeproxy_proxy_healthz_total", Help: "Cumulative proxy healthz HTTP status"}, []string{"code"}),
		LivezTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kubeproxy_proxy_livez_total", Help: "Cumulative proxy livez HTTP status"}, []string{"code"}),
		ConntrackDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kubeproxy_conntrack_reconciler_deleted_entries_total", Help: "Cumulative conntrack flows deleted by conntrack reconciler"}),
		ConntrackDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kubeproxy_conntrack_reconciler_sync_duration_seconds", Help: "ReconcileConntrackFlowsLatency latency in seconds", Buckets: buckets}),
		Skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kpipe_skipped_objects_total", Help: "API objects or parts of them skipped because they are invalid"}, []string{"kind", "reason"}),
		StageRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kpipe_stage_restarts_total", Help: "Restarts of a pipeline stage by its supervisor"}, []string{"stage"}),
	}
	reg.MustRegister(m.SyncDuration, m.NetworkProgramming, m.SyncFullDuration, m.SyncPartialDuration, m.LastSync, m.LastQueued,
		m.RestoreFailures, m.RulesTotal, m.ServiceChanges, m.EndpointChanges, m.ServicesPending,
		m.EndpointsPending, m.NoLocalEndpoints, m.HealthzTotal, m.LivezTotal, m.ConntrackDeleted,
		m.ConntrackDuration, m.Skipped, m.StageRestarts)
	return m
}

// programmingBuckets are kube-proxy's buckets for network programming latency:
// 0.25 s steps to 1 s, then 1 s steps to a minute, 5 s to two, 30 s to five.
func programmingBuckets() []float64 {
	b := []float64{0.25, 0.5}
	for v := 1.0; v <= 59; v++ {
		b = append(b, v)
	}
	for v := 60.0; v < 120; v += 5 {
		b = append(b, v)
	}
	for v := 120.0; v <= 300; v += 30 {
		b = append(b, v)
	}
	return b
}
