package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// serviceFacts is what the apiserver says of a Service a rule names: the
// policies behind the rules explain walked.
type serviceFacts struct {
	Service string `json:"service"` // namespace/name
	// Missing: the apiserver has no such Service (the node's rules are stale).
	Missing               bool   `json:"missing,omitempty"`
	Type                  string `json:"type,omitempty"`
	ExternalTrafficPolicy string `json:"externalTrafficPolicy,omitempty"`
	InternalTrafficPolicy string `json:"internalTrafficPolicy,omitempty"`
	SessionAffinity       string `json:"sessionAffinity,omitempty"`
	AffinitySeconds       int32  `json:"affinitySeconds,omitempty"`
}

// lookupTimeout bounds asking the apiserver about the Services.
const lookupTimeout = 10 * time.Second

// lookUpServices asks the apiserver about the Services ports names
// ("namespace/name:port"), each once.
func lookUpServices(ctx context.Context, client kubernetes.Interface, ports []string) ([]serviceFacts, error) {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	var out []serviceFacts
	seen := map[string]bool{}
	for _, port := range ports {
		name, _, _ := strings.Cut(port, ":")
		if seen[name] {
			continue
		}
		seen[name] = true
		ns, n, _ := strings.Cut(name, "/")
		svc, err := client.CoreV1().Services(ns).Get(ctx, n, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			out = append(out, serviceFacts{Service: name, Missing: true})
		case err != nil:
			return nil, fmt.Errorf("ask the apiserver about Service %s: %w", name, err)
		default:
			out = append(out, factsOf(name, svc))
		}
	}
	return out, nil
}

func factsOf(name string, svc *corev1.Service) serviceFacts {
	f := serviceFacts{Service: name, Type: string(svc.Spec.Type), ExternalTrafficPolicy: string(svc.Spec.ExternalTrafficPolicy),
		SessionAffinity: string(svc.Spec.SessionAffinity)}
	if svc.Spec.InternalTrafficPolicy != nil {
		f.InternalTrafficPolicy = string(*svc.Spec.InternalTrafficPolicy)
	}
	if c := svc.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
		f.AffinitySeconds = *c.ClientIP.TimeoutSeconds
	}
	return f
}

// String is the facts on one line.
func (f serviceFacts) String() string {
	if f.Missing {
		return f.Service + ": not in the apiserver (deleted? the node's rules for it are stale)"
	}
	parts := []string{"type " + f.Type}
	if f.ExternalTrafficPolicy != "" {
		parts = append(parts, "externalTrafficPolicy "+f.ExternalTrafficPolicy)
	}
	if f.InternalTrafficPolicy != "" {
		parts = append(parts, "internalTrafficPolicy "+f.InternalTrafficPolicy)
	}
	affinity := "sessionAffinity " + f.SessionAffinity
	if f.AffinitySeconds > 0 {
		affinity += fmt.Sprintf(" (%d s)", f.AffinitySeconds)
	}
	return f.Service + ": " + strings.Join(append(parts, affinity), ", ")
}
