// Package metrics holds the Prometheus collectors the stages report to.
package metrics

import "github.com/prometheus/client_golang/prometheus"

// IPFamily is the ip_family label kube-proxy puts on its per-family series.
const IPFamily = "ip_family"

// Metrics are the collectors the stages report to, named, labelled and bucketed
// as kube-proxy v1.34 does in iptables mode so dashboards and alerts carry over.
// Each family's sync is its own series (label ip_family, "IPv4" or "IPv6").
// Prometheus collectors are safe for concurrent use; the registry they live in is
// made by cmd/kpipe.
type Metrics struct {
	SyncDuration           *prometheus.HistogramVec // by ip_family
	SyncFullDuration       *prometheus.HistogramVec // by ip_family
	SyncPartialDuration    *prometheus.HistogramVec // by ip_family
	NetworkProgramming     *prometheus.HistogramVec // by ip_family
	LastSync               *prometheus.GaugeVec     // by ip_family
	LastQueued             *prometheus.GaugeVec     // by ip_family
	RestoreFailures        *prometheus.CounterVec   // by ip_family
	PartialRestoreFailures *prometheus.CounterVec   // by ip_family
	RulesTotal             *prometheus.GaugeVec     // by table, ip_family
	RulesLast              *prometheus.GaugeVec     // by table, ip_family: rules written by the last sync
	ServiceChanges         prometheus.Counter
	EndpointChanges        prometheus.Counter
	ServicesPending        prometheus.Gauge
	EndpointsPending       prometheus.Gauge
	NoLocalEndpoints       *prometheus.GaugeVec // by traffic_policy, ip_family
	HealthzTotal           *prometheus.CounterVec
	LivezTotal             *prometheus.CounterVec
	ConntrackDeleted       *prometheus.CounterVec   // by ip_family
	ConntrackDuration      *prometheus.HistogramVec // by ip_family
	Skipped                *prometheus.CounterVec   // kpipe: invalid API objects skipped, by kind and reason
	StageRestarts          *prometheus.CounterVec   // kpipe: supervisor restarts, by stage
	Escalations            *prometheus.CounterVec   // kpipe: supervisors that spent their restart budget, by supervisor
	ConfigReloads          *prometheus.CounterVec   // kpipe: config file changes read, by result
	ConfigReloadSuccessful prometheus.Gauge         // kpipe: 1 unless the config file's last change was rejected
	UndeletableChains      *prometheus.GaugeVec     // kpipe: chains kpipe wants gone that the kernel will not delete, by ip_family
	FastDeletedRules       *prometheus.CounterVec   // kpipe: rules deleted ahead of the walked write (the removal fast path), by ip_family
}

// The results of a config file reload (label result of kpipe_config_reloads_total).
const (
	ReloadSuccess = "success"
	ReloadFailure = "failure"
)

// alpha marks help text as kube-proxy's component-base does for its ALPHA
// metrics, so a scrape reads the same.
func alpha(help string) string { return "[ALPHA] " + help }

func histogram(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: alpha(help), Buckets: buckets}, labels)
}

func gauge(name, help string, labels ...string) *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: alpha(help)}, labels)
}

func counter(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: alpha(help)}, labels)
}

// New makes the collectors and registers them with reg.
func New(reg prometheus.Registerer) *Metrics {
	sync := SyncBuckets()
	m := &Metrics{
		SyncDuration: histogram("kubeproxy_sync_proxy_rules_duration_seconds",
			"SyncProxyRules latency in seconds", sync, IPFamily),
		SyncFullDuration: histogram("kubeproxy_sync_full_proxy_rules_duration_seconds",
			"SyncProxyRules latency in seconds for full resyncs", sync, IPFamily),
		SyncPartialDuration: histogram("kubeproxy_sync_partial_proxy_rules_duration_seconds",
			"SyncProxyRules latency in seconds for partial resyncs", sync, IPFamily),
		NetworkProgramming: histogram("kubeproxy_network_programming_duration_seconds",
			"In Cluster Network Programming Latency in seconds", ProgrammingBuckets(), IPFamily),
		LastSync: gauge("kubeproxy_sync_proxy_rules_last_timestamp_seconds",
			"The last time proxy rules were successfully synced", IPFamily),
		LastQueued: gauge("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
			"The last time a sync of proxy rules was queued", IPFamily),
		RestoreFailures: counter("kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
			"Cumulative proxy iptables restore failures", IPFamily),
		PartialRestoreFailures: counter("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
			"Cumulative proxy iptables partial restore failures", IPFamily),
		RulesTotal: gauge("kubeproxy_sync_proxy_rules_iptables_total",
			"Total number of iptables rules owned by kube-proxy", "table", IPFamily),
		RulesLast: gauge("kubeproxy_sync_proxy_rules_iptables_last",
			"Number of iptables rules written by kube-proxy in last sync", "table", IPFamily),
		ServiceChanges: counter("kubeproxy_sync_proxy_rules_service_changes_total",
			"Cumulative proxy rules Service changes").WithLabelValues(),
		EndpointChanges: counter("kubeproxy_sync_proxy_rules_endpoint_changes_total",
			"Cumulative proxy rules Endpoint changes").WithLabelValues(),
		ServicesPending: gauge("kubeproxy_sync_proxy_rules_service_changes_pending",
			"Pending proxy rules Service changes").WithLabelValues(),
		EndpointsPending: gauge("kubeproxy_sync_proxy_rules_endpoint_changes_pending",
			"Pending proxy rules Endpoint changes").WithLabelValues(),
		NoLocalEndpoints: gauge("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
			"Number of services with a Local traffic policy and no endpoints", "traffic_policy", IPFamily),
		HealthzTotal: counter("kubeproxy_proxy_healthz_total", "Cumulative proxy healthz HTTP status", "code"),
		LivezTotal:   counter("kubeproxy_proxy_livez_total", "Cumulative proxy livez HTTP status", "code"),
		ConntrackDeleted: counter("kubeproxy_conntrack_reconciler_deleted_entries_total",
			"Cumulative conntrack flows deleted by conntrack reconciler", IPFamily),
		ConntrackDuration: histogram("kubeproxy_conntrack_reconciler_sync_duration_seconds",
			"ReconcileConntrackFlowsLatency latency in seconds", sync, IPFamily),
		Skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kpipe_skipped_objects_total", Help: "API objects or parts of them skipped because they are invalid"}, []string{"kind", "reason"}),
		StageRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kpipe_stage_restarts_total", Help: "Restarts of a pipeline stage by its supervisor"}, []string{"stage"}),
		Escalations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kpipe_supervisor_escalations_total", Help: "Supervisors that spent their restart budget and failed to their parent"}, []string{"supervisor"}),
		ConfigReloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kpipe_config_reloads_total", Help: "Changes of the config file read, by result (failure: rejected, the previous configuration kept)"}, []string{"result"}),
		ConfigReloadSuccessful: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kpipe_config_last_reload_successful", Help: "1 if kpipe runs on the config file as it is, 0 if its last change was rejected"}),
		UndeletableChains: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kpipe_undeletable_chains", Help: "Chains of kpipe's that it no longer wants and the kernel refuses to delete (another agent's rule still jumps to them); emptied, retried at each periodic sync"}, []string{IPFamily}),
		FastDeletedRules: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kpipe_fast_path_deleted_rules_total", Help: "Rules to endpoints that went away (and to deleted Services) deleted in a delete-only transaction ahead of the walked write of the rest of a sync"}, []string{IPFamily}),
	}
	m.ConfigReloadSuccessful.Set(1)
	reg.MustRegister(m.SyncDuration, m.SyncFullDuration, m.SyncPartialDuration, m.NetworkProgramming,
		m.LastSync, m.LastQueued, m.RestoreFailures, m.PartialRestoreFailures, m.RulesTotal, m.RulesLast,
		m.ServiceChanges, m.EndpointChanges, m.ServicesPending, m.EndpointsPending, m.NoLocalEndpoints,
		m.HealthzTotal, m.LivezTotal, m.ConntrackDeleted, m.ConntrackDuration, m.Skipped, m.StageRestarts, m.Escalations,
		m.ConfigReloads, m.ConfigReloadSuccessful, m.UndeletableChains, m.FastDeletedRules)
	return m
}

// SyncBuckets are kube-proxy's buckets for sync and conntrack reconciler
// latency: 1 ms doubling fifteen times (to about 16 s).
func SyncBuckets() []float64 { return prometheus.ExponentialBuckets(0.001, 2, 15) }

// ProgrammingBuckets are kube-proxy's buckets for network programming latency:
// 0, then 0.25 s steps to 0.5 s, 1 s steps to 59 s, 5 s steps to 115 s and 30 s
// steps to five minutes. (The leading 0 is kube-proxy's too.)
func ProgrammingBuckets() []float64 {
	b := []float64{0}
	b = append(b, prometheus.LinearBuckets(0.25, 0.25, 2)...)
	b = append(b, prometheus.LinearBuckets(1, 1, 59)...)
	b = append(b, prometheus.LinearBuckets(60, 5, 12)...)
	return append(b, prometheus.LinearBuckets(120, 30, 7)...)
}
