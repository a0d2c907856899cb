package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kpipe/kpipe/stages/render"
)

// kubeadmConfig is the KubeProxyConfiguration kubeadm v1.34 puts in the
// kube-proxy ConfigMap (config.conf), byte for byte. Made with kubeadm built from
// k8s.io/kubernetes v1.34.4 (cmd/kubeadm, via the Go module proxy, in a throwaway
// copy of e2e/controlplane's module):
//
//	kubeadm init phase addon kube-proxy --print-manifest --config c.yaml
//
// where c.yaml is a v1beta4 ClusterConfiguration with networking.podSubnet
// 10.244.0.0/16 (kubeadm's clusterCIDR). `kubeadm config print init-defaults
// --component-configs KubeProxyConfiguration` prints the same document with
// clusterCIDR "" (no podSubnet).
const kubeadmConfig = "testdata/kubeadm-kube-proxy.conf"

// resolved runs the command line with a fake proxy and returns the options kpipe
// would have run with, the exit code and stderr.
func resolved(t *testing.T, args ...string) (*Options, int, string) {
	t.Helper()
	var got *Options
	code, stderr := captureStderr(t, func() int {
		return runWith(args, func(_ context.Context, o *Options) error { got = o; return nil })
	})
	return got, code, stderr
}

// captureStderr returns what f wrote to stderr. It swaps os.Stderr, so tests that
// use it do not run in parallel.
func captureStderr(t *testing.T, f func() int) (int, string) {
	t.Helper()
	return captureFile(t, &os.Stderr, f)
}

// captureStdout returns what f wrote to stdout, as captureStderr.
func captureStdout(t *testing.T, f func() int) (int, string) {
	t.Helper()
	return captureFile(t, &os.Stdout, f)
}

// captureFile points *file at a pipe while f runs and returns what f wrote to it.
func captureFile(t *testing.T, file **os.File, f func() int) (int, string) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	orig := *file
	*file = w
	out := make(chan string, 1)
	go func() {
		var b strings.Builder
		buf := make([]byte, 4096)
		for {
			n, err := r.Read(buf)
			b.Write(buf[:n])
			if err != nil {
				break
			}
		}
		out <- b.String()
	}()
	code := func() int {
		defer func() { *file = orig }()
		return f()
	}()
	w.Close()
	return code, <-out
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func readKubeadmConfig(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(kubeadmConfig)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The file kubeadm v1.34 writes into the kube-proxy ConfigMap: every zero value
// gets kube-proxy's default, as kube-proxy would run with it.
func TestConfigKubeadmFileGetsKubeProxyDefaults(t *testing.T) {
	o, code, stderr := resolved(t, "--config="+kubeadmConfig, "--hostname-override=Node-1")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	want := map[string]any{
		"Kubeconfig":          "/var/lib/kube-proxy/kubeconfig.conf",
		"HostnameOverride":    "node-1",
		"ClusterCIDR":         "10.244.0.0/16",
		"HealthzBindAddress":  "0.0.0.0:10256",
		"MetricsBindAddress":  "127.0.0.1:10249",
		"SyncPeriod":          30 * time.Second,
		"MinSyncPeriod":       time.Second,
		"MasqueradeBit":       14,
		"MasqueradeAll":       false,
		"LocalhostNodePorts":  true,
		"DetectLocalMode":     render.DetectClusterCIDR,
		"KubeAPIQPS":          float32(5),
		"KubeAPIBurst":        10,
		"KubeAPIContentType":  "application/vnd.kubernetes.protobuf",
		"LogLevel":            "info",
		"LogFormat":           "text",
		"EnableDebugHandlers": false,
		"EnableProfiling":     false,
		// kubeadm's conntrack fields and oomScoreAdj are null.
		"Conntrack": ConntrackOptions{MaxPerCore: 32 * 1024, Min: 128 * 1024,
			TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour},
		"OOMScoreAdj": int32(-999),
	}
	checkOptions(t, o, want)
	if len(o.NodePortAddresses) != 0 {
		t.Errorf("NodePortAddresses = %q; want none (all addresses)", o.NodePortAddresses)
	}
}

func checkOptions(t *testing.T, o *Options, want map[string]any) {
	t.Helper()
	v := reflect.ValueOf(o).Elem()
	for name, w := range want {
		if got := v.FieldByName(name).Interface(); !reflect.DeepEqual(got, w) {
			t.Errorf("%s = %v; want %v", name, got, w)
		}
	}
}

func TestConfigFieldsMapOntoOptions(t *testing.T) {
	cfg := strings.NewReplacer(
		"kubeconfig: /var/lib/kube-proxy/kubeconfig.conf", "kubeconfig: /k.conf",
		"qps: 0", "qps: 50", "burst: 0", "burst: 100", `contentType: ""`, "contentType: application/json",
		`hostnameOverride: ""`, "hostnameOverride: from-file",
		`healthzBindAddress: ""`, "healthzBindAddress: 127.0.0.1",
		`metricsBindAddress: ""`, "metricsBindAddress: 0.0.0.0:9999",
		"enableProfiling: false", "enableProfiling: true",
		`detectLocalMode: ""`, "detectLocalMode: InterfaceNamePrefix",
		`interfaceNamePrefix: ""`, "interfaceNamePrefix: veth",
		"nodePortAddresses: null", "nodePortAddresses: [primary]",
		"  localhostNodePorts: null\n  masqueradeAll: false\n  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s",
		"  localhostNodePorts: false\n  masqueradeAll: true\n  masqueradeBit: 12\n  minSyncPeriod: 2s\n  syncPeriod: 1m",
		"verbosity: 0", "verbosity: 5",
		`mode: ""`, "mode: iptables",
	).Replace(readKubeadmConfig(t))
	o, code, stderr := resolved(t, "--config="+writeFile(t, cfg))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	checkOptions(t, o, map[string]any{
		"Kubeconfig": "/k.conf", "KubeAPIQPS": float32(50), "KubeAPIBurst": 100, "KubeAPIContentType": "application/json",
		"HostnameOverride": "from-file", "HealthzBindAddress": "127.0.0.1:10256", "MetricsBindAddress": "0.0.0.0:9999",
		"EnableProfiling": true, "EnableDebugHandlers": false, "DetectLocalMode": render.DetectInterfacePrefix, "PodInterfaceprefix": "veth",
		"NodePortAddresses": []string{"primary"}, "LocalhostNodePorts": false, "MasqueradeAll": true, "MasqueradeBit": 12,
		"MinSyncPeriod": 2 * time.Second, "SyncPeriod": time.Minute, "LogLevel": "debug",
	})
}

// kubeadmVariant is kubeadm's config.conf with old replaced by new, failing
// the test if kubeadm's file has no old.
func kubeadmVariant(t *testing.T, old, new string) string {
	t.Helper()
	kubeadm := readKubeadmConfig(t)
	if !strings.Contains(kubeadm, old) {
		t.Fatalf("kubeadm's config.conf has no %q", old)
	}
	return strings.Replace(kubeadm, old, new, 1)
}

// A field kube-proxy's configuration does not have (udpIdleTimeout, from older
// kubeadm files) or a key given twice fails strict decoding only: kpipe, as
// kube-proxy's loadConfig, decodes the file leniently and runs with the rest of
// it. The strict error, naming the field, is kept for the log.
func TestConfigUnknownOrDuplicateFieldIsDecodedLeniently(t *testing.T) {
	for _, tt := range []struct{ name, content, field string }{
		{"unknown field", readKubeadmConfig(t) + "udpIdleTimeout: 250ms\n", "udpIdleTimeout"},
		{"unknown nested field", kubeadmVariant(t, "  masqueradeAll: false\n", "  masqueradeAll: true\n  masqueradeEverything: true\n"), "masqueradeEverything"},
		{"duplicate key", readKubeadmConfig(t) + "hostnameOverride: \"\"\n", "hostnameOverride"},
	} {
		o, code, stderr := resolved(t, "--config="+writeFile(t, tt.content), "--hostname-override=n1")
		if code != 0 {
			t.Errorf("%s: exit %d; want kpipe to run with the file decoded leniently: %s", tt.name, code, stderr)
			continue
		}
		checkOptions(t, o, map[string]any{"ClusterCIDR": "10.244.0.0/16", "Kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf",
			"MasqueradeAll": tt.field == "masqueradeEverything"})
		if o.lenientDecode == nil || !strings.Contains(o.lenientDecode.Error(), tt.field) {
			t.Errorf("%s: strict decoding error %v; want one naming %s", tt.name, o.lenientDecode, tt.field)
		}
	}
	o, code, stderr := resolved(t, "--config="+kubeadmConfig, "--hostname-override=n1")
	if code != 0 || o.lenientDecode != nil {
		t.Errorf("kubeadm's own file: exit %d, strict decoding error %v; want it decoded strictly: %s", code, o.lenientDecode, stderr)
	}
}

// What lenient decoding cannot read, or a file of another kind or version, or
// no file at all, is still an error naming what is wrong.
func TestConfigRejectsBadFiles(t *testing.T) {
	tests := []struct{ name, content, mention string }{
		{"wrong type", kubeadmVariant(t, "masqueradeAll: false", "masqueradeAll: sometimes"), "masqueradeAll"},
		{"wrong kind", kubeadmVariant(t, "kind: KubeProxyConfiguration", "kind: KubeletConfiguration"), "KubeletConfiguration"},
		{"wrong apiVersion", kubeadmVariant(t, "apiVersion: kubeproxy.config.k8s.io/v1alpha1", "apiVersion: kubeproxy.config.k8s.io/v1beta1"), "v1beta1"},
		{"other mode", kubeadmVariant(t, `mode: ""`, "mode: ipvs"), "ipvs"},
		{"not yaml", "{{{", "config"},
	}
	for _, tt := range tests {
		_, code, stderr := resolved(t, "--config="+writeFile(t, tt.content))
		if code != 1 || !strings.Contains(stderr, tt.mention) {
			t.Errorf("%s: exit %d, %q; want 1 naming %q", tt.name, code, stderr, tt.mention)
		}
	}
	if _, code, stderr := resolved(t, "--config=/no/such/file"); code != 1 || !strings.Contains(stderr, "/no/such/file") {
		t.Errorf("missing file: exit %d, %q; want 1 naming the file", code, stderr)
	}
}

// As kube-proxy: with --config, the file is the configuration. A flag that has
// a field in the file is ignored, even if the file leaves that field out;
// --hostname-override, --master and the logging flags apply over the file, and
// kpipe's own flags (no field in the file) apply as without it.
func TestConfigFileWinsOverFlags(t *testing.T) {
	o, code, stderr := resolved(t, "--config="+kubeadmConfig,
		// ignored:
		"--iptables-min-sync-period=5s", "--iptables-sync-period=10s", "--cluster-cidr=10.1.0.0/16", "--kubeconfig=/flag.conf",
		"--masquerade-all", "--iptables-masquerade-bit=3", "--metrics-bind-address=127.0.0.1:9000", "--healthz-bind-address=127.0.0.1:9001",
		"--kube-api-qps=7", "--kube-api-burst=8", "--kube-api-content-type=application/json", "--conntrack-min=100", "--oom-score-adj=5",
		"--feature-gates=SomeGate=true", "--bind-address-hard-fail", "--profiling", "--nodeport-addresses=primary",
		"--detect-local-mode=NodeCIDR", "--iptables-localhost-nodeports=false",
		// applied:
		"--hostname-override=Node-A", "--master=https://192.0.2.2:6443", "--v=4", "--logging-format=json",
		"--canary-interval=7s", "--iptables-writer=restore", "--enable-debug-handlers")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	checkOptions(t, o, map[string]any{
		"MinSyncPeriod": time.Second, "SyncPeriod": 30 * time.Second, "ClusterCIDR": "10.244.0.0/16",
		"Kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf", "MasqueradeAll": false, "MasqueradeBit": 14,
		"MetricsBindAddress": "127.0.0.1:10249", "HealthzBindAddress": "0.0.0.0:10256",
		"KubeAPIQPS": float32(5), "KubeAPIBurst": 10, "KubeAPIContentType": "application/vnd.kubernetes.protobuf",
		"OOMScoreAdj": int32(-999), "FeatureGates": map[string]bool{}, "BindAddressHardFail": false, "EnableProfiling": false,
		"NodePortAddresses": []string(nil), "DetectLocalMode": render.DetectClusterCIDR, "LocalhostNodePorts": true,
		"HostnameOverride": "node-a", "Master": "https://192.0.2.2:6443", "LogLevel": "debug", "LogFormat": "json",
		"CanaryInterval": 7 * time.Second, "IptablesWriter": "restore", "EnableDebugHandlers": true,
	})
	if o.Conntrack.Min != 128*1024 {
		t.Errorf("conntrack min %d; want the file's (kube-proxy's default) 131072, not --conntrack-min", o.Conntrack.Min)
	}
}

func TestBareIPBindAddressesGetDefaultPorts(t *testing.T) {
	tests := []struct {
		args             []string
		healthz, metrics string
	}{
		{[]string{"--healthz-bind-address=127.0.0.1", "--metrics-bind-address=127.0.0.1"}, "127.0.0.1:10256", "127.0.0.1:10249"},
		{[]string{"--healthz-bind-address=::1", "--metrics-bind-address=0.0.0.0"}, "[::1]:10256", "0.0.0.0:10249"},
		{[]string{"--metrics-bind-address="}, "0.0.0.0:10256", ""},
	}
	for _, tt := range tests {
		o, code, stderr := resolved(t, tt.args...)
		if code != 0 {
			t.Fatalf("%q: exit %d: %s", tt.args, code, stderr)
		}
		if o.HealthzBindAddress != tt.healthz || o.MetricsBindAddress != tt.metrics {
			t.Errorf("%q: healthz %q metrics %q; want %q %q", tt.args, o.HealthzBindAddress, o.MetricsBindAddress, tt.healthz, tt.metrics)
		}
	}
	cfg := strings.NewReplacer(`healthzBindAddress: ""`, "healthzBindAddress: 10.0.0.1", "bindAddress: 0.0.0.0", "bindAddress: '::'").Replace(readKubeadmConfig(t))
	o, code, stderr := resolved(t, "--config="+writeFile(t, cfg))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if o.HealthzBindAddress != "10.0.0.1:10256" || o.MetricsBindAddress != "[::1]:10249" {
		t.Errorf("file: healthz %q metrics %q; want 10.0.0.1:10256 and [::1]:10249 (IPv6 bindAddress)", o.HealthzBindAddress, o.MetricsBindAddress)
	}
}

// writeConfigTo runs kpipe with args and --write-config-to, and returns the
// path of the file written. The proxy must not run.
func writeConfigTo(t *testing.T, args ...string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "written.yaml")
	ran := false
	code, stderr := captureStderr(t, func() int {
		return runWith(append(args, "--write-config-to="+out), func(context.Context, *Options) error { ran = true; return nil })
	})
	if code != 0 || ran {
		t.Fatalf("%q: exit %d (ran the proxy: %v): %s", args, code, ran, stderr)
	}
	return out
}

// --write-config-to writes what kpipe would run with, and that file reads back
// to the same options.
func TestWriteConfigToRoundTrips(t *testing.T) {
	out := writeConfigTo(t, "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf", "--cluster-cidr=10.244.0.0/16",
		"--hostname-override=n1", "--masquerade-all")
	o, code, stderr := resolved(t, "--config="+out)
	if code != 0 {
		t.Fatalf("reading the written config: exit %d: %s", code, stderr)
	}
	checkOptions(t, o, map[string]any{"HostnameOverride": "n1", "MasqueradeAll": true, "ClusterCIDR": "10.244.0.0/16",
		"Kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf", "SyncPeriod": 30 * time.Second, "MasqueradeBit": 14})
}

// As kube-proxy's, the written configuration (and /configz) has the
// hostnameOverride the flag or the file gave, and none when neither did: a
// file written once and shared by every node must not pin them all to the name
// of the machine that wrote it.
func TestWriteConfigToLeavesHostnameOverrideAsGiven(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		want string
	}{
		{"no flag, no file", nil, ""},
		{"kubeadm's file", []string{"--config=" + kubeadmConfig}, ""},
		{"flag", []string{"--hostname-override=Node-1"}, "node-1"},
		{"flag over kubeadm's file", []string{"--config=" + kubeadmConfig, "--hostname-override=Node-1"}, "node-1"},
		{"file", []string{"--config=" + writeFile(t, kubeadmVariant(t, `hostnameOverride: ""`, "hostnameOverride: from-file"))}, "from-file"},
	} {
		if got := readYAML(t, writeConfigTo(t, tt.args...))["hostnameOverride"]; got != tt.want {
			t.Errorf("%s: --write-config-to wrote hostnameOverride %q; want %q", tt.name, got, tt.want)
		}
		o, code, stderr := resolved(t, tt.args...)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", tt.name, code, stderr)
		}
		if got := o.configz().HostnameOverride; got != tt.want {
			t.Errorf("%s: /configz has HostnameOverride %q; want %q", tt.name, got, tt.want)
		}
	}
}

// readYAML returns the YAML document at path as a map.
func readYAML(t *testing.T, path string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return m
}

// kube-proxy's command line, as kube-proxy's own manifests and harnesses pass it.
func TestKubeProxyCommandLineIsAccepted(t *testing.T) {
	o, code, stderr := resolved(t, "--v=2", "--conntrack-max-per-core=0", "--conntrack-min=0", "--conntrack-tcp-timeout-established=1h",
		"--conntrack-tcp-timeout-close-wait=1h", "--conntrack-udp-timeout=30s", "--conntrack-udp-timeout-stream=2m", "--oom-score-adj=-999",
		"--ipvs-scheduler=rr", "--ipvs-sync-period=5s", "--ipvs-exclude-cidrs=10.0.0.0/8", "--ipvs-strict-arp",
		"--kubeconfig=/kc", "--hostname_override=node-a", "--bind-address=0.0.0.0", "--kube-api-qps=20", "--kube-api-burst=40",
		"--kube-api-content-type=application/json", "--profiling", "--feature-gates=AllAlpha=false,WatchListClient=true", "--master=https://10.0.0.1:6443")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	checkOptions(t, o, map[string]any{"HostnameOverride": "node-a", "Kubeconfig": "/kc", "KubeAPIQPS": float32(20), "KubeAPIBurst": 40,
		"KubeAPIContentType": "application/json", "EnableProfiling": true, "EnableDebugHandlers": false, "LogLevel": "info", "Master": "https://10.0.0.1:6443",
		"FeatureGates": map[string]bool{"AllAlpha": false, "WatchListClient": true}})
	wantIgnored := []string{"ipvs-exclude-cidrs", "ipvs-scheduler", "ipvs-strict-arp", "ipvs-sync-period"}
	if !reflect.DeepEqual(o.ignoredGiven, wantIgnored) {
		t.Errorf("ignored flags %q; want %q", o.ignoredGiven, wantIgnored)
	}
}

func TestVerbosityMapsOntoLogLevel(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--v=0"}, "info"}, {[]string{"-v", "2"}, "info"}, {[]string{"--v=3"}, "info"},
		{[]string{"--v=4"}, "debug"}, {[]string{"-v=6"}, "debug"},
		{[]string{"--v=6", "--log-level=warn"}, "warn"}, // kpipe's own flag wins
	} {
		o, code, stderr := resolved(t, tt.args...)
		if code != 0 {
			t.Fatalf("%q: exit %d: %s", tt.args, code, stderr)
		}
		if o.LogLevel != tt.want {
			t.Errorf("%q: log level %q; want %q", tt.args, o.LogLevel, tt.want)
		}
	}
}

func TestKubeProxyCommandLineErrors(t *testing.T) {
	for _, tt := range []struct {
		args    []string
		mention string
	}{
		{[]string{"--not-a-kube-proxy-flag"}, "not-a-kube-proxy-flag"},
		{[]string{"--conntrack-min=lots"}, "conntrack-min"},
		{[]string{"--oom-score-adj=-1001"}, "oom-score-adj"},
		{[]string{"--conntrack-udp-timeout=-1s"}, "conntrack"},
		{[]string{"--v=high"}, "v"},
		{[]string{"--feature-gates=Gate=maybe"}, "feature-gates"},
	} {
		_, code, stderr := resolved(t, tt.args...)
		if code != 1 || !strings.Contains(stderr, tt.mention) {
			t.Errorf("%q: exit %d, %q; want 1 naming %q", tt.args, code, stderr, tt.mention)
		}
	}
}

// clientConnection's qps, burst, contentType and kubeconfig (and --master) reach
// the apiserver client.
func TestClientConnectionReachesTheClient(t *testing.T) {
	kubeconfig := writeFile(t, `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://192.0.2.1:6443"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`)
	cfg := strings.NewReplacer("kubeconfig: /var/lib/kube-proxy/kubeconfig.conf", "kubeconfig: "+kubeconfig,
		"qps: 0", "qps: 50", "burst: 0", "burst: 100", `contentType: ""`, "contentType: application/json").Replace(readKubeadmConfig(t))
	o, code, stderr := resolved(t, "--config="+writeFile(t, cfg), "--master=https://192.0.2.2:6443")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	rc, err := clientConfig(o)
	if err != nil {
		t.Fatal(err)
	}
	if rc.QPS != 50 || rc.Burst != 100 || rc.ContentType != "application/json" || rc.Host != "https://192.0.2.2:6443" || rc.BearerToken != "t" {
		t.Errorf("rest config QPS %v burst %d content type %q host %q token %q; want 50, 100, application/json, https://192.0.2.2:6443, t",
			rc.QPS, rc.Burst, rc.ContentType, rc.Host, rc.BearerToken)
	}
}

// toInternal is kube-proxy's v1alpha1 → internal conversion for the iptables
// mode, and the result has the internal type's JSON shape (Go field names):
// what kube-proxy's /configz shows.
func TestToInternalIsKubeProxysConfigzShape(t *testing.T) {
	c, strictErr, err := loadConfigFile(writeFile(t, `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
featureGates: {SomeGate: true}
clientConnection: {kubeconfig: /kc, acceptContentTypes: a/b, contentType: application/json, qps: 7, burst: 9}
logging: {format: json, verbosity: 3, flushFrequency: 2s}
hostnameOverride: node-a
bindAddress: 10.0.0.1
healthzBindAddress: 10.0.0.1
metricsBindAddress: 10.0.0.1:9999
bindAddressHardFail: true
enableProfiling: true
showHiddenMetricsForVersion: "1.33"
mode: iptables
iptables: {masqueradeAll: true, masqueradeBit: 13, localhostNodePorts: false, syncPeriod: 11s, minSyncPeriod: 2s}
ipvs: {syncPeriod: 12s, minSyncPeriod: 3s, scheduler: rr, excludeCIDRs: [10.9.0.0/16], strictARP: true, tcpTimeout: 1s, tcpFinTimeout: 2s, udpTimeout: 3s}
nftables: {masqueradeAll: false, masqueradeBit: 12, syncPeriod: 13s, minSyncPeriod: 4s}
conntrack: {maxPerCore: 5, min: 6, tcpEstablishedTimeout: 7s, tcpCloseWaitTimeout: 8s, tcpBeLiberal: true, udpTimeout: 9s, udpStreamTimeout: 10s}
configSyncPeriod: 14s
nodePortAddresses: [10.0.0.0/8]
oomScoreAdj: -5
clusterCIDR: 10.244.0.0/16,fd00::/48
detectLocalMode: InterfaceNamePrefix
detectLocal: {bridgeInterface: br0, interfaceNamePrefix: veth}
portRange: 30000-30010
winkernel: {networkName: net1, sourceVip: 1.2.3.4, enableDSR: true, rootHnsEndpointName: r, forwardHealthCheckVip: true}
windowsRunAsService: true
`))
	if err != nil || strictErr != nil {
		t.Fatal(err, strictErr)
	}
	got, err := json.Marshal(toInternal(c))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"Linux":{"Conntrack":{"MaxPerCore":5,"Min":6,"TCPEstablishedTimeout":"7s","TCPCloseWaitTimeout":"8s",
"TCPBeLiberal":true,"UDPTimeout":"9s","UDPStreamTimeout":"10s"},"MasqueradeAll":true,"OOMScoreAdj":-5},
"Windows":{"RunAsService":true},"FeatureGates":{"SomeGate":true},
"ClientConnection":{"Kubeconfig":"/kc","AcceptContentTypes":"a/b","ContentType":"application/json","QPS":7,"Burst":9},
"Logging":{"format":"json","flushFrequency":"2s","verbosity":3,"options":{"text":{"infoBufferSize":"0"},"json":{"infoBufferSize":"0"}}},
"HostnameOverride":"node-a","BindAddress":"10.0.0.1","HealthzBindAddress":"10.0.0.1:10256","MetricsBindAddress":"10.0.0.1:9999",
"BindAddressHardFail":true,"EnableProfiling":true,"ShowHiddenMetricsForVersion":"1.33","Mode":"iptables",
"IPTables":{"MasqueradeBit":13,"LocalhostNodePorts":false},
"IPVS":{"Scheduler":"rr","ExcludeCIDRs":["10.9.0.0/16"],"StrictARP":true,"TCPTimeout":"1s","TCPFinTimeout":"2s","UDPTimeout":"3s"},
"Winkernel":{"NetworkName":"net1","SourceVip":"1.2.3.4","EnableDSR":true,"RootHnsEndpointName":"r","ForwardHealthCheckVip":true},
"NFTables":{"MasqueradeBit":12},"DetectLocalMode":"InterfaceNamePrefix",
"DetectLocal":{"BridgeInterface":"br0","ClusterCIDRs":["10.244.0.0/16","fd00::/48"],"InterfaceNamePrefix":"veth"},
"NodePortAddresses":["10.0.0.0/8"],"SyncPeriod":"11s","MinSyncPeriod":"2s","ConfigSyncPeriod":"14s"}`
	if string(got) != strings.ReplaceAll(want, "\n", "") {
		t.Errorf("toInternal as JSON:\n%s\nwant:\n%s", got, strings.ReplaceAll(want, "\n", ""))
	}
}

// /configz shows the configuration kpipe runs with: the file's, the flags
// that apply over it, kube-proxy's defaults (other modes' too) where both are
// silent.
func TestConfigzIsTheEffectiveConfiguration(t *testing.T) {
	cfg := writeFile(t, kubeadmVariant(t, "  syncPeriod: 0s\nipvs:", "  syncPeriod: 10s\nipvs:"))
	o, code, stderr := resolved(t, "--config="+cfg, "--hostname-override=n1", "--v=4")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	c := o.configz()
	if c.HostnameOverride != "n1" || c.SyncPeriod.Duration != 10*time.Second || c.Logging.Verbosity != 4 || c.Mode != "iptables" ||
		c.DetectLocalMode != "ClusterCIDR" || !reflect.DeepEqual(c.DetectLocal.ClusterCIDRs, []string{"10.244.0.0/16"}) {
		t.Errorf("flags and file: hostname %q syncPeriod %v verbosity %d mode %q detectLocalMode %q clusterCIDRs %v",
			c.HostnameOverride, c.SyncPeriod, c.Logging.Verbosity, c.Mode, c.DetectLocalMode, c.DetectLocal.ClusterCIDRs)
	}
	if c.ConfigSyncPeriod.Duration != 15*time.Minute || *c.NFTables.MasqueradeBit != 14 || *c.Linux.OOMScoreAdj != -999 ||
		c.FeatureGates == nil || c.Logging.FlushFrequency.Duration.Duration != 5*time.Second {
		t.Errorf("kube-proxy's defaults: configSyncPeriod %v nftables masqueradeBit %d oomScoreAdj %d featureGates %v flushFrequency %v",
			c.ConfigSyncPeriod, *c.NFTables.MasqueradeBit, *c.Linux.OOMScoreAdj, c.FeatureGates, c.Logging.FlushFrequency)
	}
}
