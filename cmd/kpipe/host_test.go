package main

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render"
)

// A host whose ip6tables fails when kpipe starts (a held lock, a slow module load)
// still gets IPv6: the family follows what the host is, and commit retries a
// failing tool later. Real kernel, fake ip6tables tools first on PATH.
func TestHostFamiliesIgnoreAFailingIp6tablesRun(t *testing.T) {
	if _, err := os.Stat("/proc/net/if_inet6"); err != nil {
		t.Skip("this kernel has no IPv6")
	}
	dir := t.TempDir()
	for _, name := range []string{"ip6tables", "ip6tables-restore", "ip6tables-save"} {
		script := "#!/bin/sh\necho 'ip6tables: Resource temporarily unavailable' >&2\nexit 4\n"
		if err := os.WriteFile(filepath.Join(dir, name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	if got := hostFamilies(slog.New(slog.DiscardHandler)); !slices.Equal(got, []bus.Family{bus.IPv4, bus.IPv6}) {
		t.Errorf("families with a failing ip6tables = %v; want IPv4 and IPv6", got)
	}
}

func TestFamiliesOf(t *testing.T) {
	noFile := func(string) bool { return false }
	found := func(f string) (string, error) { return "/usr/sbin/" + f, nil }
	missing := func(string) (string, error) { return "", errors.New("not found") }
	tests := []struct {
		name     string
		probes   hostProbes
		families []bus.Family
	}{
		{"IPv6 kernel and tools", hostProbes{exists: func(p string) bool { return p == "/proc/net/if_inet6" }, lookPath: found}, []bus.Family{bus.IPv4, bus.IPv6}},
		{"IPv6 sysctls only", hostProbes{exists: func(p string) bool { return p == "/proc/sys/net/ipv6" }, lookPath: found}, []bus.Family{bus.IPv4, bus.IPv6}},
		{"no IPv6 in the kernel", hostProbes{exists: noFile, lookPath: found}, []bus.Family{bus.IPv4}},
		{"no ip6tables-restore", hostProbes{exists: func(string) bool { return true }, lookPath: missing}, []bus.Family{bus.IPv4}},
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
	if o.renderConfig(bus.IPv4, host).NoRandomFully {
		t.Error("IPv4 render config drops --random-fully that its iptables supports")
	}
	if !o.renderConfig(bus.IPv6, host).NoRandomFully {
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
		if got, want := o.renderConfig(f, host).NFAcct, (render.NFAcctObjects{InvalidDropped: true}); got != want {
			t.Errorf("%v render config: nfacct objects %+v; want %+v", f, got, want)
		}
	}
}
