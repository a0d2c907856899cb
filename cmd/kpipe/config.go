package main

import (
	"cmp"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	componentbaseconfig "k8s.io/component-base/config"
	logsapi "k8s.io/component-base/logs/api/v1"
	kubeproxy "k8s.io/kube-proxy/config/v1alpha1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// kube-proxy's default ports for a bind address given as a bare IP.
const (
	healthzPort = 10256
	metricsPort = 10249
)

// applyConfigFile reads the --config file and sets the options from it.
func (o *Options) applyConfigFile(fs *pflag.FlagSet) error {
	c, strictErr, err := loadConfigFile(o.ConfigFile)
	if err != nil {
		return err
	}
	o.lenientDecode = strictErr
	return o.applyConfig(c, fs)
}

// loadConfigFile reads a KubeProxyConfiguration as kube-proxy's loadConfig does
// and applies kube-proxy's defaults to its zero values. It decodes strictly;
// when only unknown or duplicate fields fail that (strictErr, which names
// them), it decodes leniently: kube-proxy runs on such a file (older kubeadm
// files have udpIdleTimeout). A field of the wrong type, another kind or
// version, or no file is an error.
func loadConfigFile(path string) (c *kubeproxy.KubeProxyConfiguration, strictErr, err error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("--config: %v", err)
	}
	obj, gvk, err := decodeConfig(data, serializer.EnableStrict)
	if runtime.IsStrictDecodingError(err) {
		strictErr = fmt.Errorf("--config %s: %w", path, err)
		obj, gvk, err = decodeConfig(data, serializer.DisableStrict)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("--config %s: %v", path, err)
	}
	c, ok := obj.(*kubeproxy.KubeProxyConfiguration)
	if !ok {
		return nil, nil, fmt.Errorf("--config %s: got %v, want kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration", path, gvk)
	}
	setConfigDefaults(c)
	return c, strictErr, nil
}

// decodeConfig decodes data as a kube-proxy configuration, strictly or not.
func decodeConfig(data []byte, strictness serializer.CodecFactoryOptionsMutator) (runtime.Object, *schema.GroupVersionKind, error) {
	scheme := runtime.NewScheme()
	if err := kubeproxy.AddToScheme(scheme); err != nil {
		return nil, nil, err
	}
	return serializer.NewCodecFactory(scheme, strictness).UniversalDeserializer().Decode(data, nil, nil)
}

// logLenientDecode says, at error level, which fields of the config file
// strict decoding failed on: kpipe runs without them, as kube-proxy does.
func (o *Options) logLenientDecode(log *slog.Logger) {
	if o.lenientDecode != nil {
		log.Error("config file decoded leniently: running without the fields strict decoding failed on", "err", o.lenientDecode)
	}
}

// setConfigDefaults gives zero values kube-proxy's defaults, as upstream's
// SetDefaults_KubeProxyConfiguration does: those of the fields kpipe reads, and
// those of the other modes' fields, which /configz and --write-config-to show
// as kube-proxy does.
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
	ipt := &c.IPTables
	defaultDuration(&ipt.SyncPeriod, 30*time.Second)
	defaultDuration(&ipt.MinSyncPeriod, time.Second)
	ipt.LocalhostNodePorts = cmp.Or(ipt.LocalhostNodePorts, ptr.To(true))
	ipt.MasqueradeBit = cmp.Or(ipt.MasqueradeBit, ptr.To[int32](14))
	cc := &c.ClientConnection
	cc.ContentType = cmp.Or(cc.ContentType, "application/vnd.kubernetes.protobuf")
	cc.QPS = cmp.Or(cc.QPS, 5)
	cc.Burst = cmp.Or(cc.Burst, 10)
	c.OOMScoreAdj = cmp.Or(c.OOMScoreAdj, ptr.To[int32](-999))
	ct := &c.Conntrack
	ct.MaxPerCore = cmp.Or(ct.MaxPerCore, ptr.To[int32](32*1024))
	ct.Min = cmp.Or(ct.Min, ptr.To[int32](128*1024))
	ct.TCPEstablishedTimeout = cmp.Or(ct.TCPEstablishedTimeout, &metav1.Duration{Duration: 24 * time.Hour})
	ct.TCPCloseWaitTimeout = cmp.Or(ct.TCPCloseWaitTimeout, &metav1.Duration{Duration: time.Hour})
	if c.FeatureGates == nil {
		c.FeatureGates = map[string]bool{}
	}
	logsapi.SetRecommendedLoggingConfiguration(&c.Logging)
	// Fields kpipe does not use (other modes', the config file's resync).
	defaultDuration(&c.IPVS.SyncPeriod, 30*time.Second)
	defaultDuration(&c.NFTables.SyncPeriod, 30*time.Second)
	defaultDuration(&c.NFTables.MinSyncPeriod, time.Second)
	c.NFTables.MasqueradeBit = cmp.Or(c.NFTables.MasqueradeBit, ptr.To[int32](14))
	defaultDuration(&c.ConfigSyncPeriod, 15*time.Minute)
}

func defaultDuration(d *metav1.Duration, def time.Duration) {
	if d.Duration == 0 {
		d.Duration = def
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

// applyConfig sets the options from a defaulted configuration. As in
// kube-proxy, the file is the configuration: the flags that set its fields are
// ignored. Only --hostname-override and the logging flags apply over it
// (--master and kpipe's own flags have no field in it).
func (o *Options) applyConfig(c *kubeproxy.KubeProxyConfiguration, fs *pflag.FlagSet) error {
	if c.Mode != "" && c.Mode != "iptables" {
		return fmt.Errorf("--config: mode %q is not supported: kpipe implements only the 'iptables' mode", c.Mode)
	}
	o.file = c
	o.Kubeconfig = c.ClientConnection.Kubeconfig
	o.KubeAPIQPS, o.KubeAPIBurst = c.ClientConnection.QPS, int(c.ClientConnection.Burst)
	o.KubeAPIContentType = c.ClientConnection.ContentType
	if o.HostnameOverride == "" { // kube-proxy: a non-empty flag wins
		o.HostnameOverride = c.HostnameOverride
	}
	o.BindAddress, o.BindAddressHardFail = c.BindAddress, c.BindAddressHardFail
	o.HealthzBindAddress, o.MetricsBindAddress = c.HealthzBindAddress, c.MetricsBindAddress
	o.EnableProfiling = c.EnableProfiling
	o.ClusterCIDR = c.ClusterCIDR
	o.NodePortAddresses = c.NodePortAddresses
	o.ProxyMode = cmp.Or(string(c.Mode), "iptables")
	o.DetectLocalMode = cmp.Or(string(c.DetectLocalMode), defaultOptions().DetectLocalMode)
	o.PodBridgeInterface, o.PodInterfaceprefix = c.DetectLocal.BridgeInterface, c.DetectLocal.InterfaceNamePrefix
	ipt := &c.IPTables
	o.MasqueradeAll, o.MasqueradeBit = ipt.MasqueradeAll, int(*ipt.MasqueradeBit)
	o.SyncPeriod, o.MinSyncPeriod = ipt.SyncPeriod.Duration, ipt.MinSyncPeriod.Duration
	o.LocalhostNodePorts = *ipt.LocalhostNodePorts
	o.FeatureGates = c.FeatureGates
	o.applyConntrackConfig(c)
	o.applyLoggingConfig(c, fs)
	return nil
}

// applyConntrackConfig sets the node set-up options from the file. Its pointer
// fields are never nil: setConfigDefaults gave an unset one kube-proxy's
// default, and a set one keeps its value (zero included).
func (o *Options) applyConntrackConfig(c *kubeproxy.KubeProxyConfiguration) {
	ct := &c.Conntrack
	o.Conntrack = ConntrackOptions{
		MaxPerCore: *ct.MaxPerCore, Min: *ct.Min,
		TCPEstablishedTimeout: ct.TCPEstablishedTimeout.Duration, TCPCloseWaitTimeout: ct.TCPCloseWaitTimeout.Duration,
		TCPBeLiberal: ct.TCPBeLiberal, UDPTimeout: ct.UDPTimeout.Duration, UDPStreamTimeout: ct.UDPStreamTimeout.Duration,
	}
	o.OOMScoreAdj = *c.OOMScoreAdj
}

// applyLoggingConfig sets the log format and level from the file's logging
// section, except where a logging flag was given: as in kube-proxy, those
// apply over the file.
func (o *Options) applyLoggingConfig(c *kubeproxy.KubeProxyConfiguration, fs *pflag.FlagSet) {
	if !fs.Changed("log-format") && !fs.Changed("logging-format") && (c.Logging.Format == "json" || c.Logging.Format == "text") {
		o.LogFormat = c.Logging.Format
	}
	if !fs.Changed("v") {
		o.Verbosity = int(c.Logging.Verbosity)
		if !fs.Changed("log-level") {
			o.LogLevel = levelOfVerbosity(o.Verbosity)
		}
	}
}

// levelOfVerbosity maps kube-proxy's klog verbosity onto kpipe's levels: kpipe's
// info level already logs what klog shows at -v=2 (each sync, each skip), and its
// debug level holds what klog shows from -v=4 (per-object detail).
func levelOfVerbosity(v int) string { return strings.ToLower(levelOfV(v).String()) }

// effectiveConfig is the configuration kpipe runs with, in the v1alpha1 shape:
// the file's (or, without one, kube-proxy's defaults) with what kpipe resolved
// from it and the flags. The fields kpipe does not use keep the file's values.
func (o *Options) effectiveConfig() *kubeproxy.KubeProxyConfiguration {
	c := &kubeproxy.KubeProxyConfiguration{}
	if o.file != nil {
		c = o.file.DeepCopy() // defaulted by loadConfigFile
	} else {
		setConfigDefaults(c)
	}
	c.TypeMeta = metav1.TypeMeta{APIVersion: kubeproxy.SchemeGroupVersion.String(), Kind: "KubeProxyConfiguration"}
	if o.FeatureGates != nil {
		c.FeatureGates = o.FeatureGates
	}
	c.HostnameOverride = o.givenHostname // kube-proxy's: not the machine's hostname, when neither flag nor file names one
	c.BindAddress, c.BindAddressHardFail = o.BindAddress, o.BindAddressHardFail
	c.HealthzBindAddress, c.MetricsBindAddress = o.HealthzBindAddress, o.MetricsBindAddress
	c.EnableProfiling = o.EnableProfiling
	c.Mode = kubeproxy.ProxyMode(o.ProxyMode)
	c.DetectLocalMode = kubeproxy.LocalMode(o.DetectLocalMode)
	c.DetectLocal.BridgeInterface, c.DetectLocal.InterfaceNamePrefix = o.PodBridgeInterface, o.PodInterfaceprefix
	c.ClusterCIDR = o.ClusterCIDR
	c.NodePortAddresses = o.NodePortAddresses
	ipt := &c.IPTables
	ipt.MasqueradeBit, ipt.MasqueradeAll = ptr.To(int32(o.MasqueradeBit)), o.MasqueradeAll
	ipt.LocalhostNodePorts = ptr.To(o.LocalhostNodePorts)
	ipt.SyncPeriod, ipt.MinSyncPeriod = metav1.Duration{Duration: o.SyncPeriod}, metav1.Duration{Duration: o.MinSyncPeriod}
	c.Conntrack = kubeproxy.KubeProxyConntrackConfiguration{
		MaxPerCore: ptr.To(o.Conntrack.MaxPerCore), Min: ptr.To(o.Conntrack.Min),
		TCPEstablishedTimeout: &metav1.Duration{Duration: o.Conntrack.TCPEstablishedTimeout},
		TCPCloseWaitTimeout:   &metav1.Duration{Duration: o.Conntrack.TCPCloseWaitTimeout},
		TCPBeLiberal:          o.Conntrack.TCPBeLiberal,
		UDPTimeout:            metav1.Duration{Duration: o.Conntrack.UDPTimeout},
		UDPStreamTimeout:      metav1.Duration{Duration: o.Conntrack.UDPStreamTimeout},
	}
	c.OOMScoreAdj = ptr.To(o.OOMScoreAdj)
	cc := &c.ClientConnection
	cc.Kubeconfig, cc.QPS, cc.Burst, cc.ContentType = o.Kubeconfig, o.KubeAPIQPS, int32(o.KubeAPIBurst), o.KubeAPIContentType
	c.Logging.Format = o.LogFormat
	c.Logging.Verbosity = logsapi.VerbosityLevel(o.Verbosity)
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

// configz is the effective configuration as kube-proxy's /configz shows its own
// (see internalConfig).
func (o *Options) configz() *internalConfig { return toInternal(o.effectiveConfig()) }

// internalConfig has the shape of kube-proxy's internal KubeProxyConfiguration
// (k8s.io/kubernetes/pkg/proxy/apis/config, v1.34), which kube-proxy registers
// with component-base's configz: no JSON tags, so the keys of /configz are these
// Go field names (Logging keeps logsapi's tags), and v1alpha1's fields regrouped
// (Linux, one SyncPeriod, ClusterCIDR split into DetectLocal.ClusterCIDRs,
// portRange gone).
type internalConfig struct {
	Linux struct {
		Conntrack     internalConntrack
		MasqueradeAll bool
		OOMScoreAdj   *int32
	}
	Windows          struct{ RunAsService bool }
	FeatureGates     map[string]bool
	ClientConnection componentbaseconfig.ClientConnectionConfiguration
	Logging          logsapi.LoggingConfiguration

	HostnameOverride            string
	BindAddress                 string
	HealthzBindAddress          string
	MetricsBindAddress          string
	BindAddressHardFail         bool
	EnableProfiling             bool
	ShowHiddenMetricsForVersion string

	Mode     kubeproxy.ProxyMode
	IPTables struct {
		MasqueradeBit      *int32
		LocalhostNodePorts *bool
	}
	IPVS struct {
		Scheduler     string
		ExcludeCIDRs  []string
		StrictARP     bool
		TCPTimeout    metav1.Duration
		TCPFinTimeout metav1.Duration
		UDPTimeout    metav1.Duration
	}
	Winkernel internalWinkernel
	NFTables  struct{ MasqueradeBit *int32 }

	DetectLocalMode kubeproxy.LocalMode
	DetectLocal     struct {
		BridgeInterface     string
		ClusterCIDRs        []string
		InterfaceNamePrefix string
	}
	NodePortAddresses []string

	SyncPeriod       metav1.Duration
	MinSyncPeriod    metav1.Duration
	ConfigSyncPeriod metav1.Duration
}

// internalConntrack and internalWinkernel are v1alpha1's types without JSON
// tags (Go converts between them).
type internalConntrack struct {
	MaxPerCore            *int32
	Min                   *int32
	TCPEstablishedTimeout *metav1.Duration
	TCPCloseWaitTimeout   *metav1.Duration
	TCPBeLiberal          bool
	UDPTimeout            metav1.Duration
	UDPStreamTimeout      metav1.Duration
}

type internalWinkernel struct {
	NetworkName           string
	SourceVip             string
	EnableDSR             bool
	RootHnsEndpointName   string
	ForwardHealthCheckVip bool
}

// toInternal converts a v1alpha1 configuration as kube-proxy's conversion does
// for the iptables mode (the only one kpipe runs): sync periods and
// masqueradeAll from the iptables section.
func toInternal(c *kubeproxy.KubeProxyConfiguration) *internalConfig {
	out := &internalConfig{
		FeatureGates:                c.FeatureGates,
		ClientConnection:            componentbaseconfig.ClientConnectionConfiguration(c.ClientConnection),
		Logging:                     c.Logging,
		HostnameOverride:            c.HostnameOverride,
		BindAddress:                 c.BindAddress,
		HealthzBindAddress:          c.HealthzBindAddress,
		MetricsBindAddress:          c.MetricsBindAddress,
		BindAddressHardFail:         c.BindAddressHardFail,
		EnableProfiling:             c.EnableProfiling,
		ShowHiddenMetricsForVersion: c.ShowHiddenMetricsForVersion,
		Mode:                        c.Mode,
		Winkernel:                   internalWinkernel(c.Winkernel),
		DetectLocalMode:             c.DetectLocalMode,
		NodePortAddresses:           c.NodePortAddresses,
		SyncPeriod:                  c.IPTables.SyncPeriod,
		MinSyncPeriod:               c.IPTables.MinSyncPeriod,
		ConfigSyncPeriod:            c.ConfigSyncPeriod,
	}
	out.Linux.Conntrack = internalConntrack(c.Conntrack)
	out.Linux.MasqueradeAll = c.IPTables.MasqueradeAll
	out.Linux.OOMScoreAdj = c.OOMScoreAdj
	out.Windows.RunAsService = c.WindowsRunAsService
	out.IPTables.MasqueradeBit, out.IPTables.LocalhostNodePorts = c.IPTables.MasqueradeBit, c.IPTables.LocalhostNodePorts
	v := c.IPVS
	out.IPVS.Scheduler, out.IPVS.ExcludeCIDRs, out.IPVS.StrictARP = v.Scheduler, v.ExcludeCIDRs, v.StrictARP
	out.IPVS.TCPTimeout, out.IPVS.TCPFinTimeout, out.IPVS.UDPTimeout = v.TCPTimeout, v.TCPFinTimeout, v.UDPTimeout
	out.NFTables.MasqueradeBit = c.NFTables.MasqueradeBit
	out.DetectLocal.BridgeInterface, out.DetectLocal.InterfaceNamePrefix = c.DetectLocal.BridgeInterface, c.DetectLocal.InterfaceNamePrefix
	if c.ClusterCIDR != "" {
		out.DetectLocal.ClusterCIDRs = strings.Split(c.ClusterCIDR, ",")
	}
	return out
}
