package main

import (
	"errors"

	"k8s.io/component-base/featuregate"
	logsapi "k8s.io/component-base/logs/api/v1"
	metricsfeatures "k8s.io/component-base/metrics/features"
)

// featureGate is kube-proxy's feature gates as far as kpipe knows them
// (component-base's logging and metrics gates, which kube-proxy adds to
// Kubernetes' own), set from the values given for them. Its AddMetrics is
// kubernetes_feature_enabled.
func featureGate(given map[string]bool) (featuregate.MutableFeatureGate, error) {
	gate := featuregate.NewFeatureGate()
	if err := errors.Join(logsapi.AddFeatureGates(gate), metricsfeatures.AddFeatureGates(gate)); err != nil {
		return nil, err
	}
	known := gate.GetAll()
	values := map[string]bool{}
	for name, on := range given {
		if _, ok := known[featuregate.Feature(name)]; ok {
			values[name] = on
		}
	}
	return gate, gate.SetFromMap(values)
}
