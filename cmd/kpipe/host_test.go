package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render"
)

// A host whose ip6tables fails when kpipe starts (a held lock, a slow module load)
// still gets IPv6: the family follows what the host is, and commit retries a
// failing tool later. Real kernel, fake ip6tables tools first on PATH.
func TestHostFamiliesIgnoreAFailingIp6tablesRun(t *testing.T) {
	failingIp6tables(t, "ip6tables: Resource temporarily unavailable", 4)
	if got := hostFamilies(slog.New(slog.DiscardHandler)); !slices.Equal(got, []bus.Family{bus.IPv4, bus.IPv6}) {
		t.Errorf("families with a failing ip6tables = %v; want IPv4 and IPv6", got)
	}
}

// A host whose kernel has IPv6 and ip6tables but no IPv6 nat table (legacy
// without ip6table_nat) gets IPv4 alone: IPv6 could never work there. Real
// kernel, fake ip6tables tools first on PATH, answering as legacy ip6tables does.
func TestHostFamiliesLeaveOutIPv6WithoutNAT(t *testing.T) {
	failingIp6tables(t, noIPv6NAT, 3)
	if got := hostFamilies(slog.New(slog.DiscardHandler)); !slices.Equal(got, []bus.Family{bus.IPv4}) {
		t.Errorf("families with no IPv6 nat table = %v; want IPv4 alone", got)
	}
}

// noIPv6NAT is legacy ip6tables' answer on a kernel without ip6table_nat.
const noIPv6NAT = "ip6tables v1.8.9 (legacy): can't initialize ip6tables table `nat': Table does not exist (do you need to insmod?)\n" +
	"Perhaps ip6tables or your kernel needs to be upgraded."

// failingIp6tables puts first on PATH ip6tables tools that print stderr and
// exit with status; the test is skipped on a kernel without IPv6.
func failingIp6tables(t *testing.T, stderr string, status int) {
	t.Helper()
	if _, err := os.Stat("/proc/net/if_inet6"); err != nil {
		t.Skip("this kernel has no IPv6")
	}
	dir := t.TempDir()
	for _, name := range []string{"ip6tables", "ip6tables-restore", "ip6tables-save"} {
		script := fmt.Sprintf("#!/bin/sh\ncat >&2 <<'EOF'\n%s\nEOF\nexit %d\n", stderr, status)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
}

// TestTreeWithoutIPv6NAT: on a host with no IPv6 nat table, the tree built for
// the host's families programs IPv4 and /livez answers 200 at every look for
// two and a half health timeouts (2 × the sync period) after it. Real host
// probe, real tree, fake kernels: the IPv6 one refuses every write, as that
// host's ip6tables-restore does.
func TestTreeWithoutIPv6NAT(t *testing.T) {
	failingIp6tables(t, noIPv6NAT, 3)
	client, watching := watchedClient()
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	o := defaultOptions()
	o.HostnameOverride, o.HealthzBindAddress, o.MetricsBindAddress = "node-1", freeAddr(t), "127.0.0.1:0"
	o.MinSyncPeriod, o.SyncPeriod = 0, time.Second
	if err := o.complete(); err != nil {
		t.Fatal(err)
	}
	ipv4 := fakekernel.New()
	d := fakeDeps(client, ipv4, log)
	for _, f := range hostFamilies(log) {
		if f == bus.IPv6 {
			ipv6 := fakekernel.New()
			ipv6.BeforeRestore = func(int, string) error {
				return errors.New("ip6tables-restore v1.8.9 (legacy): ip6tables-restore: unable to initialize table 'nat'")
			}
			d.kernels[f], d.canaries[f] = ipv6, liveCanaries{}
		}
	}

	ctx := runInBackground(t, &logs, buildTree(o, d).Run)
	waitWatches(t, watching, "services", "endpointslices")
	createWebService(ctx, t, client)
	waitNAT(t, ipv4, "the ClusterIP and DNAT rules of ns/web", func(nat []string) bool {
		return hasRule(nat, "-d 10.96.0.10/32", "--dport 80", "-j KUBE-SVC-")
	})

	livez := "http://" + o.HealthzBindAddress + "/livez"
	for end := time.Now().Add(5 * o.SyncPeriod); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		resp, err := http.Get(livez)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("/livez answered %d: %s", resp.StatusCode, body)
		}
	}
}

func TestFamiliesOf(t *testing.T) {
	noFile := func(string) bool { return false }
	anyFile := func(string) bool { return true }
	found := func(f string) (string, error) { return "/usr/sbin/" + f, nil }
	missing := func(string) (string, error) { return "", errors.New("not found") }
	natOK := func(bus.Family) error { return nil }
	natFails := func(err error) func(bus.Family) error { return func(bus.Family) error { return err } }
	tests := []struct {
		name     string
		probes   hostProbes
		families []bus.Family
	}{
		{"IPv6 kernel and tools", hostProbes{exists: func(p string) bool { return p == "/proc/net/if_inet6" }, lookPath: found, listNAT: natOK}, []bus.Family{bus.IPv4, bus.IPv6}},
		{"IPv6 sysctls only", hostProbes{exists: func(p string) bool { return p == "/proc/sys/net/ipv6" }, lookPath: found, listNAT: natOK}, []bus.Family{bus.IPv4, bus.IPv6}},
		{"no IPv6 in the kernel", hostProbes{exists: noFile, lookPath: found, listNAT: natOK}, []bus.Family{bus.IPv4}},
		{"no ip6tables-restore", hostProbes{exists: anyFile, lookPath: missing, listNAT: natOK}, []bus.Family{bus.IPv4}},
		{"no IPv6 nat table", hostProbes{exists: anyFile, lookPath: found, listNAT: natFails(fmt.Errorf("ip6tables: %w", nf.ErrNoTable))}, []bus.Family{bus.IPv4}},
		{"ip6tables failing otherwise", hostProbes{exists: anyFile, lookPath: found, listNAT: natFails(errors.New("ip6tables: Resource temporarily unavailable"))}, []bus.Family{bus.IPv4, bus.IPv6}},
	}
	for _, tt := range tests {
		if got := familiesOf(tt.probes, slog.New(slog.DiscardHandler)); !slices.Equal(got, tt.families) {
			t.Errorf("%s: families = %v; want %v", tt.name, got, tt.families)
		}
	}
}

// A family whose iptables cannot do --random-fully gets MASQUERADE rules without it;
// the other family keeps it.
func TestRenderConfigRandomFully(t *testing.T) {
	o, err := parse(t, "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	host := hostFacts{noRandomFully: map[bus.Family]bool{bus.IPv6: true}}
	if o.forFamily(bus.IPv4, host).render.NoRandomFully {
		t.Error("IPv4 render config drops --random-fully that its iptables supports")
	}
	if !o.forFamily(bus.IPv6, host).render.NoRandomFully {
		t.Error("IPv6 render config writes --random-fully that its iptables does not support")
	}
}

// failingNFAcct fails to create the objects it names.
type failingNFAcct map[string]bool

func (f failingNFAcct) Ensure(name string) error {
	if f[name] {
		return errors.New("nfacct: operation not supported")
	}
	return nil
}

// An nfacct object kpipe cannot create is left out of the rules (they would be
// refused); the other is counted in, in both families' render configs.
func TestNFAcctObjectsReachRender(t *testing.T) {
	o, err := parse(t, "--hostname-override", "n")
	if err != nil {
		t.Fatal(err)
	}
	host := hostFacts{nfacct: ensureNFAcct(failingNFAcct{nf.NFAcctLocalhostNodePorts: true}, slog.New(slog.DiscardHandler))}
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		if got, want := o.forFamily(f, host).render.NFAcct, (render.NFAcctObjects{InvalidDropped: true}); got != want {
			t.Errorf("%v render config: nfacct objects %+v; want %+v", f, got, want)
		}
	}
}

// The families left out show on the metrics listener.
func TestRegisterFamilies(t *testing.T) {
	reg := prometheus.NewRegistry()
	registerFamilies(reg, []bus.Family{bus.IPv4})
	want := `# HELP kpipe_ip_family_programmed 1 for an IP family kpipe programs, 0 for one the host cannot have (see the IPv6 off log line)
# TYPE kpipe_ip_family_programmed gauge
kpipe_ip_family_programmed{ip_family="IPv4"} 1
kpipe_ip_family_programmed{ip_family="IPv6"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kpipe_ip_family_programmed"); err != nil {
		t.Error(err)
	}
}
