package testbed

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// RepoRoot finds the root of the kpipe module: $KPIPE_ROOT, else the nearest
// directory above the working directory whose go.mod declares
// github.com/kpipe/kpipe, else the one above this source file.
func RepoRoot() (string, error) {
	if r := os.Getenv("KPIPE_ROOT"); r != "" {
		return r, nil
	}
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if _, file, _, ok := runtime.Caller(0); ok {
		starts = append(starts, filepath.Dir(file))
	}
	for _, dir := range starts {
		for d := dir; ; d = filepath.Dir(d) {
			if isKpipeRoot(d) {
				return d, nil
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return "", errors.New("cannot find the kpipe repository root (set KPIPE_ROOT)")
}

func isKpipeRoot(dir string) bool {
	f, err := os.Open(filepath.Join(dir, "go.mod"))
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "module github.com/kpipe/kpipe" {
			return true
		}
	}
	return false
}

// GoCmd is `go args...` in dir, with env added to the environment. With
// ownModule set, dir is a module outside the repository's go.work
// (e2e/controlplane, e2e/cluster/coredns): it runs with GOWORK=off, and
// GOFLAGS minus any -modfile (which only ever applies to the module it was
// meant for).
func GoCmd(dir string, ownModule bool, env []string, args ...string) *exec.Cmd {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = os.Environ()
	if ownModule {
		cmd.Env = append(cmd.Env, "GOWORK=off")
		var kept []string
		for _, f := range strings.Fields(os.Getenv("GOFLAGS")) {
			if !strings.HasPrefix(f, "-modfile") {
				kept = append(kept, f)
			}
		}
		cmd.Env = append(cmd.Env, "GOFLAGS="+strings.Join(kept, " "))
	}
	cmd.Env = append(cmd.Env, env...)
	return cmd
}

// GoBuild runs `go build -o out pkgs...` in dir, as GoCmd does (env: e.g.
// CGO_ENABLED=0 for a static binary).
func GoBuild(dir string, ownModule bool, env []string, out string, pkgs ...string) error {
	cmd := GoCmd(dir, ownModule, env, append([]string{"build", "-o", out}, pkgs...)...)
	var outBuf strings.Builder
	cmd.Stdout = &outBuf
	cmd.Stderr = &outBuf
	if err := startCmd(cmd); err != nil {
		return fmt.Errorf("go build %s: %w", strings.Join(pkgs, " "), err)
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("go build %s (in %s): %w\n%s", strings.Join(pkgs, " "), dir, err, tailLines(outBuf.String(), 40))
	}
	return nil
}

// ControlPlaneBinaries are the paths of the kube-apiserver and etcd binaries,
// of upstream kube-proxy (same Kubernetes version) for the swap tests, and
// of the rest of a real cluster (e2e/cluster): kubelet, controller manager,
// scheduler, kubectl and kubeadm.
type ControlPlaneBinaries struct {
	Version           string // their Kubernetes release, e.g. v1.34.4
	APIServer         string
	Etcd              string
	KubeProxy         string
	Kubelet           string
	ControllerManager string
	Scheduler         string
	Kubectl           string
	Kubeadm           string
}

func (b ControlPlaneBinaries) complete() bool {
	for _, p := range []string{b.APIServer, b.Etcd, b.KubeProxy, b.Kubelet, b.ControllerManager, b.Scheduler, b.Kubectl, b.Kubeadm} {
		if !exists(p) {
			return false
		}
	}
	return true
}

// CacheDir is where built control-plane binaries are kept between runs:
// $KPIPE_E2E_CACHE, else $HOME/.cache/kpipe-e2e/bin.
func CacheDir() string {
	if d := os.Getenv("KPIPE_E2E_CACHE"); d != "" {
		return d
	}
	home, err := os.UserHomeDir()
	if err != nil {
		home = os.TempDir()
	}
	return filepath.Join(home, ".cache", "kpipe-e2e", "bin")
}

// EnsureControlPlane returns the kube-apiserver, etcd and kube-proxy binaries pinned by
// e2e/controlplane/go.mod, building them when the cache has none for this
// exact go.mod and go.sum. logf reports progress (building takes minutes).
func EnsureControlPlane(root string, logf func(string, ...any)) (ControlPlaneBinaries, error) {
	cpDir := filepath.Join(root, "e2e", "controlplane")
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum", filepath.Join("etcd", "main.go")} {
		b, err := os.ReadFile(filepath.Join(cpDir, f))
		if err != nil {
			return ControlPlaneBinaries{}, fmt.Errorf("hash control plane pins: %w", err)
		}
		h.Write([]byte(f))
		h.Write(b)
	}
	version, err := kubernetesVersion(filepath.Join(cpDir, "go.mod"))
	if err != nil {
		return ControlPlaneBinaries{}, err
	}
	stamp := versionStamp(version)
	h.Write([]byte(stamp))
	key := hex.EncodeToString(h.Sum(nil))[:16]
	dir := filepath.Join(CacheDir(), key)
	bins := ControlPlaneBinaries{
		Version:           version,
		APIServer:         filepath.Join(dir, "kube-apiserver"),
		Etcd:              filepath.Join(dir, "etcd"),
		KubeProxy:         filepath.Join(dir, "kube-proxy"),
		Kubelet:           filepath.Join(dir, "kubelet"),
		ControllerManager: filepath.Join(dir, "kube-controller-manager"),
		Scheduler:         filepath.Join(dir, "kube-scheduler"),
		Kubectl:           filepath.Join(dir, "kubectl"),
		Kubeadm:           filepath.Join(dir, "kubeadm"),
	}
	if bins.complete() {
		return bins, nil
	}
	if err := os.MkdirAll(CacheDir(), 0o755); err != nil {
		return bins, fmt.Errorf("create cache dir: %w", err)
	}
	// One builder at a time; the others wait and find the result.
	lock, err := os.OpenFile(filepath.Join(CacheDir(), ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return bins, fmt.Errorf("open build lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return bins, fmt.Errorf("take build lock: %w", err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
	if bins.complete() {
		return bins, nil
	}
	tmp, err := os.MkdirTemp(CacheDir(), key+".tmp-")
	if err != nil {
		return bins, fmt.Errorf("create build dir: %w", err)
	}
	defer os.RemoveAll(tmp)
	start := time.Now()
	logf("building etcd and Kubernetes' kube-apiserver, kube-proxy, kubelet, kube-controller-manager, kube-scheduler, kubectl and kubeadm into %s (first run on this machine: several minutes)", dir)
	pkgs := []string{"./etcd"}
	for _, cmd := range []string{"kube-apiserver", "kube-proxy", "kubelet", "kube-controller-manager", "kube-scheduler", "kubectl", "kubeadm"} {
		pkgs = append(pkgs, "k8s.io/kubernetes/cmd/"+cmd)
	}
	if err := GoBuild(cpDir, true, nil, tmp+string(filepath.Separator), append([]string{"-ldflags", stamp}, pkgs...)...); err != nil {
		return bins, err
	}
	_ = os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return bins, fmt.Errorf("install control plane binaries: %w", err)
	}
	logf("built control plane in %v", time.Since(start).Round(time.Second))
	return bins, nil
}

// kubernetesVersion is the version of k8s.io/kubernetes that go.mod requires.
func kubernetesVersion(goMod string) (string, error) {
	b, err := os.ReadFile(goMod)
	if err != nil {
		return "", fmt.Errorf("read control plane pins: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "k8s.io/kubernetes" {
			return f[1], nil
		}
	}
	return "", fmt.Errorf("%s requires no k8s.io/kubernetes", goMod)
}

// versionStamp is the linker flags Kubernetes' own build sets
// (hack/lib/version.sh), so that every binary reports its release (kubelet's
// Node status, the apiserver's /version, kubeadm's version checks) rather
// than v0.0.0-master.
func versionStamp(version string) string {
	major, minor, _ := strings.Cut(strings.TrimPrefix(version, "v"), ".")
	minor, _, _ = strings.Cut(minor, ".")
	var flags []string
	for _, pkg := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		flags = append(flags,
			"-X "+pkg+".gitVersion="+version,
			"-X "+pkg+".gitMajor="+major,
			"-X "+pkg+".gitMinor="+minor,
			"-X "+pkg+".gitTreeState=clean")
	}
	return strings.Join(flags, " ")
}

func exists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir()
}
