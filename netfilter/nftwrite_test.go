package netfilter_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/writertest"
)

// TestNetlinkWriterEqualsRestore: every render golden, written with the
// netlink writer into one namespace and with iptables-restore into another,
// gives the same iptables-save output byte for byte (counters aside) and the
// same expressions in the kernel; so does writing it again over itself, and
// iptables-restore writing it over what the netlink writer wrote.
func TestNetlinkWriterEqualsRestore(t *testing.T) {
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
}
