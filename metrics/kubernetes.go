package metrics

import (
	"runtime/debug"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	k8smetrics "k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	// client-go's rest_client_* metrics, registered in legacyregistry as
	// kube-proxy's build registers them (kubernetes-mixin's KubeClientErrors).
	_ "k8s.io/component-base/metrics/prometheus/restclient"
	"k8s.io/component-base/version"
)

// Served is what /metrics serves: kpipe's registry and component-base's
// global one (legacyregistry), which holds what kube-proxy's /metrics has
// besides kubeproxy_*: the Go runtime (all of runtime/metrics) and process
// collectors, client-go's rest_client_*, kubernetes_feature_enabled (a
// feature gate's AddMetrics), kubernetes_build_info and the registry's own
// registered_metrics_total. kpipe's registry holds no Go or process
// collector, so each name comes from one of the two.
func Served(kpipe prometheus.Gatherer) prometheus.Gatherer {
	return prometheus.Gatherers{legacyregistry.DefaultGatherer, kpipe}
}

// kubernetesBuildInfo is component-base's kubernetes_build_info (its name,
// help, labels and stability), set by SetKubernetesBuildInfo rather than
// from component-base's version stamp, which only Kubernetes' own build sets.
var kubernetesBuildInfo = k8smetrics.NewGaugeVec(&k8smetrics.GaugeOpts{
	Name:           "kubernetes_build_info",
	Help:           "A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree state, build date, Go version, and compiler from which Kubernetes was built, and platform on which it is running.",
	StabilityLevel: k8smetrics.ALPHA,
}, []string{"major", "minor", "git_version", "git_commit", "git_tree_state", "build_date", "go_version", "compiler", "platform"})

func init() { legacyregistry.MustRegister(kubernetesBuildInfo) }

// SetKubernetesBuildInfo sets kubernetes_build_info to 1. Its major, minor
// and git_version are the Kubernetes release of the client libraries kpipe is
// built from (KubernetesRelease): the release whose kube-proxy kpipe stands in
// for, which kubernetes-mixin's KubeVersionMismatch compares across the
// cluster's components. The other labels are kpipe's own build
// (kpipe_build_info's).
func SetKubernetesBuildInfo(build prometheus.Labels) {
	major, minor, gitVersion := KubernetesRelease()
	kubernetesBuildInfo.WithLabelValues(major, minor, gitVersion, build["git_commit"], build["git_tree_state"],
		build["build_date"], build["go_version"], build["compiler"], build["platform"]).Set(1)
}

// KubernetesRelease is the Kubernetes release of the k8s.io/client-go this
// binary holds (v0.X.Y is Kubernetes v1.X.Y); without module information (a
// test binary), component-base's v1.X.
func KubernetesRelease() (major, minor, gitVersion string) {
	major, minor, _ = strings.Cut(version.DefaultKubeBinaryVersion, ".")
	gitVersion = "v" + version.DefaultKubeBinaryVersion
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range bi.Deps {
			if dep.Path == "k8s.io/client-go" && strings.HasPrefix(dep.Version, "v0.") {
				gitVersion = "v1." + strings.TrimPrefix(dep.Version, "v0.")
				minor, _, _ = strings.Cut(strings.TrimPrefix(dep.Version, "v0."), ".")
			}
		}
	}
	return major, minor, gitVersion
}
