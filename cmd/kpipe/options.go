package main

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"
	kubeproxy "k8s.io/kube-proxy/config/v1alpha1"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render"
)

// Options are kpipe's settings, named as kube-proxy names its flags.
type Options struct {
	Kubeconfig          string        `json:"kubeconfig"`
	HostnameOverride    string        `json:"hostnameOverride"`
	ClusterCIDR         string        `json:"clusterCIDR"`
	ProxyMode           string        `json:"mode"`
	HealthzBindAddress  string        `json:"healthzBindAddress"`
	MetricsBindAddress  string        `json:"metricsBindAddress"`
	EnableProfiling     bool          `json:"enableProfiling"`
	EnableDebugHandlers bool          `json:"enableDebugHandlers"`
	DebugBindAddress    string        `json:"debugBindAddress"`
	SyncPeriod          time.Duration `json:"syncPeriod"`
	MinSyncPeriod       time.Duration `json:"minSyncPeriod"`
	CanaryInterval      time.Duration `json:"canaryInterval"`
	MasqueradeAll       bool          `json:"masqueradeAll"`
	MasqueradeBit       int           `json:"masqueradeBit"`
	DetectLocalMode     string        `json:"detectLocalMode"`
	PodBridgeInterface  string        `json:"bridgeInterface"`
	PodInterfaceprefix  string        `json:"interfaceNamePrefix"`
	NodePortAddresses   []string      `json:"nodePortAddresses"`
	LocalhostNodePorts  bool          `json:"localhostNodePorts"`
	LogFormat           string        `json:"logFormat"`
	LogLevel            string        `json:"logLevel"`
	IptablesWriter      string        `json:"iptablesWriter"`
	KubeAPIQPS          float32       `json:"qps"`
	KubeAPIBurst        int           `json:"burst"`
	KubeAPIContentType  string        `json:"contentType"`
	Master              string        `json:"master"`
	BindAddress         string        `json:"bindAddress"`
	BindAddressHardFail bool          `json:"bindAddressHardFail"`
	FeatureGates        map[string]bool
	Conntrack           ConntrackOptions `json:"conntrack"`
	OOMScoreAdj         int32            `json:"oomScoreAdj"`
	// Cleanup and InitOnly are kube-proxy's one-shot modes: remove the rules and
	// exit, or set the node up and exit.
	Cleanup         bool
	InitOnly        bool
	version         versionFlag // kube-proxy's --version: print and exit
	ConfigFile      string
	file            *kubeproxy.KubeProxyConfiguration // the --config file's, defaulted
	lenientDecode   error                             // the strict decoding error of a --config file read leniently
	gate            featuregate.MutableFeatureGate    // kube-proxy's feature gates, FeatureGates set (complete)
	givenHostname   string                            // the flag's or the file's hostnameOverride, before the hostname fills it in
	WriteConfigTo   string
	Verbosity       int
	healthzPortFlag int32 // kube-proxy's deprecated --healthz-port
	metricsPortFlag int32 // and --metrics-port
	ignoredGiven    []string
	args            []string // the command line, reread over the config file when it changes
	clusterCIDRs    []netip.Prefix
	nodePortCIDRs   []netip.Prefix
	nodePortPrimary bool
}

func defaultOptions() *Options {
	return &Options{
		ProxyMode:          "iptables",
		HealthzBindAddress: "0.0.0.0:10256",
		MetricsBindAddress: "127.0.0.1:10249",
		DebugBindAddress:   net.JoinHostPort("127.0.0.1", strconv.Itoa(debugPort)),
		SyncPeriod:         30 * time.Second,
		MinSyncPeriod:      time.Second,
		MasqueradeBit:      14,
		DetectLocalMode:    render.DetectClusterCIDR,
		LocalhostNodePorts: true,
		LogFormat:          "text",
		LogLevel:           "info",
		IptablesWriter:     "netlink",
		KubeAPIQPS:         5,
		KubeAPIBurst:       10,
		KubeAPIContentType: "application/vnd.kubernetes.protobuf",
		BindAddress:        "0.0.0.0",
		Conntrack: ConntrackOptions{MaxPerCore: 32768, Min: 131072,
			TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour},
		OOMScoreAdj: -999,
		version:     versionOff,
	}
}

// ConntrackOptions are kube-proxy's conntrack settings, written to the node's
// sysctls at start-up (zero leaves a sysctl as it is).
type ConntrackOptions struct {
	MaxPerCore            int32
	Min                   int32
	TCPEstablishedTimeout time.Duration
	TCPCloseWaitTimeout   time.Duration
	TCPBeLiberal          bool
	UDPTimeout            time.Duration
	UDPStreamTimeout      time.Duration
}

func (o *Options) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "Path to a kubeconfig file; empty means in-cluster configuration.")
	fs.StringVar(&o.HostnameOverride, "hostname-override", o.HostnameOverride, "The name of this node, instead of the hostname.")
	fs.StringVar(&o.ClusterCIDR, "cluster-cidr", o.ClusterCIDR, "The CIDR range of pods in the cluster (comma-separated, one per family); traffic from outside it to a ClusterIP is masqueraded.")
	fs.StringVar(&o.ProxyMode, "proxy-mode", o.ProxyMode, "Which proxy mode to use; kpipe implements 'iptables'.")
	fs.StringVar(&o.HealthzBindAddress, "healthz-bind-address", o.HealthzBindAddress, "The IP:port for the health check server; empty disables it.")
	fs.StringVar(&o.MetricsBindAddress, "metrics-bind-address", o.MetricsBindAddress, "The IP:port for the metrics server; empty disables it.")
	fs.BoolVar(&o.EnableDebugHandlers, "enable-debug-handlers", o.EnableDebugHandlers, "Serve pprof and /debug/stages (which can kill a stage) on --debug-bind-address.")
	fs.StringVar(&o.DebugBindAddress, "debug-bind-address", o.DebugBindAddress, "The IP:port for the debug handlers (with --enable-debug-handlers; a bare IP gets port 10247). Loopback unless given; anyone who reaches it can kill stages.")
	fs.DurationVar(&o.SyncPeriod, "iptables-sync-period", o.SyncPeriod, "How often re-synchronizing and cleanup runs (the canary check, the health timeout is twice this).")
	fs.DurationVar(&o.MinSyncPeriod, "iptables-min-sync-period", o.MinSyncPeriod, "The shortest time between syncs of the rules after the first two in a burst.")
	fs.DurationVar(&o.CanaryInterval, "canary-interval", o.CanaryInterval, "How often to check the canary chains (default: the sync period).")
	fs.BoolVar(&o.MasqueradeAll, "masquerade-all", o.MasqueradeAll, "SNAT all traffic sent through service IPs.")
	fs.IntVar(&o.MasqueradeBit, "iptables-masquerade-bit", o.MasqueradeBit, "The bit of the fwmark space that marks packets for SNAT, 0 to 31.")
	fs.StringVar(&o.DetectLocalMode, "detect-local-mode", o.DetectLocalMode, "How to tell pod traffic: ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix.")
	fs.StringVar(&o.PodBridgeInterface, "pod-bridge-interface", o.PodBridgeInterface, "The bridge pods are attached to (with --detect-local-mode=BridgeInterface).")
	fs.StringVar(&o.PodInterfaceprefix, "pod-interface-name-prefix", o.PodInterfaceprefix, "The prefix of pod interfaces (with --detect-local-mode=InterfaceNamePrefix).")
	fs.StringSliceVar(&o.NodePortAddresses, "nodeport-addresses", o.NodePortAddresses, "CIDRs of the local addresses NodePorts answer on, or 'primary'; empty means all.")
	fs.BoolVar(&o.LocalhostNodePorts, "iptables-localhost-nodeports", o.LocalhostNodePorts, "Let NodePorts answer on 127.0.0.1 (sets route_localnet).")
	fs.StringVar(&o.LogFormat, "log-format", o.LogFormat, "Log format: text or json.")
	fs.StringVar(&o.LogLevel, "log-level", o.LogLevel, "Log level: debug, info, warn or error.")
	fs.StringVar(&o.IptablesWriter, "iptables-writer", o.IptablesWriter, "How rules are written: 'netlink' (straight to nf_tables, as iptables-nft would write them; iptables-restore on the legacy backend) or 'restore' (always iptables-restore).")
	o.addKubeProxyFlags(fs)
}

// finish turns parsed flags into the options kpipe runs with: the config file
// and the flags it leaves to the command line (resolve), then checked (complete). Start-up and each reload
// of the config file go through it.
func (o *Options) finish(fs *pflag.FlagSet) error {
	if err := o.resolve(fs); err != nil {
		return err
	}
	return o.complete()
}

// complete checks the options and derives the parsed forms.
func (o *Options) complete() error {
	if o.ProxyMode != "iptables" && o.ProxyMode != "" {
		return fmt.Errorf("--proxy-mode %q is not supported: kpipe implements only the 'iptables' mode", o.ProxyMode)
	}
	if o.SyncPeriod <= 0 {
		return fmt.Errorf("--iptables-sync-period must be positive, got %v", o.SyncPeriod)
	}
	if o.MinSyncPeriod < 0 || o.MinSyncPeriod > o.SyncPeriod {
		return fmt.Errorf("--iptables-min-sync-period must be between 0 and --iptables-sync-period, got %v", o.MinSyncPeriod)
	}
	if o.CanaryInterval == 0 {
		o.CanaryInterval = o.SyncPeriod
	}
	if o.CanaryInterval < 0 {
		return fmt.Errorf("--canary-interval must be positive, got %v", o.CanaryInterval)
	}
	if o.MasqueradeBit < 0 || o.MasqueradeBit > 31 {
		return fmt.Errorf("--iptables-masquerade-bit must be 0 to 31, got %d", o.MasqueradeBit)
	}
	if o.OOMScoreAdj < -1000 || o.OOMScoreAdj > 1000 {
		return fmt.Errorf("--oom-score-adj must be -1000 to 1000, got %d", o.OOMScoreAdj)
	}
	if c := o.Conntrack; c.MaxPerCore < 0 || c.Min < 0 || c.TCPEstablishedTimeout < 0 || c.TCPCloseWaitTimeout < 0 || c.UDPTimeout < 0 || c.UDPStreamTimeout < 0 {
		return fmt.Errorf("--conntrack-* settings must not be negative, got %+v", c)
	}
	o.clusterCIDRs = nil
	switch o.DetectLocalMode {
	case render.DetectClusterCIDR:
		cidrs, err := parseClusterCIDRs(o.ClusterCIDR)
		if err != nil {
			return err
		}
		o.clusterCIDRs = cidrs
	case render.DetectNodeCIDR:
	case render.DetectBridgeInterface:
		if o.PodBridgeInterface == "" {
			return fmt.Errorf("--detect-local-mode=BridgeInterface needs --pod-bridge-interface")
		}
	case render.DetectInterfacePrefix:
		if o.PodInterfaceprefix == "" {
			return fmt.Errorf("--detect-local-mode=InterfaceNamePrefix needs --pod-interface-name-prefix")
		}
	default:
		return fmt.Errorf("--detect-local-mode %q: must be ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix", o.DetectLocalMode)
	}
	o.nodePortCIDRs, o.nodePortPrimary = nil, false
	for _, a := range o.NodePortAddresses {
		if a == "primary" {
			o.nodePortPrimary = true
			continue
		}
		p, err := netip.ParsePrefix(a)
		if err != nil {
			return fmt.Errorf("--nodeport-addresses %q: must be CIDRs or 'primary': %v", a, err)
		}
		o.nodePortCIDRs = append(o.nodePortCIDRs, p.Masked())
	}
	o.nodePortCIDRs = withoutZeroFamilies(o.nodePortCIDRs)
	if o.nodePortPrimary && len(o.nodePortCIDRs) > 0 {
		return fmt.Errorf("--nodeport-addresses: 'primary' cannot be combined with CIDRs")
	}
	switch o.LogFormat {
	case "text", "json":
	default:
		return fmt.Errorf("--log-format %q: must be text or json", o.LogFormat)
	}
	if _, err := parseLevel(o.LogLevel); err != nil {
		return err
	}
	if _, err := o.writer(); err != nil {
		return err
	}
	o.HealthzBindAddress = withDefaultPort(o.HealthzBindAddress, healthzPort)
	o.MetricsBindAddress = withDefaultPort(o.MetricsBindAddress, metricsPort)
	o.DebugBindAddress = withDefaultPort(o.DebugBindAddress, debugPort)
	if err := o.checkAddresses(); err != nil {
		return err
	}
	if o.KubeAPIQPS < 0 || o.KubeAPIBurst < 0 {
		return fmt.Errorf("--kube-api-qps and --kube-api-burst must not be negative")
	}
	gate := kubeProxyFeatureGate()
	if err := gate.SetFromMap(o.FeatureGates); err != nil {
		return fmt.Errorf("--feature-gates (featureGates): %v", err)
	}
	o.gate = gate
	name, err := nodeName(o.HostnameOverride)
	if err != nil {
		return err
	}
	if o.HostnameOverride != "" {
		o.givenHostname = name // as given: not the hostname nodeName fell back to
	}
	o.HostnameOverride = name
	return nil
}

// parseClusterCIDRs reads --cluster-cidr as kube-proxy does in ClusterCIDR
// mode: one CIDR, or a dual-stack pair (one IPv4, one IPv6). kpipe also
// ignores spaces and empty entries ("a, b,").
func parseClusterCIDRs(list string) ([]netip.Prefix, error) {
	var cidrs []netip.Prefix
	for _, c := range strings.Split(list, ",") {
		if c = strings.TrimSpace(c); c == "" {
			continue
		}
		p, err := netip.ParsePrefix(c)
		if err != nil {
			return nil, fmt.Errorf("--cluster-cidr (clusterCIDR) %q: %v", c, err)
		}
		cidrs = append(cidrs, p.Masked())
	}
	if len(cidrs) > 2 || len(cidrs) == 2 && cidrs[0].Addr().Is4() == cidrs[1].Addr().Is4() {
		return nil, fmt.Errorf("--cluster-cidr (clusterCIDR) %q: must be one CIDR or a dual-stack pair (one IPv4, one IPv6)", list)
	}
	return cidrs, nil
}

// checkAddresses checks the bind addresses as kube-proxy does: an IP, and
// IP:port for the health and metrics servers. Two differences: an empty
// address is off (kube-proxy refuses an empty metrics address), and port 0
// (any free port, which kube-proxy refuses) is taken, as kpipe's tests run
// many servers at once with it.
func (o *Options) checkAddresses() error {
	if o.BindAddress != "" {
		if _, err := netip.ParseAddr(o.BindAddress); err != nil {
			return fmt.Errorf("--bind-address (bindAddress) %q: must be an IP address", o.BindAddress)
		}
	}
	for _, a := range []struct{ names, addr string }{
		{"--healthz-bind-address (healthzBindAddress)", o.HealthzBindAddress},
		{"--metrics-bind-address (metricsBindAddress)", o.MetricsBindAddress},
	} {
		if a.addr == "" {
			continue
		}
		host, port, err := net.SplitHostPort(a.addr)
		if err != nil {
			return fmt.Errorf("%s %q: must be IP:port", a.names, a.addr)
		}
		if _, err := netip.ParseAddr(host); err != nil {
			return fmt.Errorf("%s %q: %q is not an IP address", a.names, a.addr, host)
		}
		if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
			return fmt.Errorf("%s %q: port %q must be 0 to 65535", a.names, a.addr, port)
		}
	}
	return nil
}

// nodeName is the name of this node: the override, else the hostname, trimmed
// and lower-cased, as kube-proxy names it. An override of only spaces is an
// error, as in kube-proxy, not the hostname.
func nodeName(override string) (string, error) {
	name := strings.TrimSpace(override)
	if name == "" && override != "" {
		return "", fmt.Errorf("--hostname-override (hostnameOverride) %q: empty after trimming spaces", override)
	}
	if name == "" {
		h, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("find the node name: %w", err)
		}
		if name = strings.TrimSpace(h); name == "" {
			return "", fmt.Errorf("find the node name: the hostname is empty")
		}
	}
	return strings.ToLower(name), nil
}

// debugPort is the debug listener's port: next to kube-proxy's 10249 and the
// kubelet's 10248, and used by no Kubernetes component.
const debugPort = 10247

// debugAddr is where the debug handlers listen: nowhere ("") without
// --enable-debug-handlers, whatever --debug-bind-address says.
func (o *Options) debugAddr() string {
	if !o.EnableDebugHandlers {
		return ""
	}
	return o.DebugBindAddress
}

// familyOptions are what the stages of one IP family are given, decided here
// once for the family (its CIDRs, whether its NodePorts answer on 127.0.0.1,
// the host's facts about it): render and commit read them and derive none again.
type familyOptions struct {
	render render.Config
	// localhostNodePorts is render.LocalhostNodePorts, for commit (the
	// KUBE-FIREWALL jump and route_localnet).
	localhostNodePorts bool
}

// forFamily is the options of family f's stages on a host with facts.
func (o *Options) forFamily(f bus.Family, host hostFacts) familyOptions {
	localhost := o.localhostNodePortsOn(f)
	return familyOptions{localhostNodePorts: localhost, render: render.Config{
		Family: f, NodeName: o.HostnameOverride, MasqueradeAll: o.MasqueradeAll, MasqueradeBit: o.MasqueradeBit,
		DetectLocal: o.DetectLocalMode, ClusterCIDRs: bus.PrefixesOf(f, o.clusterCIDRs),
		BridgeInterface: o.PodBridgeInterface, InterfacePrefix: o.PodInterfaceprefix,
		NodePortAddresses: bus.PrefixesOf(f, o.nodePortCIDRs), NodePortPrimary: o.nodePortPrimary,
		LocalhostNodePorts: localhost, ConntrackLiberal: host.conntrackLiberal,
		NoRandomFully: host.noRandomFully[f], NFAcct: host.nfacct,
	}}
}

// localhostNodePortsOn says whether family f's NodePorts answer on 127.0.0.1:
// IPv4 only (route_localnet has no IPv6 twin), asked for, and 127.0.0.1 is
// among the NodePort addresses (as in kube-proxy: all addresses, or a CIDR
// that holds it; never with 'primary'). The one place this is decided.
func (o *Options) localhostNodePortsOn(f bus.Family) bool {
	if f != bus.IPv4 || !o.LocalhostNodePorts || o.nodePortPrimary {
		return false
	}
	v4 := bus.PrefixesOf(bus.IPv4, o.nodePortCIDRs)
	if len(v4) == 0 {
		return true
	}
	for _, p := range v4 {
		if p.Contains(netip.MustParseAddr("127.0.0.1")) {
			return true
		}
	}
	return false
}

// withoutZeroFamilies drops every CIDR of a family that has 0.0.0.0/0 or ::/0:
// that family's NodePorts answer on all addresses (no CIDRs of a family, as
// kube-proxy reads --nodeport-addresses).
func withoutZeroFamilies(ps []netip.Prefix) []netip.Prefix {
	zero := map[bus.Family]bool{}
	for _, p := range ps {
		if p.Bits() == 0 {
			zero[bus.FamilyOf(p.Addr())] = true
		}
	}
	var out []netip.Prefix
	for _, p := range ps {
		if !zero[bus.FamilyOf(p.Addr())] {
			out = append(out, p)
		}
	}
	return out
}

// writer is how the commit stage writes rules (--iptables-writer).
func (o *Options) writer() (nf.Writer, error) {
	switch o.IptablesWriter {
	case "netlink", "":
		return nf.WriterNetlink, nil
	case "restore":
		return nf.WriterRestore, nil
	}
	return 0, fmt.Errorf("--iptables-writer %q: must be netlink or restore", o.IptablesWriter)
}
