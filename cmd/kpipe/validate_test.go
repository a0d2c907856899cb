package main

import (
	"strings"
	"testing"
)

// badCommandLines are command lines kube-proxy v1.34 refuses (exit 1, an error
// naming the bad value) and kpipe accepted before: bind addresses, the node
// name, the cluster CIDRs, feature gates.
var badCommandLines = []struct {
	args    []string
	mention string // the bad value, as the error must name it
}{
	{[]string{"--healthz-bind-address=nope"}, "nope"},
	{[]string{"--healthz-bind-address=nope:10256"}, "nope"},
	{[]string{"--healthz-bind-address=1.2.3.4:99999"}, "99999"},
	{[]string{"--healthz-bind-address=1.2.3.4:-1"}, "-1"},
	{[]string{"--healthz-bind-address=1.2.3.4", "--healthz-port=70000"}, "70000"},
	{[]string{"--metrics-bind-address=127.0.0.1:metrics"}, "metrics"},
	{[]string{"--metrics-bind-address=[::1]:65536"}, "65536"},
	{[]string{"--bind-address=node-1"}, "node-1"},
	{[]string{"--hostname-override=   "}, "hostname-override"},
	{[]string{"--cluster-cidr=10.0.0.0/8,10.1.0.0/16"}, "10.0.0.0/8,10.1.0.0/16"},
	{[]string{"--cluster-cidr=fd00::/64,fd01::/64"}, "fd00::/64,fd01::/64"},
	{[]string{"--cluster-cidr=10.0.0.0/8,fd00::/64,fd01::/64"}, "10.0.0.0/8,fd00::/64,fd01::/64"},
	{[]string{"--feature-gates=NoSuchGate=true"}, "NoSuchGate"},
	{[]string{"--feature-gates=allalpha=true"}, "allalpha"},                    // names are case-sensitive
	{[]string{"--feature-gates=NFTablesProxyMode=false"}, "NFTablesProxyMode"}, // GA, locked to true
}

func TestKubeProxyValidationOfFlags(t *testing.T) {
	for _, tt := range badCommandLines {
		args := append([]string{"--hostname-override=n"}, tt.args...)
		if _, code, stderr := resolved(t, args...); code != 1 || !strings.Contains(stderr, tt.mention) {
			t.Errorf("%q: exit %d, %q; want 1 naming %q", tt.args, code, stderr, tt.mention)
		}
	}
}

// The same checks apply to a --config file's values (start-up and reload both
// go through Options.finish).
func TestKubeProxyValidationOfConfigFile(t *testing.T) {
	for _, tt := range []struct{ old, new, mention string }{
		{"healthzBindAddress: \"\"", "healthzBindAddress: 1.2.3.4:70000", "70000"},
		{"metricsBindAddress: \"\"", "metricsBindAddress: 1.2.3.4:http", "http"},
		{"bindAddress: 0.0.0.0", "bindAddress: eth0", "eth0"},
		{"hostnameOverride: \"\"", "hostnameOverride: \"  \"", "hostnameOverride"},
		{"clusterCIDR: 10.244.0.0/16", "clusterCIDR: 10.0.0.0/8,10.1.0.0/16", "10.0.0.0/8,10.1.0.0/16"},
		{"bindAddressHardFail: false", "bindAddressHardFail: false\nfeatureGates: {NoSuchGate: true}", "NoSuchGate"},
	} {
		text := readKubeadmConfig(t)
		if !strings.Contains(text, tt.old) {
			t.Fatalf("kubeadm's file has no %q", tt.old)
		}
		path := writeFile(t, strings.Replace(text, tt.old, tt.new, 1))
		if _, code, stderr := resolved(t, "--config="+path); code != 1 || !strings.Contains(stderr, tt.mention) {
			t.Errorf("%s: exit %d, %q; want 1 naming %q", tt.new, code, stderr, tt.mention)
		}
	}
}

// What kube-proxy v1.34 accepts, kpipe accepts.
func TestKubeProxyValidationAccepts(t *testing.T) {
	for _, args := range [][]string{
		{"--healthz-bind-address=[::1]:10256", "--metrics-bind-address=::1"},
		{"--bind-address=::"},
		{"--hostname-override= Node-1 "},
		{"--cluster-cidr=10.0.0.0/8,fd00::/64"},
		{"--cluster-cidr=fd00::/64"},
		{"--detect-local-mode=NodeCIDR", "--cluster-cidr=10.0.0.0/8,10.1.0.0/16"}, // not read outside ClusterCIDR mode
		{"--feature-gates=AllAlpha=true,NFTablesProxyMode=true,LoggingAlphaOptions=true,WatchListClient=false"},
	} {
		if _, code, stderr := resolved(t, args...); code != 0 {
			t.Errorf("%q: exit %d, %q; want accepted", args, code, stderr)
		}
	}
	o, code, stderr := resolved(t, "--hostname-override= Node-1 ")
	if code != 0 || o.HostnameOverride != "node-1" {
		t.Errorf("--hostname-override=' Node-1 ': exit %d (%s), node name %q; want node-1", code, stderr, o.HostnameOverride)
	}
}
