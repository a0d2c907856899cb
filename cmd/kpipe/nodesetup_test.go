package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
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
	for _, d := range []string{"sys/net/netfilter", "sys/net/ipv4/conf/all"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A hashsize larger than any nf_conntrack_max/4 the tests set: left alone.
	if err := os.WriteFile(filepath.Join(dir, "hashsize"), []byte("1048576\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return nodeHost{sysctls: nf.Sysctls{Root: filepath.Join(dir, "sys")}, oomScoreAdjFile: filepath.Join(dir, "oom_score_adj"),
		hashsizeFile: filepath.Join(dir, "hashsize"), cpus: func() int { return cpus }}
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

// hashsizeOf reads back the fake node's conntrack hashsize.
func hashsizeOf(t *testing.T, h nodeHost) string {
	t.Helper()
	b, err := os.ReadFile(h.hashsizeFile)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// nf_conntrack_max is maxPerCore times the CPUs (at least min) and the
// conntrack hashsize is raised to a quarter of it when lower, as kube-proxy
// does; a hashsize already as large or larger is left alone.
func TestNodeSetUpRaisesTheConntrackHashsize(t *testing.T) {
	o := defaultOptions() // 32768 per core, at least 131072
	for _, c := range []struct {
		cpus           int
		hashsize, want string
		nfConntrackMax string
	}{
		{cpus: 8, hashsize: "16384", want: "65536", nfConntrackMax: "262144"},
		{cpus: 2, hashsize: "16384", want: "32768", nfConntrackMax: "131072"},   // min: 131072/4
		{cpus: 8, hashsize: "65536", want: "65536", nfConntrackMax: "262144"},   // already max/4
		{cpus: 8, hashsize: "524288", want: "524288", nfConntrackMax: "262144"}, // never lowered
	} {
		h := tempNodeHost(t, c.cpus)
		if err := os.WriteFile(h.hashsizeFile, []byte(c.hashsize+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if failed := setUpNode(o, h, discard()); len(failed) != 0 {
			t.Errorf("%d CPUs: writes failed: %v", c.cpus, failed)
		}
		if got := sysctlsOf(t, h)["nf_conntrack_max"]; got != c.nfConntrackMax {
			t.Errorf("%d CPUs: nf_conntrack_max %s; want %s", c.cpus, got, c.nfConntrackMax)
		}
		if got := hashsizeOf(t, h); got != c.want {
			t.Errorf("%d CPUs, hashsize %s: hashsize now %s; want %s", c.cpus, c.hashsize, got, c.want)
		}
	}
}

// A hashsize that cannot be raised (a read-only /sys, a network namespace other
// than the host's) is a failed step, as a sysctl is; maxPerCore 0 leaves both
// nf_conntrack_max and the hashsize alone.
func TestNodeSetUpHashsizeFailureAndMaxPerCoreZero(t *testing.T) {
	o := defaultOptions()
	h := tempNodeHost(t, 8)
	h.hashsizeFile = filepath.Join(h.sysctls.Root, "no/such/hashsize")
	var steps []string
	for _, f := range setUpNode(o, h, discard()) {
		steps = append(steps, f.Step)
	}
	if want := []string{"SetConntrackHashsize"}; !slices.Equal(steps, want) {
		t.Errorf("failed steps %q; want %q", steps, want)
	}

	o.Conntrack.MaxPerCore = 0
	h = tempNodeHost(t, 8)
	if err := os.WriteFile(h.hashsizeFile, []byte("1024"), 0o644); err != nil {
		t.Fatal(err)
	}
	setUpNode(o, h, discard())
	if got := hashsizeOf(t, h); got != "1024" {
		t.Errorf("maxPerCore 0: hashsize %s; want 1024 left alone", got)
	}
}

// CPU lists as the kernel writes them in /sys/devices/system/cpu/online.
func TestCountCPUList(t *testing.T) {
	for list, want := range map[string]int{"0": 1, "0-3": 4, "0-3,5": 5, "0,2,4-7\n": 6, "0-63": 64, "1-2,4-5,8": 5} {
		if got, err := countCPUList(list); err != nil || got != want {
			t.Errorf("countCPUList(%q) = %d, %v; want %d", list, got, err, want)
		}
	}
	for _, bad := range []string{"", "\n", "a", "3-1", "0-", "-3", "0,,1", "0-1-2"} {
		if got, err := countCPUList(bad); err == nil {
			t.Errorf("countCPUList(%q) = %d; want an error", bad, got)
		}
	}
}

// The CPUs are counted from the file given, falling back to the ones Go sees
// when it is missing or unreadable.
func TestOnlineCPUs(t *testing.T) {
	file := filepath.Join(t.TempDir(), "online")
	if err := os.WriteFile(file, []byte("0-3,5\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := onlineCPUs(file); got != 5 {
		t.Errorf("onlineCPUs(0-3,5) = %d; want 5", got)
	}
	if got := onlineCPUs(filepath.Join(t.TempDir(), "missing")); got != runtime.NumCPU() {
		t.Errorf("onlineCPUs(missing file) = %d; want runtime.NumCPU() %d", got, runtime.NumCPU())
	}
}

// Pinned to one CPU (a DaemonSet with a CPU set, taskset), kpipe still counts
// the machine's CPUs, as kube-proxy does (kubernetes#99225): the affinity mask
// is not the machine. The test runs itself again under taskset -c 0.
func TestRealNodeHostCountsCPUsPastTheAffinityMask(t *testing.T) {
	if os.Getenv("KPIPE_TEST_PRINT_CPUS") == "1" {
		fmt.Printf("cpus=%d\n", realNodeHost.cpus())
		return
	}
	online, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		t.Skipf("no /sys/devices/system/cpu/online: %v", err)
	}
	machine, err := countCPUList(string(online))
	if err != nil || machine < 2 {
		t.Skipf("%d online CPUs (%v): pinning to one could not show a difference", machine, err)
	}
	taskset, err := exec.LookPath("taskset")
	if err != nil {
		t.Skip("no taskset")
	}
	cmd := exec.Command(taskset, "-c", "0", os.Args[0], "-test.run=^TestRealNodeHostCountsCPUsPastTheAffinityMask$")
	cmd.Env = append(os.Environ(), "KPIPE_TEST_PRINT_CPUS=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if want := fmt.Sprintf("cpus=%d\n", machine); !strings.Contains(string(out), want) {
		t.Errorf("pinned to CPU 0: %q; want %q (the machine's online CPUs)", out, want)
	}
}

// --init-only sets net.ipv4.conf.all.route_localnet=1 when IPv4 NodePorts answer
// on 127.0.0.1, as kube-proxy's iptables mode does in its set-up, so a
// CAP_NET_ADMIN-only daemon started after it does not need to; it leaves it
// alone when they do not (turned off, or NodePort addresses without 127.0.0.1).
func TestInitNodeSetsRouteLocalnet(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "1"},
		{[]string{"--nodeport-addresses=127.0.0.0/8,10.0.0.0/8"}, "1"},
		{[]string{"--iptables-localhost-nodeports=false"}, "0"},
		{[]string{"--nodeport-addresses=10.0.0.0/8"}, "0"},
		{[]string{"--nodeport-addresses=primary"}, "0"},
	} {
		o, code, stderr := resolved(t, append([]string{"--init-only"}, c.args...)...)
		if code != 0 {
			t.Fatalf("%q: exit %d: %s", c.args, code, stderr)
		}
		h := tempNodeHost(t, 2)
		if err := h.sysctls.Write(routeLocalnet, "0"); err != nil {
			t.Fatal(err)
		}
		if err := initNode(o, h, discard()); err != nil {
			t.Errorf("%q: %v", c.args, err)
		}
		if got, err := h.sysctls.Read(routeLocalnet); err != nil || got != c.want {
			t.Errorf("%q: route_localnet %q (%v); want %q", c.args, got, err, c.want)
		}
	}
}

// A route_localnet --init-only cannot set is an error (exit 1), as in
// kube-proxy: the daemon after it may lack the privilege to set it.
func TestInitNodeFailsWhenRouteLocalnetCannotBeSet(t *testing.T) {
	h := tempNodeHost(t, 2)
	if err := os.MkdirAll(filepath.Join(h.sysctls.Root, routeLocalnet), 0o755); err != nil { // a directory: the write fails
		t.Fatal(err)
	}
	err := initNode(defaultOptions(), h, discard())
	if err == nil || !strings.Contains(err.Error(), "route_localnet") {
		t.Errorf("initNode with an unwritable route_localnet: %v; want an error naming route_localnet", err)
	}
}
