package cluster

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// startDaemon starts argv in the node's network namespace, detached (its own
// session, no parent to die with), its output in Dir/logs/name.log and its
// PID in Dir/run/name.pid, so that it outlives `go tool task cluster` and
// Down finds it.
func startDaemon(name string, env []string, argv ...string) (int, error) {
	for _, d := range []string{inDir("logs"), inDir("run")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return 0, err
		}
	}
	log, err := os.OpenFile(inDir("logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, err
	}
	defer log.Close()
	full := append([]string{"nsenter", "--net=/run/netns/" + NodeNS, "--"}, argv...)
	cmd := exec.Command(full[0], full[1:]...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("start %s: %w", name, err)
	}
	pid := cmd.Process.Pid
	_ = cmd.Process.Release()
	if err := os.WriteFile(inDir("run", name+".pid"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		return pid, err
	}
	return pid, nil
}

// daemonPID is the recorded PID of name if that process still runs.
func daemonPID(name string) (int, bool) {
	b, err := os.ReadFile(inDir("run", name+".pid"))
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, alive(pid)
}

func alive(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil {
		return false
	}
	// A zombie (ours, not yet reaped) is not running.
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z'
	}
	return true
}

// stopDaemon ends a recorded daemon: SIGTERM, then SIGKILL after grace.
func stopDaemon(name string, grace time.Duration) error {
	pid, ok := daemonPID(name)
	if ok {
		if err := stopPID(pid, grace); err != nil {
			return fmt.Errorf("stop %s: %w", name, err)
		}
	}
	if err := os.Remove(inDir("run", name+".pid")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

func stopPID(pid int, grace time.Duration) error {
	_ = syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(grace)
	for alive(pid) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if alive(pid) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		for i := 0; alive(pid) && i < 100; i++ {
			time.Sleep(50 * time.Millisecond)
		}
	}
	if alive(pid) {
		return fmt.Errorf("pid %d outlived SIGKILL", pid)
	}
	return nil
}

// shimPIDs are the containerd shims our containerd started: each has our
// containerd's socket in its argv (-address). They and their containers
// outlive containerd itself, so Down ends them after it.
func shimPIDs() []int {
	sock := containerdSocket()
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		argv := strings.Split(string(b), "\x00")
		if len(argv) == 0 || filepath.Base(argv[0]) != "containerd-shim-runc-v2" {
			continue
		}
		for i := 0; i+1 < len(argv); i++ {
			if argv[i] == "-address" && argv[i+1] == sock {
				pids = append(pids, pid)
			}
		}
	}
	sort.Ints(pids)
	return pids
}

// cgroupPIDs are the processes in the kubelet's cgroup root (the pods'
// containers), read from the pids hierarchy.
func cgroupPIDs() []int {
	var pids []int
	_ = filepath.WalkDir(filepath.Join("/sys/fs/cgroup/pids", cgroupRoot), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
			return nil
		}
		b, _ := os.ReadFile(p)
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

var nsidName = regexp.MustCompile(`iproute2 netns name: (\S+)\)`)

// podNetns are the network namespaces the node's namespace has a peer in:
// the pods' (containerd's cni-<uuid>), named by iproute2's list-id.
func podNetns() []string {
	out, err := exec.Command("ip", "-n", NodeNS, "netns", "list-id").Output()
	if err != nil {
		return nil
	}
	var names []string
	for _, m := range nsidName.FindAllStringSubmatch(string(out), -1) {
		if strings.HasPrefix(m[1], "cni-") {
			names = append(names, m[1])
		}
	}
	return names
}
