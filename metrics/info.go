package metrics

import "github.com/prometheus/client_golang/prometheus"

// BuildInfo is kpipe_build_info: always 1, labelled with kpipe's build (its
// version, commit, Go version…), as kube-proxy's kubernetes_build_info is
// with Kubernetes'. kpipe's kubernetes_build_info names the Kubernetes
// release of its client libraries instead (SetKubernetesBuildInfo).
func BuildInfo(labels prometheus.Labels) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kpipe_build_info",
		Help: "1, labelled with the version, commit and Go toolchain kpipe was built from", ConstLabels: labels})
	g.Set(1)
	return g
}

// FamiliesProgrammed is kpipe_ip_family_programmed: 1 for each IP family (by
// its ip_family label) kpipe programs, 0 for one the host cannot have (an
// IPv6 kernel without an IPv6 nat table).
func FamiliesProgrammed(on map[string]bool) prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kpipe_ip_family_programmed",
		Help: "1 for an IP family kpipe programs, 0 for one the host cannot have (see the IPv6 off log line)"}, []string{IPFamily})
	for family, programmed := range on {
		v := 0.0
		if programmed {
			v = 1
		}
		g.WithLabelValues(family).Set(v)
	}
	return g
}
