package netfilter_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/e2e/imagefs"
	nf "github.com/kpipe/kpipe/netfilter"
)

// toolsFrom says whose iptables the tests run, for their logs.
var toolsFrom = "the host's"

// TestMain lets the iptables tools be an image's, not the host's, for the
// proofs that the netlink writer writes what iptables-restore writes (issue 21:
// kpipe's image ships another iptables than the host):
//
//	KPIPE_IPTABLES_ROOT=/path/to/rootfs      an unpacked root filesystem
//	KPIPE_IPTABLES_IMAGE=/path/to/image.tar  a docker-archive, unpacked here
//
// e.g. KPIPE_IPTABLES_IMAGE=kpipe.tar go test -count=1 -v
// -run 'TestNetlinkWriterEqualsRestore|TestExpectedDigestIsTheKernels' ./netfilter/
// Every Tool run is then the image's xtables-nft-multi, chrooted there.
func TestMain(m *testing.M) {
	cleanup, err := useImageTools()
	if err != nil {
		fmt.Fprintln(os.Stderr, "netfilter tests:", err)
		os.Exit(1)
	}
	code := m.Run()
	cleanup()
	os.Exit(code)
}

// useImageTools sets the tools' root from the environment and checks that its
// iptables answers as the nf_tables backend (a broken root must fail the run,
// not skip the tests as a host without nf_tables would).
func useImageTools() (cleanup func(), err error) {
	cleanup = func() {}
	root := os.Getenv("KPIPE_IPTABLES_ROOT")
	archive := os.Getenv("KPIPE_IPTABLES_IMAGE")
	switch {
	case root != "":
		toolsFrom = "the image's, chrooted in " + root
	case archive != "":
		if root, err = os.MkdirTemp("", "kpipe-iptables-root-"); err != nil {
			return cleanup, err
		}
		cleanup = func() { os.RemoveAll(root) }
		skipped, err := imagefs.Unpack(archive, root)
		if err != nil {
			cleanup()
			return func() {}, err
		}
		toolsFrom = fmt.Sprintf("the image's, from %s (%d device nodes not made)", archive, len(skipped))
	default:
		return cleanup, nil
	}
	nf.SetToolRoot(root)
	for _, family := range []bus.Family{bus.IPv4, bus.IPv6} {
		v, err := nf.Tool{Family: family}.Version(context.Background())
		if err != nil || !strings.Contains(v, "(nf_tables)") {
			cleanup()
			return func() {}, fmt.Errorf("the iptables in %s: %q, %v; want the nf_tables backend", root, v, err)
		}
	}
	return cleanup, nil
}

// logIPTablesVersion records in the test's log which iptables the test ran.
func logIPTablesVersion(t *testing.T, family bus.Family) {
	t.Helper()
	v, err := nf.Tool{Family: family}.Version(context.Background())
	if err != nil {
		t.Fatalf("iptables -V: %v", err)
	}
	t.Logf("%s: %s", v, toolsFrom)
}
