package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// setUpNetwork makes the node's namespace and its links: eth0 (NodeIP)
// joined to the host's kpc0 (HostIP), the default route into a veth whose
// peer stays down, so that it drops what leaves (this kernel has no dummy
// links) (a real node has a default route; ClusterIPs
// reached from the node itself need one to be routed at all before
// kube-proxy's OUTPUT rules translate them), the host's route to the pods,
// and the forwarding and bridge-netfilter switches a kubeadm node sets.
func setUpNetwork() error {
	steps := [][]string{
		{"ip", "netns", "add", NodeNS},
		{"ip", "link", "add", hostLink, "type", "veth", "peer", "name", nodeLink, "netns", NodeNS},
		{"ip", "addr", "add", HostIP + "/24", "dev", hostLink},
		{"ip", "link", "set", hostLink, "up"},
		{"ip", "-n", NodeNS, "link", "set", "lo", "up"},
		{"ip", "-n", NodeNS, "addr", "add", NodeIP + "/24", "dev", nodeLink},
		{"ip", "-n", NodeNS, "link", "set", nodeLink, "up"},
		{"ip", "-n", NodeNS, "link", "add", dropLink, "type", "veth", "peer", "name", dropLink + "-peer"},
		{"ip", "-n", NodeNS, "link", "set", dropLink, "up"},
		{"ip", "-n", NodeNS, "route", "add", "default", "dev", dropLink},
		{"ip", "route", "add", NodePodCIDR, "via", NodeIP},
		{"ip", "netns", "exec", NodeNS, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1", "net.bridge.bridge-nf-call-ip6tables=1"},
	}
	for _, argv := range steps {
		if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(argv, " "), err, out)
		}
	}
	return nil
}

// tearDownNetwork deletes the node's namespace (its links and the pods'
// veths go with it), the host's route, and the pod namespaces the cluster's
// containerd left (it names them cni-<uuid> under /run/netns and recorded
// each in its state; only those recorded are deleted).
func tearDownNetwork(podNetns []string) []error {
	var errs []error
	_ = exec.Command("ip", "route", "del", NodePodCIDR, "via", NodeIP).Run()
	for _, ns := range podNetns {
		p := filepath.Join("/run/netns", ns)
		_ = syscall.Unmount(p, syscall.MNT_DETACH)
		if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			errs = append(errs, err)
		}
	}
	if _, err := os.Stat(filepath.Join("/run/netns", NodeNS)); err == nil {
		if out, err := exec.Command("ip", "netns", "del", NodeNS).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("ip netns del %s: %v: %s", NodeNS, err, out))
		}
	}
	// The veth's host end goes with its peer; a half-made one would not.
	_ = exec.Command("ip", "link", "del", hostLink).Run()
	return errs
}

// cgroupHierarchies are the cgroup v1 hierarchies mounted under
// /sys/fs/cgroup (this host's layout is v1 with a v2 "unified" beside it).
func cgroupHierarchies() ([]string, error) {
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return nil, err
	}
	var dirs []string
	for _, e := range entries {
		if e.IsDir() && e.Name() != "unified" {
			dirs = append(dirs, filepath.Join("/sys/fs/cgroup", e.Name()))
		}
	}
	return dirs, nil
}

// makeCgroupRoot creates the kubelet's cgroup root in every hierarchy
// (the kubelet checks that it exists); cpuset's is given its parent's CPUs
// and memory nodes, without which no task can join it.
func makeCgroupRoot() error {
	dirs, err := cgroupHierarchies()
	if err != nil {
		return err
	}
	for _, h := range dirs {
		d := filepath.Join(h, cgroupRoot)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
		if filepath.Base(h) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(h, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), v, 0o644); err != nil {
					return fmt.Errorf("cgroup %s/%s: %w", d, f, err)
				}
			}
		}
	}
	return nil
}

// removeCgroupRoot removes the kubelet's cgroup root and everything under
// it, deepest first (a cgroup directory goes only when it has no children
// and no tasks: run after every process of the cluster is gone).
func removeCgroupRoot() []error {
	dirs, err := cgroupHierarchies()
	if err != nil {
		return []error{err}
	}
	var errs []error
	for _, h := range dirs {
		root := filepath.Join(h, cgroupRoot)
		var all []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				all = append(all, p)
			}
			return nil
		})
		sort.Slice(all, func(i, j int) bool { return len(all[i]) > len(all[j]) })
		for _, d := range all {
			if err := syscall.Rmdir(d); err != nil && !os.IsNotExist(err) {
				errs = append(errs, fmt.Errorf("rmdir %s: %w", d, err))
			}
		}
	}
	return errs
}

// unmountUnder unmounts every mount point at or below dir, deepest first:
// the kubelet's volume mounts, containerd's container root filesystems and
// shm mounts.
func unmountUnder(dir string) []error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return []error{err}
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		p := unescapeMount(f[4])
		if p == dir || strings.HasPrefix(p, dir+"/") {
			points = append(points, p)
		}
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	var errs []error
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && err != syscall.EINVAL && err != syscall.ENOENT {
			errs = append(errs, fmt.Errorf("umount %s: %w", p, err))
		}
	}
	return errs
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// hostPaths are the host's paths outside Dir that the node writes to and
// that cannot be moved: the kubelet's pod logs and device-plugin directory,
// the CNI plugins' IP allocations and results, containerd's shim sockets,
// and /lib/modules, which kubeadm's kube-proxy DaemonSet mounts (this VM's
// kernel has its modules built in and no such directory).
var hostPaths = []string{"/lib/modules", "/var/log/pods", "/var/log/containers", "/var/lib/kubelet", "/var/lib/cni", "/run/containerd"}

// makeHostPaths creates the host paths that are missing and records them
// (Dir/made-paths), so that Down removes what the cluster made and nothing
// that was there before it.
func makeHostPaths() error {
	var made []string
	for _, p := range hostPaths {
		if _, err := os.Stat(p); os.IsNotExist(err) {
			if err := os.MkdirAll(p, 0o755); err != nil {
				return err
			}
			made = append(made, p)
		}
	}
	return os.WriteFile(inDir("made-paths"), []byte(strings.Join(made, "\n")), 0o644)
}

func removeHostPaths() []error {
	b, err := os.ReadFile(inDir("made-paths"))
	if err != nil {
		return nil
	}
	var errs []error
	for _, p := range strings.Fields(string(b)) {
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}
