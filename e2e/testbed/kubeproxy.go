package testbed

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Upstream kube-proxy's HTTP addresses inside the node namespace: other ports
// than kpipe's, so the two never clash.
const (
	KubeProxyHealthzURL = "http://127.0.0.1:10266"
	KubeProxyMetricsURL = "http://127.0.0.1:10259"
)

// KubeProxy is upstream kube-proxy (the version e2e/controlplane pins) run in
// the node namespace like kpipe, for the tests that hand the node between them.
type KubeProxy struct {
	tb      *Testbed
	Bin     string
	LogPath string
	// Mode is its --proxy-mode: "iptables" or "nftables".
	Mode string
	proc *Process
}

// KubeProxy returns upstream kube-proxy in mode ("iptables" or "nftables")
// ready to Start (built with the control plane, so normally already in the
// cache).
func (tb *Testbed) KubeProxy(mode string, logf func(string, ...any)) (*KubeProxy, error) {
	bins, err := EnsureControlPlane(tb.Root, logf)
	if err != nil {
		return nil, err
	}
	return &KubeProxy{tb: tb, Bin: bins.KubeProxy, Mode: mode, LogPath: tb.path("kube-proxy-" + mode + ".log")}, nil
}

// KubeProxyArgs are the flags the test bed runs kube-proxy with in mode
// (--proxy-mode): kpipe's node and cluster CIDR, its own ports.
// --conntrack-max-per-core 0 leaves nf_conntrack_max alone (the node namespace
// cannot set it).
func (tb *Testbed) KubeProxyArgs(mode string) []string {
	return []string{
		"--kubeconfig", tb.Kubeconfig,
		"--hostname-override", NodeName,
		"--proxy-mode", mode,
		"--cluster-cidr", ClusterCIDR,
		"--iptables-min-sync-period", "100ms",
		"--healthz-bind-address", "127.0.0.1:10266",
		"--metrics-bind-address", "127.0.0.1:10259",
		"--conntrack-max-per-core", "0",
		"-v", "2",
	}
}

// Start starts kube-proxy and waits until it has synced its rules once (see
// WaitSyncedAfter).
func (kp *KubeProxy) Start() error {
	started := time.Now()
	if err := kp.StartWith(kp.tb.KubeProxyArgs(kp.Mode)...); err != nil {
		return err
	}
	return kp.WaitSyncedAfter(started, 60*time.Second)
}

// StartWith starts kube-proxy in the node namespace with only args, and does
// not wait: its ports are wherever args put them.
func (kp *KubeProxy) StartWith(args ...string) error {
	if kp.proc != nil && !kp.proc.Exited() {
		return errors.New("kube-proxy is already running")
	}
	argv := append([]string{"ip", "netns", "exec", kp.tb.NodeNS, kp.Bin}, args...)
	p, err := startProcess("kube-proxy", kp.LogPath, nil, argv...)
	if err != nil {
		return err
	}
	kp.proc = p
	return nil
}

// Stop sends SIGTERM and waits for kube-proxy to exit (SIGKILL after 15 s).
func (kp *KubeProxy) Stop() error {
	if kp.proc == nil {
		return nil
	}
	err := kp.proc.Stop(15 * time.Second)
	if kp.proc.Exited() {
		// kube-proxy ends on SIGTERM with a non-zero status; that is not a failure.
		return nil
	}
	return err
}

// Cleanup runs `kube-proxy --cleanup` once in the node namespace: upstream's
// removal of its rules.
func (kp *KubeProxy) Cleanup() (string, error) {
	return kp.tb.Exec(kp.tb.NodeNS, kp.Bin, "--cleanup", "-v", "2")
}

// LogTail is the end of kube-proxy's log.
func (kp *KubeProxy) LogTail(n int) string { return tailFile(kp.LogPath, n) }

// Metrics reads kube-proxy's /metrics (see ScrapeMetrics).
func (kp *KubeProxy) Metrics() (map[string]float64, error) {
	return kp.tb.ScrapeMetrics(kp.tb.NodeNS, KubeProxyMetricsURL+"/metrics")
}

// Metric is every sample of one metric (any labels), keyed as in Metrics.
func (kp *KubeProxy) Metric(name string) (map[string]float64, error) {
	all, err := kp.Metrics()
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for k, v := range all {
		if SampleOf(k, name, nil) {
			out[k] = v
		}
	}
	return out, nil
}

// SyncMetric is the time of kube-proxy's last successful sync (one sample per
// IP family it runs).
const SyncMetric = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"

// WaitSyncedAfter waits until every IP family kube-proxy runs (or only those
// given, "IPv4" or "IPv6": a change to a single-stack Service syncs only its
// family) has made a successful sync after since.
func (kp *KubeProxy) WaitSyncedAfter(since time.Time, timeout time.Duration, families ...string) error {
	deadline := time.Now().Add(timeout)
	last := "no answer yet"
	for {
		if kp.proc == nil {
			return errors.New("kube-proxy was never started")
		}
		if kp.proc.Exited() {
			return fmt.Errorf("kube-proxy exited: %v\n--- kube-proxy log (%s):\n%s", kp.proc.ExitErr(), kp.LogPath, kp.LogTail(40))
		}
		samples, err := kp.Metric(SyncMetric)
		samples = ofFamilies(samples, families)
		switch {
		case err != nil:
			last = err.Error()
		case len(samples) == 0 || len(families) > len(samples):
			last = fmt.Sprintf("no %s of %v yet", SyncMetric, families)
		default:
			var synced bool
			if synced, last = syncedSince(samples, since); synced {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kube-proxy has not synced in %v (%s)\n--- kube-proxy log (%s):\n%s", timeout, last, kp.LogPath, kp.LogTail(40))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func syncedSince(samples map[string]float64, since time.Time) (bool, string) {
	floor := float64(since.UnixNano()) / 1e9
	for k, v := range samples {
		if v < floor {
			return false, fmt.Sprintf("%s = %v, before %v", k, v, floor)
		}
	}
	return true, ""
}

// ofFamilies keeps the samples labelled with one of families (all when none
// is given).
func ofFamilies(samples map[string]float64, families []string) map[string]float64 {
	if len(families) == 0 {
		return samples
	}
	out := map[string]float64{}
	for k, v := range samples {
		for _, f := range families {
			if strings.Contains(k, `ip_family="`+f+`"`) {
				out[k] = v
			}
		}
	}
	return out
}
