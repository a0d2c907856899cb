package main

import (
	"log/slog"
	"sort"
	"strings"

	"github.com/spf13/pflag"
	cliflag "k8s.io/component-base/cli/flag"
)

var (
	ignoredDurationFlags = []string{"ipvs-sync-period", "ipvs-min-sync-period", "ipvs-tcp-timeout", "ipvs-tcpfin-timeout", "ipvs-udp-timeout", "config-sync-period", "log-flush-frequency"}
	ignoredBoolFlags     = []string{"ipvs-strict-arp"}
	ignoredStringFlags   = []string{"ipvs-scheduler", "show-hidden-metrics-for-version", "vmodule"}
	ignoredSliceFlags    = []string{"ipvs-exclude-cidrs"}
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
	fs.Var(cliflag.NewMapStringBool(&o.FeatureGates), "feature-gates", "kube-proxy feature gates: accepted, and ignored (none changes the iptables mode kpipe implements).")
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
	// kube-proxy flags of other modes or of host settings: parsed (a bad value is
	// still an error) and otherwise unused.
	for _, n := range ignoredDurationFlags {
		fs.Duration(n, 0, "Accepted for kube-proxy compatibility and ignored.")
	}
	for _, n := range ignoredBoolFlags {
		fs.Bool(n, false, "Accepted for kube-proxy compatibility and ignored.")
	}
	for _, n := range ignoredStringFlags {
		fs.String(n, "", "Accepted for kube-proxy compatibility and ignored.")
	}
	for _, n := range ignoredSliceFlags {
		fs.StringSlice(n, nil, "Accepted for kube-proxy compatibility and ignored.")
	}
}

// resolve takes the configuration file (if any) over the flags given on the
// command line (see applyConfig), and maps --v onto the log level.
func (o *Options) resolve(fs *pflag.FlagSet) error {
	if o.ConfigFile != "" {
		if err := o.applyConfigFile(fs); err != nil {
			return err
		}
	}
	if fs.Changed("v") && !fs.Changed("log-level") {
		o.LogLevel = levelOfVerbosity(o.Verbosity)
	}
	o.ignoredGiven = ignoredGiven(fs)
	return nil
}

// ignoredGiven names the ignored flags given on the command line, sorted.
func ignoredGiven(fs *pflag.FlagSet) []string {
	var names []string
	for _, group := range [][]string{ignoredDurationFlags, ignoredBoolFlags, ignoredStringFlags, ignoredSliceFlags} {
		for _, n := range group {
			if fs.Changed(n) {
				names = append(names, n)
			}
		}
	}
	sort.Strings(names)
	return names
}

// logIgnored says, once, which kube-proxy flags kpipe accepted without using them.
func (o *Options) logIgnored(log *slog.Logger) {
	if len(o.ignoredGiven) > 0 {
		log.Info("ignoring kube-proxy flags of other proxy modes or host settings", "flags", strings.Join(o.ignoredGiven, ","))
	}
}
