package metrics

import "github.com/prometheus/client_golang/prometheus"

// BuildInfo is kpipe_build_info: always 1, labelled with kpipe's build (its
// version, commit, Go version…), as kube-proxy's kubernetes_build_info is
// with Kubernetes'. kpipe does not export kubernetes_build_info itself: that
// series says which Kubernetes release a component is, and kpipe is none.
func BuildInfo(labels prometheus.Labels) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kpipe_build_info",
		Help: "1, labelled with the version, commit and Go toolchain kpipe was built from", ConstLabels: labels})
	g.Set(1)
	return g
}
