package main

import (
	"log/slog"
	"sort"
	"strings"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/api/resource"
	cliflag "k8s.io/component-base/cli/flag"
)

// addKubeProxyFlags adds the flags of kube-proxy's command line that kpipe's own
// names do not already cover, and normalizes names as kube-proxy does
// (--hostname_override is --hostname-override).
func (o *Options) addKubeProxyFlags(fs *pflag.FlagSet) {
	fs.SetNormalizeFunc(cliflag.WordSepNormalizeFunc)
	fs.StringVar(&o.ConfigFile, "config", o.ConfigFile, "A kube-proxy configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1). As in kube-proxy, the flags that set its fields are then ignored: only the logging flags and --hostname-override apply over it.")
	fs.StringVar(&o.WriteConfigTo, "write-config-to", o.WriteConfigTo, "Write the effective configuration to this file and exit.")
	fs.StringVar(&o.Master, "master", o.Master, "The address of the apiserver (overrides the kubeconfig's).")
	fs.StringVar(&o.BindAddress, "bind-address", o.BindAddress, "kube-proxy's bind address: accepted; in a --config file an IPv6 one makes the default health and metrics addresses IPv6.")
	fs.BoolVar(&o.BindAddressHardFail, "bind-address-hard-fail", o.BindAddressHardFail, "Stop if the healthz or metrics port cannot be bound; otherwise binding is retried in the background.")
	fs.Float32Var(&o.KubeAPIQPS, "kube-api-qps", o.KubeAPIQPS, "Queries per second to the apiserver.")
	fs.IntVar(&o.KubeAPIBurst, "kube-api-burst", o.KubeAPIBurst, "Burst of queries to the apiserver.")
	fs.StringVar(&o.KubeAPIContentType, "kube-api-content-type", o.KubeAPIContentType, "Content type of requests to the apiserver.")
	fs.BoolVar(&o.EnableProfiling, "profiling", o.EnableProfiling, "Serve pprof on the metrics address, as kube-proxy does (never /debug/stages: see --enable-debug-handlers).")
	fs.Var(cliflag.NewMapStringBool(&o.FeatureGates), "feature-gates", "kube-proxy v1.34's feature gates, checked as kube-proxy checks them (an unknown gate, or a locked one set against its default, is an error); none changes what kpipe does.")
	fs.IntVarP(&o.Verbosity, "v", "v", o.Verbosity, "kube-proxy's log verbosity: 0-3 is --log-level=info, 4 and more is debug (unless --log-level is given).")
	fs.StringVar(&o.LogFormat, "logging-format", o.LogFormat, "kube-proxy's name for --log-format.")
	fs.BoolVar(&o.Cleanup, "cleanup", o.Cleanup, "Remove every rule and chain kube-proxy's iptables mode (or kpipe) made, and kube-proxy's nftables tables, then exit (1 if anything could not be removed).")
	fs.BoolVar(&o.InitOnly, "init-only", o.InitOnly, "Set the node up (conntrack sysctls, route_localnet for NodePorts on 127.0.0.1; kube-proxy's nftables tables removed) and exit, so that kpipe can then run with CAP_NET_ADMIN alone.")
	fs.Var(&o.version, "version", "--version prints kpipe's version and exits, --version=raw every field of its build.")
	fs.Lookup("version").NoOptDefVal = string(versionLine)
	c := &o.Conntrack
	fs.Int32Var(&c.MaxPerCore, "conntrack-max-per-core", c.MaxPerCore, "Conntrack entries per CPU core (nf_conntrack_max is this times the cores, at least --conntrack-min); 0 leaves nf_conntrack_max as it is.")
	fs.Int32Var(&c.Min, "conntrack-min", c.Min, "The least nf_conntrack_max to set, whatever the cores.")
	fs.DurationVar(&c.TCPEstablishedTimeout, "conntrack-tcp-timeout-established", c.TCPEstablishedTimeout, "Idle timeout of established TCP conntrack entries; 0 leaves it as it is.")
	fs.DurationVar(&c.TCPCloseWaitTimeout, "conntrack-tcp-timeout-close-wait", c.TCPCloseWaitTimeout, "Timeout of TCP conntrack entries in CLOSE_WAIT; 0 leaves it as it is.")
	fs.BoolVar(&c.TCPBeLiberal, "conntrack-tcp-be-liberal", c.TCPBeLiberal, "Make conntrack liberal about TCP packets out of window (nf_conntrack_tcp_be_liberal=1).")
	fs.DurationVar(&c.UDPTimeout, "conntrack-udp-timeout", c.UDPTimeout, "Idle timeout of UNREPLIED UDP conntrack entries; 0 leaves it as it is.")
	fs.DurationVar(&c.UDPStreamTimeout, "conntrack-udp-timeout-stream", c.UDPStreamTimeout, "Idle timeout of ASSURED UDP conntrack entries; 0 leaves it as it is.")
	fs.Int32Var(&o.OOMScoreAdj, "oom-score-adj", o.OOMScoreAdj, "The oom_score_adj of the kpipe process, -1000 to 1000.")
	o.addDeprecatedPortFlags(fs)
	addIgnoredFlags(fs)
}

// addDeprecatedPortFlags adds kube-proxy's deprecated --healthz-port and
// --metrics-port (see applyDeprecatedPorts).
func (o *Options) addDeprecatedPortFlags(fs *pflag.FlagSet) {
	fs.Int32Var(&o.healthzPortFlag, "healthz-port", healthzPort, "The port to bind the health check server. Use 0 to disable.")
	_ = fs.MarkDeprecated("healthz-port", "This flag is deprecated and will be removed in a future release. Please use --healthz-bind-address instead.")
	fs.Int32Var(&o.metricsPortFlag, "metrics-port", metricsPort, "The port to bind the metrics server. Use 0 to disable.")
	_ = fs.MarkDeprecated("metrics-port", "This flag is deprecated and will be removed in a future release. Please use --metrics-bind-address instead.")
}

// applyDeprecatedPorts does what kube-proxy does with --healthz-port and
// --metrics-port, and only without --config and --write-config-to, as it
// does: 0 disables that server; another port is the port of a bind address
// given as a bare IP (one with a port keeps it).
func (o *Options) applyDeprecatedPorts() {
	if o.ConfigFile != "" || o.WriteConfigTo != "" {
		return
	}
	o.HealthzBindAddress = addressWithPort(o.HealthzBindAddress, o.healthzPortFlag)
	o.MetricsBindAddress = addressWithPort(o.MetricsBindAddress, o.metricsPortFlag)
}

func addressWithPort(addr string, port int32) string {
	if port == 0 {
		return ""
	}
	return withDefaultPort(addr, int(port))
}

// ignoredAnnotation marks the flags kpipe parses and does not use.
const ignoredAnnotation = "kpipe/ignored"

// addIgnoredFlags adds kube-proxy flags of other proxy modes, of host
// settings, or without effect in kpipe: parsed (a bad value is still an
// error, as in kube-proxy), named once in the log (logIgnored), and otherwise
// unused.
func addIgnoredFlags(fs *pflag.FlagSet) {
	const help = "Accepted for kube-proxy compatibility and ignored."
	ignored := pflag.NewFlagSet("ignored", pflag.ContinueOnError)
	for _, n := range []string{"ipvs-sync-period", "ipvs-min-sync-period", "ipvs-tcp-timeout", "ipvs-tcpfin-timeout", "ipvs-udp-timeout", "config-sync-period", "log-flush-frequency"} {
		ignored.Duration(n, 0, help)
	}
	ignored.Bool("ipvs-strict-arp", false, help)
	for _, n := range []string{"ipvs-scheduler", "show-hidden-metrics-for-version", "vmodule"} {
		ignored.String(n, "", help)
	}
	ignored.StringSlice("ipvs-exclude-cidrs", nil, help)
	// cadvisor's flags, which kube-proxy's binary links in and never reads.
	ignored.String("boot-id-file", "/proc/sys/kernel/random/boot_id", help+" (cadvisor's flag in kube-proxy's binary, where nothing reads it either)")
	ignored.String("machine-id-file", "/etc/machine-id,/var/lib/dbus/machine-id", help+" (cadvisor's flag in kube-proxy's binary, where nothing reads it either)")
	// component-base's alpha logging options: kpipe writes every line to one
	// unbuffered stream, stderr.
	for _, format := range []string{"text", "json"} {
		ignored.Bool("log-"+format+"-split-stream", false, help+" kpipe writes every "+format+" line to stderr.")
		ignored.Var(&resource.QuantityValue{}, "log-"+format+"-info-buffer-size", help+" kpipe does not buffer log lines.")
	}
	ignored.VisitAll(func(f *pflag.Flag) { f.Annotations = map[string][]string{ignoredAnnotation: nil} })
	fs.AddFlagSet(ignored)
}

// resolve takes the configuration file (if any) over the flags given on the
// command line (see applyConfig), and maps --v onto the log level.
func (o *Options) resolve(fs *pflag.FlagSet) error {
	if o.ConfigFile != "" {
		if err := o.applyConfigFile(fs); err != nil {
			return err
		}
	}
	o.applyDeprecatedPorts()
	if fs.Changed("v") && !fs.Changed("log-level") {
		o.LogLevel = levelOfVerbosity(o.Verbosity)
	}
	o.ignoredGiven = ignoredGiven(fs)
	return nil
}

// ignoredGiven names the ignored flags given on the command line, sorted.
func ignoredGiven(fs *pflag.FlagSet) []string {
	var names []string
	fs.Visit(func(f *pflag.Flag) {
		if _, ok := f.Annotations[ignoredAnnotation]; ok {
			names = append(names, f.Name)
		}
	})
	sort.Strings(names)
	return names
}

// logIgnored says, once, which kube-proxy flags kpipe accepted without using them.
func (o *Options) logIgnored(log *slog.Logger) {
	if len(o.ignoredGiven) > 0 {
		log.Info("ignoring kube-proxy flags of other proxy modes or host settings", "flags", strings.Join(o.ignoredGiven, ","))
	}
}
