package main

import (
	"slices"
	"testing"
)

// kube-proxy's deprecated --healthz-port and --metrics-port: 0 disables that
// server; another port replaces the default only of a bind address given as a
// bare IP (upstream's addressFromDeprecatedFlags); with --config they are
// ignored, as kube-proxy ignores them.
func TestDeprecatedPortFlags(t *testing.T) {
	for _, tt := range []struct {
		args             []string
		healthz, metrics string
	}{
		{[]string{"--healthz-port=0"}, "", "127.0.0.1:10249"},
		{[]string{"--metrics-port=0"}, "0.0.0.0:10256", ""},
		{[]string{"--healthz-port=0", "--metrics-port=0"}, "", ""},
		{[]string{"--healthz-bind-address=127.0.0.2", "--healthz-port=12345"}, "127.0.0.2:12345", "127.0.0.1:10249"},
		{[]string{"--metrics-bind-address=::1", "--metrics-port=9999"}, "0.0.0.0:10256", "[::1]:9999"},
		{[]string{"--healthz-port=12345", "--metrics-port=9999"}, "0.0.0.0:10256", "127.0.0.1:10249"},
		{[]string{"--healthz_port=0"}, "", "127.0.0.1:10249"},
		{[]string{"--config=" + kubeadmConfig, "--healthz-port=0", "--metrics-port=0"}, "0.0.0.0:10256", "127.0.0.1:10249"},
	} {
		o, code, stderr := resolved(t, append(tt.args, "--hostname-override=n")...)
		if code != 0 {
			t.Errorf("%q: exit %d: %s", tt.args, code, stderr)
			continue
		}
		if o.HealthzBindAddress != tt.healthz || o.MetricsBindAddress != tt.metrics {
			t.Errorf("%q: healthz %q, metrics %q; want %q, %q", tt.args, o.HealthzBindAddress, o.MetricsBindAddress, tt.healthz, tt.metrics)
		}
	}
}

// The component-base logging flags kube-proxy has and cadvisor's
// --boot-id-file and --machine-id-file (linked into kube-proxy, read by
// nothing it runs) are accepted, their values checked as kube-proxy checks
// them, and named among the ignored flags.
func TestKubeProxyFlagsAcceptedAndIgnored(t *testing.T) {
	args := []string{"--log-text-split-stream", "--log-text-info-buffer-size=1Ki", "--log-json-split-stream=true",
		"--log-json-info-buffer-size=5M", "--boot-id-file=/run/boot_id", "--machine_id_file=/etc/machine-id", "--hostname-override=n"}
	o, code, stderr := resolved(t, args...)
	if code != 0 {
		t.Fatalf("%q: exit %d: %s", args, code, stderr)
	}
	want := []string{"boot-id-file", "log-json-info-buffer-size", "log-json-split-stream", "log-text-info-buffer-size", "log-text-split-stream", "machine-id-file"}
	if !slices.Equal(o.ignoredGiven, want) {
		t.Errorf("ignored flags given: %q; want %q", o.ignoredGiven, want)
	}
	for _, bad := range [][]string{{"--log-text-info-buffer-size=lots"}, {"--log-json-split-stream=sometimes"}} {
		if _, code, stderr := resolved(t, bad...); code != 1 {
			t.Errorf("%q: exit %d, %q; want 1", bad, code, stderr)
		}
	}
}
