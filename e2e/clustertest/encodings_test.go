package clustertest

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// TestNetlinkWriterEqualsTheImagesIPTables runs netfilter's byte-identical
// proofs (TestNetlinkWriterEqualsRestore: kpipe's netlink writer leaves the
// kernel holding exactly the expressions iptables-restore writes, and
// iptables-save lists them identically; TestExpectedDigestIsTheKernels)
// with the iptables binaries inside the kpipe image this run built
// (KPIPE_IPTABLES_IMAGE: netfilter's tests unpack it and chroot into it),
// not only with the host's.
func TestNetlinkWriterEqualsTheImagesIPTables(t *testing.T) {
	fullOnly(t)
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "test", "-count=1", "-v", "-run", "^(TestNetlinkWriterEqualsRestore|TestExpectedDigestIsTheKernels)$", "./netfilter/")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "KPIPE_IPTABLES_IMAGE="+c.Images.Kpipe.Archive)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("netfilter's proofs with %s's iptables: %v\n%s", c.Images.Kpipe.Ref, err, out)
	}
	// netfilter's TestMain fails the run if the image's iptables cannot be
	// run or is not the nf_tables backend; the version is for the log.
	version := regexp.MustCompile(`iptables v[0-9.]+ \(nf_tables\)`).FindString(string(out))
	t.Logf("%s: both proofs pass with its %s", c.Images.Kpipe.Ref, version)
}
