package netfilter_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/writertest"
)

// TestNetlinkWriterEqualsRestore: every render golden, written with the
// netlink writer into one namespace and with iptables-restore into another,
// gives the same iptables-save output byte for byte (counters aside) and the
// same expressions in the kernel; so does writing it again over itself, and
// iptables-restore writing it over what the netlink writer wrote.
func TestNetlinkWriterEqualsRestore(t *testing.T) {
	forEachGolden(t, func(t *testing.T, family bus.Family, payload []byte) {
		b := writertest.New(t, family)
		b.Write(t, payload)
		b.RequireSame(t, "first write")
		if !strings.Contains(b.Save(t, b.Netlink, "nat"), "-A KUBE-") {
			t.Fatal("no KUBE- rule in nat")
		}
		b.Write(t, payload)
		b.RequireSame(t, "written over itself")
		b.RestoreOverNetlink(t, payload)
		b.RequireSame(t, "iptables-restore over the netlink writer's rules")
	})
}

// TestExpectedDigestIsTheKernels: for every render golden written by the
// netlink writer, each chain's digest read from the kernel is the one
// ExpectedDigest computes from the chain's rules without the kernel.
func TestExpectedDigestIsTheKernels(t *testing.T) {
	forEachGolden(t, func(t *testing.T, family bus.Family, payload []byte) {
		b := writertest.New(t, family)
		b.Write(t, payload)
		compared := 0
		for table, chains := range chainsOf(t, string(payload)) {
			var kernel map[string]uint64
			b.Netlink.Run(t, func() (err error) {
				kernel, err = nf.Tool{Family: family}.Digests(context.Background(), table, nil)
				return err
			})
			for chain, rules := range chains {
				want, ok := nf.Tool{Family: family}.ExpectedDigest(context.Background(), table, rules)
				if !ok {
					t.Fatalf("%s %s: no expected digest for\n%s", table, chain, rules)
				}
				if kernel[chain] != want {
					t.Errorf("%s %s: the kernel's digest is %x, ExpectedDigest %x, for\n%s", table, chain, kernel[chain], want, rules)
				}
				compared++
			}
		}
		if compared == 0 {
			t.Fatal("no chain compared")
		}
	})
}

// forEachGolden runs test on each render golden, as a subtest.
func forEachGolden(t *testing.T, test func(t *testing.T, family bus.Family, payload []byte)) {
	files, err := filepath.Glob("../stages/render/testdata/*.golden")
	if err != nil || len(files) == 0 {
		t.Fatalf("no render goldens: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".golden"), func(t *testing.T) {
			payload, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			family := bus.IPv4
			if strings.Contains(filepath.Base(f), "ipv6") {
				family = bus.IPv6
			}
			logIPTablesVersion(t, family)
			test(t, family, payload)
		})
	}
}

// chainsOf splits a payload into its chains' rules, by table.
func chainsOf(t *testing.T, payload string) map[string]map[string]string {
	out := map[string]map[string]string{}
	var table string
	for line := range strings.Lines(payload) {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			out[table] = map[string]string{}
		case strings.HasPrefix(line, ":"):
			out[table][strings.Fields(line[1:])[0]] += ""
		case strings.HasPrefix(line, "-A "):
			chain := strings.Fields(line)[1]
			out[table][chain] += line + "\n"
		case line == "" || line == "COMMIT" || strings.HasPrefix(line, "#"):
		default:
			t.Fatalf("unexpected payload line %q", line)
		}
	}
	return out
}
