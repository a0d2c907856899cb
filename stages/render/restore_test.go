package render

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vishvananda/netns"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/netfilter/writertest"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// TestGoldenPayloadsRestore feeds every golden payload to the real
// iptables-restore (or ip6tables-restore) in a throwaway network namespace, so a
// rule the kernel or iptables would refuse fails here, not on a node.
func TestGoldenPayloadsRestore(t *testing.T) {
	netnstest.RequireRoot(t)
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		netnstest.Unavailable(t, "iptables-restore not installed (go tool task setup)")
	}
	files, err := filepath.Glob("testdata/*.golden")
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".golden"), func(t *testing.T) {
			ns := fmt.Sprintf("kpunit-%d-%s", os.Getpid(), strings.TrimSuffix(filepath.Base(f), ".golden"))
			ns = ns[:min(len(ns), 60)]
			run(t, "ip", "netns", "add", ns)
			t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
			payload, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			tool := "iptables-restore"
			if strings.Contains(f, "ipv6") {
				tool = "ip6tables-restore"
			}
			ensureNFAcct(t, ns)
			cmd := exec.Command("ip", "netns", "exec", ns, tool, "-w", "5", "--noflush", "--counters")
			cmd.Stdin = bytes.NewReader(payload)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("%s refused %s: %v\n%s", tool, f, err, out)
			}
			// And a second time over itself, as every later sync does.
			cmd = exec.Command("ip", "netns", "exec", ns, tool, "-w", "5", "--noflush", "--counters")
			cmd.Stdin = bytes.NewReader(payload)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("%s refused %s on top of itself: %v\n%s", tool, f, err, out)
			}
		})
	}
}

// ensureNFAcct creates kube-proxy's nfacct objects in the named namespace, as
// kpipe does at start: the rules that count in them need them.
func ensureNFAcct(t *testing.T, ns string) {
	t.Helper()
	h, err := netns.GetFromName(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, name := range nf.NFAcctNames {
		if err := (nf.NFAcct{NetNS: int(h)}).Ensure(name); err != nil {
			t.Fatal(err)
		}
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}

// TestNetlinkWriterEqualsRestoreAt10k: the full plan for 10,000 services × 10
// endpoints, written with the netlink writer and with iptables-restore into two
// fresh namespaces, leaves the same rules: iptables-save prints them byte for
// byte the same. (The goldens and the kernel fuzz target compare the kernel's
// expressions too; reading them from a table this size takes a minute.)
func TestNetlinkWriterEqualsRestoreAt10k(t *testing.T) {
	if raceDetector {
		t.Skip("minutes under the race detector; `go tool task unit` runs it without")
	}
	cfg := Config{Family: bus.IPv4, NodeName: "bench-node", MasqueradeBit: 14, DetectLocal: DetectClusterCIDR, ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}
	plan := Render(cfg, &bus.Snapshot{State: rendertest.SyntheticState(10000, 10), Full: true})
	// In runs of 4,000 chains, as commit writes a full sync (one
	// iptables-restore run of it all takes minutes); each run's chains come
	// after the chains they jump to (render's order).
	var payloads [][]byte
	rules, size := 0, 0
	for _, tp := range plan.Tables {
		for chains := tp.Chains; len(chains) > 0; {
			n := min(len(chains), 4000)
			payloads = append(payloads, nf.Assemble(tp.Table, chains[:n], nil))
			size += len(payloads[len(payloads)-1])
			chains = chains[n:]
		}
		rules += tp.RuleCount
	}
	b := writertest.New(t, bus.IPv4)
	b.Write(t, payloads...)
	b.RequireSameSaved(t, "10,000 services")
	t.Logf("%d rules, %d bytes of payload in %d runs: the same from both writers", rules, size, len(payloads))
	// What a restarted kpipe compares: each chain's digest in the kernel is
	// the one computed from its rules.
	tool := nf.Tool{Family: bus.IPv4}
	for _, tp := range plan.Tables {
		names := make([]string, len(tp.Chains))
		for i, c := range tp.Chains {
			names[i] = c.Name
		}
		var kernel map[string]uint64
		b.Netlink.Run(t, func() (err error) {
			kernel, err = tool.Digests(context.Background(), tp.Table, names)
			return err
		})
		for _, c := range tp.Chains {
			if want, ok := tool.ExpectedDigest(context.Background(), tp.Table, c.Rules); !ok || kernel[c.Name] != want {
				t.Fatalf("%s %s: the kernel's digest %x is not the expected %x (%v)", tp.Table, c.Name, kernel[c.Name], want, ok)
			}
		}
	}
}
