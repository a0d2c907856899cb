package cluster

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// TestDockerArchiveIsDeterministicAndNamed: the same inputs give the same
// bytes (so a cache key of the inputs is a key of the archive), the archive
// names the image, and a file's capability reaches the layer as an xattr.
func TestDockerArchiveIsDeterministicAndNamed(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "coredns")
	if err := os.WriteFile(bin, []byte("#!/bin/true\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	files := []layerFile{{Name: "coredns", Source: bin, Mode: 0o755, Xattrs: map[string]string{"security.capability": netBindServiceCap}}}
	cfg := imageConfig{User: "65532:65532", Entrypoint: []string{"/coredns"}}
	a, b := filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")
	for _, out := range []string{a, b} {
		if err := writeDockerArchive(out, CoreDNSRef, cfg, files); err != nil {
			t.Fatal(err)
		}
	}
	ab, _ := os.ReadFile(a)
	bb, _ := os.ReadFile(b)
	if !bytes.Equal(ab, bb) {
		t.Errorf("two archives of the same inputs differ (%d and %d bytes)", len(ab), len(bb))
	}
	if ref, err := archiveRef(a); err != nil || ref != CoreDNSRef {
		t.Errorf("archiveRef = %q, %v; want %q", ref, err, CoreDNSRef)
	}
	hdr := layerEntry(t, a, "coredns")
	if got := hdr.PAXRecords["SCHILY.xattr.security.capability"]; got != netBindServiceCap {
		t.Errorf("coredns's security.capability in the layer = %x, want %x", got, netBindServiceCap)
	}
	if hdr.Mode != 0o755 {
		t.Errorf("coredns's mode = %o, want 755", hdr.Mode)
	}
}

// layerEntry is the header of file name in the archive's (only) layer.
func layerEntry(t *testing.T, archive, name string) *tar.Header {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	outer := tar.NewReader(f)
	for {
		hdr, err := outer.Next()
		if err != nil {
			t.Fatalf("no layer in %s: %v", archive, err)
		}
		if !strings.HasSuffix(hdr.Name, "/layer.tar") {
			continue
		}
		inner := tar.NewReader(outer)
		for {
			h, err := inner.Next()
			if err != nil {
				t.Fatalf("no %s in the layer of %s: %v", name, archive, err)
			}
			if h.Name == name {
				return h
			}
		}
	}
}

// TestBuildContextKeyFollowsDockerignore: the kpipe image is rebuilt when a
// file its build context holds changes (tracked or not), and not for one
// .dockerignore leaves out.
func TestBuildContextKeyFollowsDockerignore(t *testing.T) {
	root := t.TempDir()
	real, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	ignore, err := os.ReadFile(filepath.Join(real, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, content string) {
		t.Helper()
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(".dockerignore", string(ignore))
	write("go.mod", "module x\n")
	write("cmd/kpipe/main.go", "package main\n")
	write("cmd/kpipe/main_test.go", "package main\n")
	write("e2e/testbed/build.go", "package testbed\n")
	write("README.md", "x\n")
	write("deploy/iptables-wrapper.sh", "#!/bin/sh\n")
	for _, args := range [][]string{{"init", "-q"}, {"add", "."}} {
		if _, err := testbed.Run(append([]string{"git", "-C", root}, args...)...); err != nil {
			t.Fatal(err)
		}
	}
	base := contextKey(t, root)

	for _, name := range []string{"cmd/kpipe/main_test.go", "e2e/testbed/build.go", "README.md", "e2e/new_untracked.go"} {
		write(name, "changed\n")
		if got := contextKey(t, root); got != base {
			t.Errorf("changing %s (left out by .dockerignore) changed the key", name)
		}
	}
	for _, name := range []string{"cmd/kpipe/main.go", "deploy/iptables-wrapper.sh", "stages/new_untracked.go"} {
		write(name, "changed "+name+"\n")
		got := contextKey(t, root)
		if got == base {
			t.Errorf("changing %s (in the build context) left the key %s", name, got)
		}
		base = got
	}
	if err := os.Chmod(filepath.Join(root, "deploy/iptables-wrapper.sh"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got := contextKey(t, root); got == base {
		t.Errorf("making deploy/iptables-wrapper.sh executable left the key")
	}
}

func contextKey(t *testing.T, root string) string {
	t.Helper()
	k, err := buildContextKey(root)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestPauseImageImportsAndRuns: the scratch archive writer's pause image
// imports into a real containerd under its name, and /pause runs until
// SIGTERM, then exits 0.
func TestPauseImageImportsAndRuns(t *testing.T) {
	ctrd := startContainerd(t)
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b := &builder{o: ImageOptions{Root: root, Cache: t.TempDir(), Logf: t.Logf}, ctx: context.Background()}
	pause, err := b.pause()
	if err != nil {
		t.Fatal(err)
	}
	ctrd.importImage(t, pause)

	id := ctrd.newID()
	run := exec.Command("ctr", ctrd.args("run", "--rm", "--runc-root", ctrd.runcRoot, pause.Ref, id)...)
	var out bytes.Buffer
	run.Stdout, run.Stderr = &out, &out
	if err := run.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- run.Wait() }()
	if err := testbed.Poll(30*time.Second, 200*time.Millisecond, func() error {
		if st := ctrd.taskStatus(t, id); st != "RUNNING" {
			return fmt.Errorf("task %s is %q", id, st)
		}
		return nil
	}); err != nil {
		t.Fatalf("pause never ran: %v; ctr run: %s", err, out.String())
	}
	// It keeps running: still there a while later.
	time.Sleep(time.Second)
	if st := ctrd.taskStatus(t, id); st != "RUNNING" {
		t.Fatalf("pause stopped by itself: %q; ctr run: %s", st, out.String())
	}
	ctrd.ctr(t, "task", "kill", "-s", "SIGTERM", id)
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("pause after SIGTERM: %v (want exit 0); ctr run: %s", err, out.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("pause did not exit on SIGTERM; ctr run: %s", out.String())
	}
}

// TestBuiltImagesRun builds every image (minutes on a cold cache) and runs
// each in a real containerd: CoreDNS answers on port 53 as nonroot,
// kube-proxy's image has both iptables backends behind the wrapper, kpipe's
// kube-proxy path prints its stamp. A second BuildImages builds nothing.
func TestBuiltImagesRun(t *testing.T) {
	if testing.Short() || SmokeOnly() {
		t.Skip("builds every image (minutes on a cold cache)")
	}
	ctrd := startContainerd(t)
	o := imageOptionsForTest(t)
	ctx := context.Background()
	im, err := BuildImages(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	for _, img := range im.All() {
		ctrd.importImage(t, img)
	}

	t.Run("warm run builds nothing", func(t *testing.T) {
		before := archiveTimes(t, im)
		again, err := BuildImages(ctx, o)
		if err != nil {
			t.Fatal(err)
		}
		if again != im {
			t.Errorf("second BuildImages = %+v, first %+v", again, im)
		}
		if after := archiveTimes(t, again); fmt.Sprint(after) != fmt.Sprint(before) {
			t.Errorf("archives rewritten: %v, then %v", before, after)
		}
	})

	t.Run("coredns answers on 53 as nonroot", func(t *testing.T) {
		// No Corefile: CoreDNS serves its default, whoami on .:53.
		id := ctrd.newID()
		ctrd.ctr(t, "run", "-d", "--runc-root", ctrd.runcRoot, im.CoreDNS.Ref, id)
		t.Cleanup(func() { ctrd.stopTask(t, id) })
		pid := ctrd.taskPID(t, id)
		var answer []byte
		err := testbed.Poll(30*time.Second, 300*time.Millisecond, func() error {
			return testbed.InNetNSPath(fmt.Sprintf("/proc/%d/ns/net", pid), func() (err error) {
				answer, err = queryDNS("127.0.0.1:53", "whoami.example.")
				return err
			})
		})
		if err != nil {
			t.Fatalf("no DNS answer from CoreDNS (task %s): %v", ctrd.taskStatus(t, id), err)
		}
		if rcode := answer[3] & 0x0f; rcode != 0 {
			t.Errorf("CoreDNS answered rcode %d, want 0", rcode)
		}
		uid := procUID(t, pid)
		if uid != "65532" {
			t.Errorf("CoreDNS runs as uid %s, want 65532 (nonroot)", uid)
		}
	})

	t.Run("kube-proxy image", func(t *testing.T) {
		hostVersion, err := exec.Command(o.KubeProxy, "--version").Output()
		if err != nil {
			t.Fatal(err)
		}
		sum, err := fileSHA256(o.KubeProxy)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			argv []string
			want string
		}{
			// The very binary given, which runs there.
			{[]string{"sha256sum", "/usr/local/bin/kube-proxy"}, sum},
			{[]string{"/usr/local/bin/kube-proxy", "--version"}, strings.TrimSpace(string(hostVersion))},
			{[]string{"xtables-legacy-multi", "iptables", "-V"}, "(legacy)"},
			{[]string{"xtables-nft-multi", "iptables", "-V"}, "(nf_tables)"},
			{[]string{"xtables-nft-multi", "ip6tables", "-V"}, "(nf_tables)"},
			// Through the wrapper: in a new network namespace with no rules,
			// it picks nft.
			{[]string{"iptables", "-V"}, "(nf_tables)"},
			{[]string{"nft", "--version"}, "nftables v"},
			{[]string{"conntrack", "--version"}, "conntrack"},
			{[]string{"ip", "-V"}, "iproute2"},
		} {
			out := ctrd.runOnce(t, im.KubeProxy.Ref, c.argv...)
			if !strings.Contains(out, c.want) {
				t.Errorf("%s: %q, want %q in it", strings.Join(c.argv, " "), out, c.want)
			}
		}
	})

	t.Run("kpipe image prints its stamp", func(t *testing.T) {
		tag := im.Kpipe.Ref[strings.LastIndex(im.Kpipe.Ref, ":")+1:]
		out := ctrd.runOnce(t, im.Kpipe.Ref, "/usr/local/bin/kube-proxy", "--version")
		if !strings.HasPrefix(out, "kpipe "+tag+" ") {
			t.Errorf("kube-proxy --version in %s: %q, want \"kpipe %s ...\"", im.Kpipe.Ref, out, tag)
		}
	})

	t.Run("kpc-tools has its programs", func(t *testing.T) {
		out := ctrd.runOnce(t, im.Tools.Ref, "/echoserver", "-h")
		if !strings.Contains(out, "Usage") {
			t.Errorf("/echoserver -h: %q", out)
		}
	})
}

// imageOptionsForTest uses the e2e caches: the kube-proxy the test bed
// builds, the image cache beside it ($KPIPE_E2E_IMAGES overrides).
func imageOptionsForTest(t *testing.T) ImageOptions {
	t.Helper()
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bins, err := testbed.EnsureControlPlane(root, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	cache := os.Getenv("KPIPE_E2E_IMAGES")
	if cache == "" {
		cache = filepath.Join(filepath.Dir(testbed.CacheDir()), "images")
	}
	return ImageOptions{Root: root, Cache: cache, KubeProxy: bins.KubeProxy, Logf: t.Logf}
}

func archiveTimes(t *testing.T, im Images) []time.Time {
	var times []time.Time
	for _, img := range im.All() {
		st, err := os.Stat(img.Archive)
		if err != nil {
			t.Fatal(err)
		}
		times = append(times, st.ModTime())
	}
	return times
}

// queryDNS sends one A query for name and returns the answer.
func queryDNS(server, name string) ([]byte, error) {
	conn, err := net.Dial("udp", server)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	q := []byte{0x4b, 0x50, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0} // id, RD, one question
	for _, label := range strings.Split(strings.TrimSuffix(name, "."), ".") {
		q = append(append(q, byte(len(label))), label...)
	}
	q = append(q, 0, 0, 1, 0, 1) // root, type A, class IN
	if _, err := conn.Write(q); err != nil {
		return nil, err
	}
	_ = conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 1500)
	n, err := conn.Read(buf)
	if err != nil {
		return nil, err
	}
	if n < 12 || binary.BigEndian.Uint16(buf) != 0x4b50 || buf[2]&0x80 == 0 {
		return nil, fmt.Errorf("not an answer to the query: %x", buf[:n])
	}
	return buf[:n], nil
}

func procUID(t *testing.T, pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == "Uid:" {
			return f[1]
		}
	}
	t.Fatalf("no Uid in /proc/%d/status", pid)
	return ""
}

// --- a containerd of the test's own ---

type testContainerd struct {
	dir, sock, runcRoot string
	ids                 atomic.Int32
}

// startContainerd runs Debian's containerd with its own root, state and
// sockets in a temporary directory (not the host's /var/lib/containerd or
// /run/containerd), and stops it when the test ends.
func startContainerd(t *testing.T) *testContainerd {
	t.Helper()
	netnstest.RequireRoot(t)
	for _, bin := range []string{"containerd", "ctr", "runc"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("no %s: %v", bin, err)
		}
	}
	dir, err := os.MkdirTemp("", "kpc-ctrd-")
	if err != nil {
		t.Fatal(err)
	}
	c := &testContainerd{dir: dir, sock: filepath.Join(dir, "c.sock"), runcRoot: filepath.Join(dir, "runc")}
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = %q
[ttrpc]
  address = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), c.sock, c.sock+".ttrpc")
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	// containerd 1.6 puts its shims' sockets under /run/containerd/s whatever
	// its config says: remove that directory afterwards if this test made it.
	_, err = os.Stat("/run/containerd")
	madeRun := os.IsNotExist(err)
	cmd := exec.Command("containerd", "--config", filepath.Join(dir, "config.toml"))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		logf.Close()
		removeRootfs(dir) // unmounts what containerd left mounted under it
		// `ctr run` puts a task's cgroup under /k8s.io (the namespace) in
		// every hierarchy; runc removes the task's own, not that parent.
		parents, _ := filepath.Glob("/sys/fs/cgroup/*/k8s.io")
		for _, p := range parents {
			_ = syscall.Rmdir(p) // fails, harmlessly, while not empty
		}
		if madeRun {
			_ = os.RemoveAll("/run/containerd")
		}
	})
	if err := testbed.Poll(30*time.Second, 200*time.Millisecond, func() error {
		_, err := exec.Command("ctr", c.args("version")...).CombinedOutput()
		return err
	}); err != nil {
		b, _ := os.ReadFile(filepath.Join(dir, "containerd.log"))
		t.Fatalf("containerd did not start: %v\n%s", err, b)
	}
	return c
}

func (c *testContainerd) args(args ...string) []string {
	return append([]string{"--address", c.sock, "-n", "k8s.io"}, args...)
}

func (c *testContainerd) ctr(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("ctr", c.args(args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func (c *testContainerd) newID() string {
	return fmt.Sprintf("kpc-images-%d", c.ids.Add(1))
}

// importImage imports img's archive and checks containerd lists it by Ref.
func (c *testContainerd) importImage(t *testing.T, img Image) {
	t.Helper()
	c.ctr(t, "images", "import", img.Archive)
	for _, ref := range strings.Fields(c.ctr(t, "images", "ls", "-q")) {
		if ref == img.Ref {
			return
		}
	}
	t.Fatalf("%s imported, but containerd has no %s: %s", img.Archive, img.Ref, c.ctr(t, "images", "ls", "-q"))
}

// runOnce runs argv in a new container of ref (its own network namespace,
// privileged as kube-proxy's pod is) and returns its output.
func (c *testContainerd) runOnce(t *testing.T, ref string, argv ...string) string {
	t.Helper()
	args := append([]string{"run", "--rm", "--privileged", "--runc-root", c.runcRoot, ref, c.newID()}, argv...)
	out, err := exec.Command("ctr", c.args(args...)...).CombinedOutput()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("ctr run %s: %v", strings.Join(argv, " "), err)
	}
	return strings.TrimSpace(string(out))
}

// taskStatus is the task's STATUS in `ctr task ls`, "" when there is none.
func (c *testContainerd) taskStatus(t *testing.T, id string) string {
	if f := c.taskFields(t, id); f != nil {
		return f[2]
	}
	return ""
}

func (c *testContainerd) taskPID(t *testing.T, id string) int {
	t.Helper()
	var pid int
	if f := c.taskFields(t, id); f != nil {
		fmt.Sscan(f[1], &pid)
	}
	if pid == 0 {
		t.Fatalf("no task %s", id)
	}
	return pid
}

func (c *testContainerd) taskFields(t *testing.T, id string) []string {
	for _, line := range strings.Split(c.ctr(t, "task", "ls"), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == id {
			return f
		}
	}
	return nil
}

// stopTask kills a detached task and deletes it and its container.
func (c *testContainerd) stopTask(t *testing.T, id string) {
	_, _ = exec.Command("ctr", c.args("task", "kill", "-s", "SIGKILL", id)...).CombinedOutput()
	_ = testbed.Poll(10*time.Second, 200*time.Millisecond, func() error {
		if st := c.taskStatus(t, id); st != "STOPPED" && st != "" {
			return fmt.Errorf("%s", st)
		}
		return nil
	})
	_, _ = exec.Command("ctr", c.args("task", "delete", id)...).CombinedOutput()
	_, _ = exec.Command("ctr", c.args("containers", "delete", id)...).CombinedOutput()
}

func fileSHA256(name string) (string, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:]), nil
}
