package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// tempNodeHost is a node whose /proc/sys and oom_score_adj are files in a
// temporary directory: tests never change the real host's sysctls.
func tempNodeHost(t *testing.T, cpus int) nodeHost {
	t.Helper()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "sys/net/netfilter"), 0o755); err != nil {
		t.Fatal(err)
	}
	return nodeHost{sysctls: nf.Sysctls{Root: filepath.Join(dir, "sys")}, oomScoreAdjFile: filepath.Join(dir, "oom_score_adj"), cpus: func() int { return cpus }}
}

func discard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// sysctlsOf reads back every conntrack sysctl node set-up may write; "" is unset.
func sysctlsOf(t *testing.T, h nodeHost) map[string]string {
	t.Helper()
	got := map[string]string{}
	for _, n := range []string{"nf_conntrack_max", "nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait",
		"nf_conntrack_tcp_be_liberal", "nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"} {
		v, err := h.sysctls.Read("net/netfilter/" + n)
		if err == nil {
			got[n] = v
		}
	}
	if b, err := os.ReadFile(h.oomScoreAdjFile); err == nil {
		got["oom_score_adj"] = string(b)
	}
	return got
}

func checkSysctls(t *testing.T, got, want map[string]string) {
	t.Helper()
	for k := range want {
		if got[k] != want[k] {
			t.Errorf("%s = %q; want %q", k, got[k], want[k])
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s = %q written; want it left alone", k, got[k])
		}
	}
}

// With no settings, kpipe sets what kube-proxy sets by default: nf_conntrack_max
// from 32768 per core (at least 131072), 24h established and 1h close-wait
// timeouts, and OOM score -999; the UDP timeouts and be_liberal are left alone.
func TestNodeSetUpDefaults(t *testing.T) {
	o, code, stderr := resolved(t)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for cpus, max := range map[int]string{2: "131072", 8: "262144"} {
		h := tempNodeHost(t, cpus)
		if failed := setUpNode(o, h, discard()); len(failed) != 0 {
			t.Errorf("writes failed: %v", failed)
		}
		checkSysctls(t, sysctlsOf(t, h), map[string]string{"nf_conntrack_max": max, "nf_conntrack_tcp_timeout_established": "86400",
			"nf_conntrack_tcp_timeout_close_wait": "3600", "oom_score_adj": "-999"})
	}
}

func TestNodeSetUpFromFlags(t *testing.T) {
	o, code, stderr := resolved(t, "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=2h", "--conntrack-tcp-timeout-close-wait=0",
		"--conntrack-tcp-be-liberal", "--conntrack-udp-timeout=30s", "--conntrack-udp-timeout-stream=2m", "--oom-score-adj=-500")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	h := tempNodeHost(t, 4)
	setUpNode(o, h, discard())
	checkSysctls(t, sysctlsOf(t, h), map[string]string{"nf_conntrack_tcp_timeout_established": "7200", "nf_conntrack_tcp_be_liberal": "1",
		"nf_conntrack_udp_timeout": "30", "nf_conntrack_udp_timeout_stream": "120", "oom_score_adj": "-500"})
}

// The configuration file's conntrack section and oomScoreAdj are used; a flag
// given beside the file is ignored, as in kube-proxy.
func TestNodeSetUpFromConfigFile(t *testing.T) {
	cfg := writeFile(t, `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
oomScoreAdj: -100
conntrack:
  maxPerCore: 1000
  min: 2000
  tcpEstablishedTimeout: 3h
  tcpCloseWaitTimeout: 30m
  tcpBeLiberal: true
  udpTimeout: 10s
`)
	o, code, stderr := resolved(t, "--config="+cfg, "--conntrack-min=100")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	h := tempNodeHost(t, 3)
	setUpNode(o, h, discard())
	checkSysctls(t, sysctlsOf(t, h), map[string]string{"nf_conntrack_max": "3000", "nf_conntrack_tcp_timeout_established": "10800",
		"nf_conntrack_tcp_timeout_close_wait": "1800", "nf_conntrack_tcp_be_liberal": "1", "nf_conntrack_udp_timeout": "10", "oom_score_adj": "-100"})

	// The effective configuration carries them back out.
	c := o.effectiveConfig()
	if *c.Conntrack.MaxPerCore != 1000 || *c.Conntrack.Min != 2000 || c.Conntrack.TCPEstablishedTimeout.Duration != 3*time.Hour || *c.OOMScoreAdj != -100 {
		t.Errorf("effective config %+v, oomScoreAdj %d", c.Conntrack, *c.OOMScoreAdj)
	}
}

// A sysctl that cannot be written (read-only /proc/sys, a global sysctl in a
// network namespace) is a warning: the others are still written.
func TestNodeSetUpGoesOnPastAnUnwritableSysctl(t *testing.T) {
	o := defaultOptions()
	h := tempNodeHost(t, 2)
	// A directory where the file should be: the write fails, as on a read-only /proc/sys.
	if err := os.Mkdir(filepath.Join(h.sysctls.Root, "net/netfilter/nf_conntrack_max"), 0o755); err != nil {
		t.Fatal(err)
	}
	h.oomScoreAdjFile = filepath.Join(h.sysctls.Root, "no/such/dir/oom_score_adj")
	failed := setUpNode(o, h, discard())
	var steps []string
	for _, f := range failed {
		if !strings.Contains(f.Note, "could not set") {
			t.Errorf("failure %q: note %q", f.Step, f.Note)
		}
		steps = append(steps, f.Step)
	}
	if want := []string{"SetSysctl/net/netfilter/nf_conntrack_max", "SetOOMScoreAdj"}; !slices.Equal(steps, want) {
		t.Errorf("failed steps %q; want %q", steps, want)
	}
	got := sysctlsOf(t, h)
	if got["nf_conntrack_tcp_timeout_established"] != "86400" || got["nf_conntrack_tcp_timeout_close_wait"] != "3600" {
		t.Errorf("the writable sysctls were not set after a failing one: %v", got)
	}
}

func TestOneShotModesAreOptions(t *testing.T) {
	for _, flag := range []string{"--cleanup", "--init-only"} {
		o, code, stderr := resolved(t, flag)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", flag, code, stderr)
		}
		if o.Cleanup != (flag == "--cleanup") || o.InitOnly != (flag == "--init-only") {
			t.Errorf("%s: Cleanup %v, InitOnly %v", flag, o.Cleanup, o.InitOnly)
		}
	}
}

// kube-proxy's nftables tables are removed only once every family has committed
// a full sync: a partial sync or one family is not enough.
func TestRemoveNFTablesModeWaitsForEveryFamilysFullSync(t *testing.T) {
	board := bus.NewBoard()
	removed := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		if waitFullSyncs(context.Background(), board, []bus.Family{bus.IPv4, bus.IPv6}) {
			close(removed)
		}
	}()
	notYet := func(step string) {
		t.Helper()
		select {
		case <-removed:
			t.Fatalf("tables removed %s", step)
		case <-time.After(5 * syncPoll):
		}
	}
	notYet("before any sync")
	board.Publish(bus.Commit.Of(bus.IPv4), bus.Report{LastFullSync: time.Now()})
	board.Publish(bus.Commit.Of(bus.IPv6), bus.Report{LastSync: time.Now()})
	notYet("after IPv4's full sync and a partial IPv6 sync")
	board.Update(bus.Commit.Of(bus.IPv6), func(r *bus.Report) { r.LastFullSync = time.Now() })
	select {
	case <-removed:
	case <-time.After(5 * time.Second):
		t.Fatal("tables not removed after both families' full syncs")
	}
	<-done
}

// kpipe stopping before its first full sync leaves the tables (they may be
// all that proxies the node).
func TestRemoveNFTablesModeNotWhenStoppedBeforeSync(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if waitFullSyncs(ctx, bus.NewBoard(), []bus.Family{bus.IPv4}) {
			t.Error("full syncs seen without a sync")
		}
	}()
	time.Sleep(3 * syncPoll)
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("still waiting after its context ended")
	}
}
