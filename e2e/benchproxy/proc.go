package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's times (100 on Linux).
const clockTicks = 100

// proxyPID is the pid of the proxy binary bin started as pid: `ip netns exec`
// execs in place, so normally pid itself once the exec happened; a child of
// pid running bin otherwise (an ip that forks).
func proxyPID(pid int, bin string) (int, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); exe == bin {
			return pid, nil
		}
		children, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
		for _, f := range strings.Fields(string(children)) {
			child, _ := strconv.Atoi(f)
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", child)); exe == bin {
				return child, nil
			}
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("no process %s at or under pid %d", filepath.Base(bin), pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// usage is what the proxy process cost: its peak resident set (VmHWM) and its
// CPU time, with that of the children it waited for (iptables-restore, nft).
type usage struct {
	peakRSSKiB int
	cpu        time.Duration
}

func readUsage(pid int) (usage, error) {
	var u usage
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return u, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			u.peakRSSKiB, _ = strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
		}
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return u, err
	}
	// The fields after the command's ")": state is field 3, utime 14, stime
	// 15, cutime 16, cstime 17.
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 15 {
		return u, fmt.Errorf("short /proc/%d/stat: %q", pid, s)
	}
	var ticks int64
	for _, v := range f[11:15] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return u, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks += n
	}
	u.cpu = time.Duration(ticks) * time.Second / clockTicks
	return u, nil
}
