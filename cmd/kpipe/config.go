package main

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"time"

	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	kubeproxy "k8s.io/kube-proxy/config/v1alpha1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// kube-proxy's default ports for a bind address given as a bare IP.
const (
	healthzPort = 10256
	metricsPort = 10249
)

// loadConfigFile reads a KubeProxyConfiguration strictly (an unknown or duplicate
// field is an error naming it) and applies kube-proxy's defaults to its zero values.
func loadConfigFile(path string) (*kubeproxy.KubeProxyConfiguration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, usagef("--config: %v", err)
	}
	scheme := runtime.NewScheme()
	if err := kubeproxy.AddToScheme(scheme); err != nil {
		return nil, err
	}
	codecs := serializer.NewCodecFactory(scheme, serializer.EnableStrict)
	obj, gvk, err := codecs.UniversalDeserializer().Decode(data, nil, nil)
	if err != nil {
		return nil, usagef("--config %s: %v", path, err)
	}
	cfg, ok := obj.(*kubeproxy.KubeProxyConfiguration)
	if !ok {
		return nil, usagef("--config %s: got %v, want kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration", path, gvk)
	}
	setConfigDefaults(cfg)
	return cfg, nil
}

// setConfigDefaults gives zero values kube-proxy's defaults, as upstream's
// SetDefaults_KubeProxyConfiguration does, for the fields kpipe reads.
func setConfigDefaults(c *kubeproxy.KubeProxyConfiguration) {
	if c.BindAddress == "" {
		c.BindAddress = "0.0.0.0"
	}
	healthzHost, metricsHost := "0.0.0.0", "127.0.0.1"
	if a, err := netip.ParseAddr(c.BindAddress); err == nil && a.Unmap().Is6() {
		healthzHost, metricsHost = "::", "::1"
	}
	c.HealthzBindAddress = defaultBindAddress(c.HealthzBindAddress, healthzHost, healthzPort)
	c.MetricsBindAddress = defaultBindAddress(c.MetricsBindAddress, metricsHost, metricsPort)
	if c.IPTables.SyncPeriod.Duration == 0 {
		c.IPTables.SyncPeriod.Duration = 30 * time.Second
	}
	if c.IPTables.MinSyncPeriod.Duration == 0 {
		c.IPTables.MinSyncPeriod.Duration = time.Second
	}
	if c.IPTables.LocalhostNodePorts == nil {
		c.IPTables.LocalhostNodePorts = ptr.To(true)
	}
	if c.IPTables.MasqueradeBit == nil {
		c.IPTables.MasqueradeBit = ptr.To[int32](14)
	}
	if c.ClientConnection.ContentType == "" {
		c.ClientConnection.ContentType = "application/vnd.kubernetes.protobuf"
	}
	if c.ClientConnection.QPS == 0 {
		c.ClientConnection.QPS = 5
	}
	if c.ClientConnection.Burst == 0 {
		c.ClientConnection.Burst = 10
	}
	if c.Logging.Format == "" {
		c.Logging.Format = "text"
	}
}

// defaultBindAddress is kube-proxy's reading of a bind address: empty gets the
// default host and port, a bare IP gets the default port.
func defaultBindAddress(addr, host string, port int) string {
	if addr == "" {
		return net.JoinHostPort(host, strconv.Itoa(port))
	}
	return withDefaultPort(addr, port)
}

// withDefaultPort appends port to a bare IP; anything else is returned as is.
func withDefaultPort(addr string, port int) string {
	if _, _, err := net.SplitHostPort(addr); err == nil {
		return addr
	}
	if a, err := netip.ParseAddr(addr); err == nil {
		return net.JoinHostPort(a.String(), strconv.Itoa(port))
	}
	return addr
}

// applyConfig sets the options from a defaulted configuration, except those whose
// flag was given on the command line: flags override the file.
func (o *Options) applyConfig(c *kubeproxy.KubeProxyConfiguration, fs *pflag.FlagSet) error {
	if c.Mode != "" && c.Mode != "iptables" {
		return usagef("--config: mode %q is not supported: kpipe implements only the 'iptables' mode", c.Mode)
	}
	set := func(flag string, apply func()) {
		if !fs.Changed(flag) {
			apply()
		}
	}
	set("kubeconfig", func() { o.Kubeconfig = c.ClientConnection.Kubeconfig })
	set("kube-api-qps", func() { o.KubeAPIQPS = c.ClientConnection.QPS })
	set("kube-api-burst", func() { o.KubeAPIBurst = int(c.ClientConnection.Burst) })
	set("kube-api-content-type", func() { o.KubeAPIContentType = c.ClientConnection.ContentType })
	set("hostname-override", func() { o.HostnameOverride = c.HostnameOverride })
	set("bind-address", func() { o.BindAddress = c.BindAddress })
	set("bind-address-hard-fail", func() { o.BindAddressHardFail = c.BindAddressHardFail })
	set("healthz-bind-address", func() { o.HealthzBindAddress = c.HealthzBindAddress })
	set("metrics-bind-address", func() { o.MetricsBindAddress = c.MetricsBindAddress })
	if !fs.Changed("enable-debug-handlers") && !fs.Changed("profiling") {
		o.EnableDebugHandlers = c.EnableProfiling
	}
	set("cluster-cidr", func() { o.ClusterCIDR = c.ClusterCIDR })
	set("nodeport-addresses", func() { o.NodePortAddresses = c.NodePortAddresses })
	set("proxy-mode", func() { o.ProxyMode = string(c.Mode) })
	set("detect-local-mode", func() {
		o.DetectLocalMode = string(c.DetectLocalMode)
		if o.DetectLocalMode == "" {
			o.DetectLocalMode = defaultOptions().DetectLocalMode
		}
	})
	set("pod-bridge-interface", func() { o.PodBridgeInterface = c.DetectLocal.BridgeInterface })
	set("pod-interface-name-prefix", func() { o.PodInterfaceprefix = c.DetectLocal.InterfaceNamePrefix })
	set("masquerade-all", func() { o.MasqueradeAll = c.IPTables.MasqueradeAll })
	set("iptables-masquerade-bit", func() { o.MasqueradeBit = int(*c.IPTables.MasqueradeBit) })
	set("iptables-sync-period", func() { o.SyncPeriod = c.IPTables.SyncPeriod.Duration })
	set("iptables-min-sync-period", func() { o.MinSyncPeriod = c.IPTables.MinSyncPeriod.Duration })
	set("iptables-localhost-nodeports", func() { o.LocalhostNodePorts = *c.IPTables.LocalhostNodePorts })
	set("feature-gates", func() { o.FeatureGates = c.FeatureGates })
	o.applyConntrackConfig(c, set)
	if !fs.Changed("log-format") && !fs.Changed("logging-format") && (c.Logging.Format == "json" || c.Logging.Format == "text") {
		o.LogFormat = c.Logging.Format
	}
	if !fs.Changed("log-level") && !fs.Changed("v") {
		o.LogLevel = levelOfVerbosity(int(c.Logging.Verbosity))
	}
	return nil
}

// applyConntrackConfig sets the node set-up options from the file: kube-proxy's
// defaults where a pointer field is unset, the file's value (zero included)
// otherwise.
func (o *Options) applyConntrackConfig(c *kubeproxy.KubeProxyConfiguration, set func(string, func())) {
	ct, oc := &c.Conntrack, &o.Conntrack
	if ct.MaxPerCore != nil {
		set("conntrack-max-per-core", func() { oc.MaxPerCore = *ct.MaxPerCore })
	}
	if ct.Min != nil {
		set("conntrack-min", func() { oc.Min = *ct.Min })
	}
	if ct.TCPEstablishedTimeout != nil {
		set("conntrack-tcp-timeout-established", func() { oc.TCPEstablishedTimeout = ct.TCPEstablishedTimeout.Duration })
	}
	if ct.TCPCloseWaitTimeout != nil {
		set("conntrack-tcp-timeout-close-wait", func() { oc.TCPCloseWaitTimeout = ct.TCPCloseWaitTimeout.Duration })
	}
	set("conntrack-tcp-be-liberal", func() { oc.TCPBeLiberal = ct.TCPBeLiberal })
	set("conntrack-udp-timeout", func() { oc.UDPTimeout = ct.UDPTimeout.Duration })
	set("conntrack-udp-timeout-stream", func() { oc.UDPStreamTimeout = ct.UDPStreamTimeout.Duration })
	if c.OOMScoreAdj != nil {
		set("oom-score-adj", func() { o.OOMScoreAdj = *c.OOMScoreAdj })
	}
}

// levelOfVerbosity maps kube-proxy's klog verbosity onto kpipe's levels: kpipe's
// info level already logs what klog shows at -v=2 (each sync, each skip), and its
// debug level holds what klog shows from -v=4 (per-object detail).
func levelOfVerbosity(v int) string {
	if v >= 4 {
		return "debug"
	}
	return "info"
}

// effectiveConfig is the configuration kpipe runs with, in the v1alpha1 shape.
func (o *Options) effectiveConfig() *kubeproxy.KubeProxyConfiguration {
	c := &kubeproxy.KubeProxyConfiguration{
		TypeMeta:            metav1.TypeMeta{APIVersion: kubeproxy.SchemeGroupVersion.String(), Kind: "KubeProxyConfiguration"},
		FeatureGates:        o.FeatureGates,
		HostnameOverride:    o.HostnameOverride,
		BindAddress:         o.BindAddress,
		BindAddressHardFail: o.BindAddressHardFail,
		HealthzBindAddress:  o.HealthzBindAddress,
		MetricsBindAddress:  o.MetricsBindAddress,
		EnableProfiling:     o.EnableDebugHandlers,
		Mode:                kubeproxy.ProxyMode(o.ProxyMode),
		DetectLocalMode:     kubeproxy.LocalMode(o.DetectLocalMode),
		DetectLocal:         kubeproxy.DetectLocalConfiguration{BridgeInterface: o.PodBridgeInterface, InterfaceNamePrefix: o.PodInterfaceprefix},
		ClusterCIDR:         o.ClusterCIDR,
		NodePortAddresses:   o.NodePortAddresses,
		IPTables: kubeproxy.KubeProxyIPTablesConfiguration{
			MasqueradeBit: ptr.To(int32(o.MasqueradeBit)), MasqueradeAll: o.MasqueradeAll,
			LocalhostNodePorts: ptr.To(o.LocalhostNodePorts),
			SyncPeriod:         metav1.Duration{Duration: o.SyncPeriod}, MinSyncPeriod: metav1.Duration{Duration: o.MinSyncPeriod},
		},
	}
	c.Conntrack = kubeproxy.KubeProxyConntrackConfiguration{
		MaxPerCore: ptr.To(o.Conntrack.MaxPerCore), Min: ptr.To(o.Conntrack.Min),
		TCPEstablishedTimeout: &metav1.Duration{Duration: o.Conntrack.TCPEstablishedTimeout},
		TCPCloseWaitTimeout:   &metav1.Duration{Duration: o.Conntrack.TCPCloseWaitTimeout},
		TCPBeLiberal:          o.Conntrack.TCPBeLiberal,
		UDPTimeout:            metav1.Duration{Duration: o.Conntrack.UDPTimeout},
		UDPStreamTimeout:      metav1.Duration{Duration: o.Conntrack.UDPStreamTimeout},
	}
	c.OOMScoreAdj = ptr.To(o.OOMScoreAdj)
	c.ClientConnection.Kubeconfig = o.Kubeconfig
	c.ClientConnection.QPS = o.KubeAPIQPS
	c.ClientConnection.Burst = int32(o.KubeAPIBurst)
	c.ClientConnection.ContentType = o.KubeAPIContentType
	c.Logging.Format = o.LogFormat
	if o.LogLevel == "debug" {
		c.Logging.Verbosity = 4
	} else {
		c.Logging.Verbosity = 2
	}
	return c
}

// writeConfig writes the effective configuration as YAML.
func (o *Options) writeConfig(path string) error {
	data, err := yaml.Marshal(o.effectiveConfig())
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		return fmt.Errorf("--write-config-to: %w", err)
	}
	return nil
}
