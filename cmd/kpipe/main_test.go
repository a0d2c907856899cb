package main

import (
	"context"
	"errors"
	"net/netip"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/kpipe/kpipe/bus"
)

// runCaptured runs the command line and returns its exit code and what it wrote to
// stderr (see captureStderr).
func runCaptured(t *testing.T, args ...string) (int, string) {
	t.Helper()
	return captureStderr(t, func() int { return run(args) })
}

func TestRunRejectsOtherProxyModes(t *testing.T) {
	for _, mode := range []string{"ipvs", "nftables", "kernelspace"} {
		code, stderr := runCaptured(t, "--proxy-mode", mode)
		if code != 1 {
			t.Errorf("--proxy-mode %s: exit %d; want 1", mode, code)
		}
		if !strings.Contains(stderr, "iptables") || !strings.Contains(stderr, mode) {
			t.Errorf("--proxy-mode %s: message %q; want it to name %s and iptables", mode, stderr, mode)
		}
	}
}

func TestRunUsageErrors(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		mention string // what the message must name
	}{
		{"unknown flag", []string{"--no-such-flag"}, "no-such-flag"},
		{"flag without value", []string{"--iptables-sync-period"}, "iptables-sync-period"},
		{"unparsable duration", []string{"--iptables-sync-period", "soon"}, "iptables-sync-period"},
		{"zero sync period", []string{"--iptables-sync-period", "0s"}, "iptables-sync-period"},
		{"negative sync period", []string{"--iptables-sync-period=-5s"}, "iptables-sync-period"},
		{"min sync period above sync period", []string{"--iptables-sync-period", "10s", "--iptables-min-sync-period", "1m"}, "iptables-min-sync-period"},
		{"negative min sync period", []string{"--iptables-min-sync-period=-1s"}, "iptables-min-sync-period"},
		{"negative canary interval", []string{"--canary-interval=-1s"}, "canary-interval"},
		{"masquerade bit too big", []string{"--iptables-masquerade-bit", "32"}, "iptables-masquerade-bit"},
		{"masquerade bit negative", []string{"--iptables-masquerade-bit=-1"}, "iptables-masquerade-bit"},
		{"not a number", []string{"--iptables-masquerade-bit", "fourteen"}, "iptables-masquerade-bit"},
		{"bad cluster CIDR", []string{"--cluster-cidr", "10.244.0.0/33"}, "cluster-cidr"},
		{"cluster CIDR without length", []string{"--cluster-cidr", "10.244.0.0"}, "cluster-cidr"},
		{"one bad cluster CIDR of two", []string{"--cluster-cidr", "10.244.0.0/16,fd00::/129"}, "cluster-cidr"},
		{"bad nodeport address", []string{"--nodeport-addresses", "eth0"}, "nodeport-addresses"},
		{"primary with CIDRs", []string{"--nodeport-addresses", "primary,10.0.0.0/8"}, "primary"},
		{"unknown detect-local-mode", []string{"--detect-local-mode", "PodCIDR"}, "detect-local-mode"},
		{"bridge mode without bridge", []string{"--detect-local-mode", "BridgeInterface"}, "pod-bridge-interface"},
		{"prefix mode without prefix", []string{"--detect-local-mode", "InterfaceNamePrefix"}, "pod-interface-name-prefix"},
		{"bad log format", []string{"--log-format", "xml"}, "log-format"},
		{"bad log level", []string{"--log-level", "verbose"}, "log-level"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stderr := runCaptured(t, tt.args...)
			if code != 1 {
				t.Errorf("exit %d; want 1 (stderr %q)", code, stderr)
			}
			if !strings.Contains(stderr, tt.mention) {
				t.Errorf("message %q does not name %q", stderr, tt.mention)
			}
		})
	}
}

// parse runs the flags through the real flag set and completes them.
func parse(t *testing.T, args ...string) (*Options, error) {
	t.Helper()
	o := defaultOptions()
	fs := pflag.NewFlagSet("kpipe", pflag.ContinueOnError)
	o.addFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse %v: %v", args, err)
	}
	return o, o.complete()
}

func TestCompleteAcceptsDetectLocalModes(t *testing.T) {
	for _, args := range [][]string{
		{"--detect-local-mode", "ClusterCIDR", "--cluster-cidr", "10.244.0.0/16"},
		{"--detect-local-mode", "NodeCIDR"},
		{"--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cni0"},
		{"--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"},
	} {
		if _, err := parse(t, append(args, "--hostname-override", "n")...); err != nil {
			t.Errorf("%v: %v; want accepted", args, err)
		}
	}
}

func TestCompleteClusterCIDRsPerFamily(t *testing.T) {
	o, err := parse(t, "--cluster-cidr", " 10.244.1.0/16 , fd00:10:244::1/56,", "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	v4 := o.forFamily(bus.IPv4, hostFacts{}).render
	v6 := o.forFamily(bus.IPv6, hostFacts{}).render
	if want := []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}; !slices.Equal(v4.ClusterCIDRs, want) {
		t.Errorf("IPv4 cluster CIDRs = %v; want %v (masked, IPv4 only)", v4.ClusterCIDRs, want)
	}
	if want := []netip.Prefix{netip.MustParsePrefix("fd00:10:244::/56")}; !slices.Equal(v6.ClusterCIDRs, want) {
		t.Errorf("IPv6 cluster CIDRs = %v; want %v (masked, IPv6 only)", v6.ClusterCIDRs, want)
	}
	if v4.Family != bus.IPv4 || v6.Family != bus.IPv6 {
		t.Errorf("families = %v, %v", v4.Family, v6.Family)
	}

	o, err = parse(t, "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	if got := o.forFamily(bus.IPv4, hostFacts{}).render.ClusterCIDRs; len(got) != 0 {
		t.Errorf("no --cluster-cidr gives %v; want none", got)
	}
}

func TestCompleteNodePortAddresses(t *testing.T) {
	o, err := parse(t, "--nodeport-addresses", "primary", "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		c := o.forFamily(f, hostFacts{}).render
		if !c.NodePortPrimary || len(c.NodePortAddresses) != 0 {
			t.Errorf("%v: primary=%v addresses=%v; want primary and no CIDRs", f, c.NodePortPrimary, c.NodePortAddresses)
		}
	}

	o, err = parse(t, "--nodeport-addresses", "192.168.0.7/24,fd00::/64", "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	v4, v6 := o.forFamily(bus.IPv4, hostFacts{}).render, o.forFamily(bus.IPv6, hostFacts{}).render
	if v4.NodePortPrimary || !slices.Equal(v4.NodePortAddresses, []netip.Prefix{netip.MustParsePrefix("192.168.0.0/24")}) {
		t.Errorf("IPv4: primary=%v addresses=%v", v4.NodePortPrimary, v4.NodePortAddresses)
	}
	if !slices.Equal(v6.NodePortAddresses, []netip.Prefix{netip.MustParsePrefix("fd00::/64")}) {
		t.Errorf("IPv6 addresses = %v", v6.NodePortAddresses)
	}

	o, err = parse(t, "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	if c := o.forFamily(bus.IPv4, hostFacts{}).render; c.NodePortPrimary || len(c.NodePortAddresses) != 0 {
		t.Errorf("default: primary=%v addresses=%v; want every local address", c.NodePortPrimary, c.NodePortAddresses)
	}
}

func TestCompleteDefaults(t *testing.T) {
	o, err := parse(t, "--hostname-override", "  Node-A.Example ", "--iptables-sync-period", "45s")
	if err != nil {
		t.Fatal(err)
	}
	if o.HostnameOverride != "node-a.example" {
		t.Errorf("node name = %q; want trimmed and lower-cased", o.HostnameOverride)
	}
	if o.CanaryInterval != 45*time.Second {
		t.Errorf("canary interval = %v; want the sync period", o.CanaryInterval)
	}
	v4, v6 := o.forFamily(bus.IPv4, hostFacts{conntrackLiberal: true}).render, o.forFamily(bus.IPv6, hostFacts{conntrackLiberal: true}).render
	if !v4.LocalhostNodePorts || v6.LocalhostNodePorts {
		t.Errorf("localhost NodePorts v4=%v v6=%v; want IPv4 only", v4.LocalhostNodePorts, v6.LocalhostNodePorts)
	}
	if v4.NodeName != "node-a.example" || v4.MasqueradeBit != 14 || !v4.ConntrackLiberal {
		t.Errorf("render config = %+v", v4)
	}

	o, err = parse(t, "--hostname-override", "n", "--iptables-localhost-nodeports=false", "--canary-interval", "3s")
	if err != nil {
		t.Fatal(err)
	}
	if o.forFamily(bus.IPv4, hostFacts{}).render.LocalhostNodePorts {
		t.Error("--iptables-localhost-nodeports=false ignored")
	}
	if o.CanaryInterval != 3*time.Second {
		t.Errorf("canary interval = %v; want 3s", o.CanaryInterval)
	}
}

func TestCompleteIsRepeatable(t *testing.T) {
	// complete derives its parsed forms afresh: calling it again does not double them.
	o, err := parse(t, "--cluster-cidr", "10.244.0.0/16", "--nodeport-addresses", "10.0.0.0/8", "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	if err := o.complete(); err != nil {
		t.Fatal(err)
	}
	c := o.forFamily(bus.IPv4, hostFacts{}).render
	if len(c.ClusterCIDRs) != 1 || len(c.NodePortAddresses) != 1 {
		t.Errorf("after a second complete: cluster %v nodeport %v; want one each", c.ClusterCIDRs, c.NodePortAddresses)
	}
}

// TestLocalhostNodePortsFollowNodePortAddresses: NodePorts answer on 127.0.0.1
// only when 127.0.0.1 is among the NodePort addresses, as in kube-proxy.
func TestLocalhostNodePortsFollowNodePortAddresses(t *testing.T) {
	cases := []struct {
		flags []string
		want  bool
	}{
		{nil, true},
		{[]string{"--iptables-localhost-nodeports=false"}, false},
		{[]string{"--nodeport-addresses=192.168.0.0/16"}, false},
		{[]string{"--nodeport-addresses=192.168.0.0/16,127.0.0.0/8"}, true},
		{[]string{"--nodeport-addresses=0.0.0.0/0"}, true},
		{[]string{"--nodeport-addresses=fd00::/8"}, true},
		{[]string{"--nodeport-addresses=primary"}, false},
	}
	for _, tc := range cases {
		o := defaultOptions()
		fs := pflag.NewFlagSet("kpipe", pflag.ContinueOnError)
		o.addFlags(fs)
		if err := fs.Parse(append([]string{"--hostname-override=n"}, tc.flags...)); err != nil {
			t.Fatal(err)
		}
		if err := o.complete(); err != nil {
			t.Fatalf("%v: %v", tc.flags, err)
		}
		if got := o.forFamily(bus.IPv4, hostFacts{}).render.LocalhostNodePorts; got != tc.want {
			t.Errorf("%v: localhost NodePorts = %v, want %v", tc.flags, got, tc.want)
		}
	}
	o := defaultOptions()
	o.HostnameOverride, o.NodePortAddresses = "n", []string{"0.0.0.0/0", "192.168.0.0/16"}
	if err := o.complete(); err != nil || len(o.nodePortCIDRs) != 0 {
		t.Errorf("0.0.0.0/0 must mean every IPv4 address: cidrs %v, err %v", o.nodePortCIDRs, err)
	}
}

// TestGCTargetUnlessGOGCIsSet: kpipe collects at 1.5 times the live heap
// unless the operator set GOGC (any value, "off" too), which it leaves alone.
func TestGCTargetUnlessGOGCIsSet(t *testing.T) {
	const theirs = 100
	old := debug.SetGCPercent(theirs)
	defer debug.SetGCPercent(old)
	for _, tt := range []struct {
		env  map[string]string
		want int
	}{
		{env: map[string]string{}, want: gcPercent},
		{env: map[string]string{"GOGC": "100"}, want: theirs},
		{env: map[string]string{"GOGC": "off"}, want: theirs},
	} {
		debug.SetGCPercent(theirs)
		tuneGC(func(k string) (string, bool) { v, ok := tt.env[k]; return v, ok })
		if got := debug.SetGCPercent(theirs); got != tt.want {
			t.Errorf("with %v: GC percent %d; want %d", tt.env, got, tt.want)
		}
	}
	if gcPercent >= theirs {
		t.Fatalf("gcPercent %d is not below Go's default", gcPercent)
	}
}

// An error is one line on stderr, even when it carries a tool's stderr of
// several lines.
func TestRunPrintsAnErrorOnOneLine(t *testing.T) {
	failing := func(context.Context, *Options) error {
		return errors.New("read the node's IPv4 nat rules: iptables-save: exit status 1:\nline one\nline two\n")
	}
	code, stderr := captureStderr(t, func() int { return runWith(nil, failing) })
	if want := "kpipe: read the node's IPv4 nat rules: iptables-save: exit status 1:; line one; line two\n"; code != 1 || stderr != want {
		t.Fatalf("exit %d, stderr %q; want 1, %q", code, stderr, want)
	}
}
