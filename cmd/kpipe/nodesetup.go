package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/events"
)

// nodeHost is what node set-up writes to; tests give it a temporary directory.
type nodeHost struct {
	sysctls nf.Sysctls
	// oomScoreAdjFile is this process's oom_score_adj.
	oomScoreAdjFile string
	// hashsizeFile is the conntrack hash table's size, a module parameter.
	hashsizeFile string
	cpus         func() int
}

var realNodeHost = nodeHost{sysctls: nf.HostSysctls, oomScoreAdjFile: "/proc/self/oom_score_adj",
	hashsizeFile: "/sys/module/nf_conntrack/parameters/hashsize", cpus: func() int { return onlineCPUs("/sys/devices/system/cpu/online") }}

// countCPUList counts the CPUs of a kernel CPU list ("0-3,5": 5), the format
// of /sys/devices/system/cpu/online.
func countCPUList(list string) (int, error) {
	n := 0
	for _, part := range strings.Split(strings.TrimSpace(list), ",") {
		first, last, isRange := strings.Cut(part, "-")
		lo, err := strconv.Atoi(first)
		hi := lo
		if err == nil && isRange {
			hi, err = strconv.Atoi(last)
		}
		if err != nil || lo < 0 || hi < lo {
			return 0, fmt.Errorf("CPU list %q: bad element %q", list, part)
		}
		n += hi - lo + 1
	}
	return n, nil
}

// onlineCPUs counts the machine's online CPUs from file, as kube-proxy counts
// them from the CPU topology in /sys: not runtime.NumCPU, which is the process's
// affinity mask, one CPU for a proxy pinned to one (kubernetes#99225). Like
// kube-proxy, it falls back to runtime.NumCPU when /sys does not tell.
func onlineCPUs(file string) int {
	b, err := os.ReadFile(file)
	if err != nil {
		return runtime.NumCPU()
	}
	n, err := countCPUList(string(b))
	if err != nil || n < 1 {
		return runtime.NumCPU()
	}
	return n
}

// sysctlSetting is one sysctl node set-up writes.
type sysctlSetting struct{ name, value string }

const sysctlConntrackMax = "net/netfilter/nf_conntrack_max"

// conntrackSysctls are the sysctls kube-proxy sets from its conntrack settings
// (max: conntrackMax's); a zero setting leaves its sysctl as it is.
func conntrackSysctls(c ConntrackOptions, max int) []sysctlSetting {
	var out []sysctlSetting
	if max > 0 {
		out = append(out, sysctlSetting{sysctlConntrackMax, strconv.Itoa(max)})
	}
	seconds := func(name string, d time.Duration) {
		if d > 0 {
			out = append(out, sysctlSetting{name, strconv.Itoa(int(d / time.Second))})
		}
	}
	seconds("net/netfilter/nf_conntrack_tcp_timeout_established", c.TCPEstablishedTimeout)
	seconds("net/netfilter/nf_conntrack_tcp_timeout_close_wait", c.TCPCloseWaitTimeout)
	if c.TCPBeLiberal {
		out = append(out, sysctlSetting{"net/netfilter/nf_conntrack_tcp_be_liberal", "1"})
	}
	seconds("net/netfilter/nf_conntrack_udp_timeout", c.UDPTimeout)
	seconds("net/netfilter/nf_conntrack_udp_timeout_stream", c.UDPStreamTimeout)
	return out
}

// conntrackMax is kube-proxy's nf_conntrack_max: maxPerCore times the CPUs, at
// least min; 0 (leave it) when maxPerCore is 0. Written when it differs, as
// kube-proxy does: a larger value already set is lowered.
func conntrackMax(c ConntrackOptions, cpus int) int {
	if c.MaxPerCore <= 0 {
		return 0
	}
	return max(int(c.MaxPerCore)*cpus, int(c.Min))
}

// setUpNode does kube-proxy's node set-up: the conntrack sysctls and the
// process's OOM score. Each write that fails (a read-only /proc/sys in a
// container, a global sysctl seen from a network namespace) is a warning: the
// proxy works without them. It returns the failed writes, which the events
// stage records as Warnings once the client exists.
func setUpNode(o *Options, h nodeHost, log *slog.Logger) (failed []events.SetupFailure) {
	max, maxSet := conntrackMax(o.Conntrack, h.cpus()), false
	for _, s := range conntrackSysctls(o.Conntrack, max) {
		if f, ok := writeSysctl(h.sysctls, s, log); !ok {
			failed = append(failed, f)
			continue
		}
		maxSet = maxSet || s.name == sysctlConntrackMax
	}
	if maxSet {
		if err := raiseHashsize(h.hashsizeFile, max/4, log); err != nil {
			log.Warn("could not raise the conntrack hashsize; going on without it", "hashsize", max/4, "err", err)
			failed = append(failed, events.SetupFailure{Step: "SetConntrackHashsize", Note: fmt.Sprintf("could not raise the conntrack hashsize to %d: %v", max/4, err)})
		}
	}
	if err := os.WriteFile(h.oomScoreAdjFile, []byte(strconv.Itoa(int(o.OOMScoreAdj))), 0o644); err != nil {
		log.Warn("could not set the OOM score adjustment; going on without it", "oomScoreAdj", o.OOMScoreAdj, "err", err)
		failed = append(failed, events.SetupFailure{Step: "SetOOMScoreAdj", Note: fmt.Sprintf("could not set oom_score_adj to %d: %v", o.OOMScoreAdj, err)})
	}
	return failed
}

// writeSysctl writes one sysctl of node set-up; a failure is a warning and the
// step it returns (ok false).
func writeSysctl(sysctls nf.Sysctls, s sysctlSetting, log *slog.Logger) (failed events.SetupFailure, ok bool) {
	if err := sysctls.Write(s.name, s.value); err != nil {
		log.Warn("could not set a sysctl; going on without it", "sysctl", s.name, "value", s.value, "err", err)
		return events.SetupFailure{Step: "SetSysctl/" + s.name, Note: fmt.Sprintf("could not set %s to %s: %v", s.name, s.value, err)}, false
	}
	log.Info("set sysctl", "sysctl", s.name, "value", s.value)
	return events.SetupFailure{}, true
}

// raiseHashsize sets the conntrack hash table's size (file) to want if it is
// smaller, as kube-proxy does once nf_conntrack_max is set: a table sized for
// the old limit makes long bucket chains. A larger one is left (never lowered).
// The kernel refuses the write outside the host's network namespace.
func raiseHashsize(file string, want int, log *slog.Logger) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	cur, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	if cur >= want {
		return nil
	}
	if err := os.WriteFile(file, []byte(strconv.Itoa(want)), 0o644); err != nil {
		return err
	}
	log.Info("raised the conntrack hashsize", "from", cur, "to", want)
	return nil
}

const routeLocalnet = "net/ipv4/conf/all/route_localnet"

// initNode is --init-only's node set-up, what kube-proxy's iptables mode does
// before it would program rules: the conntrack sysctls (setUpNode) and, when
// IPv4 NodePorts answer on 127.0.0.1, route_localnet=1, which a daemon with
// CAP_NET_ADMIN alone cannot set later. That one is an error, as in kube-proxy.
// The daemon instead sets route_localnet only once the rule guarding
// 127.0.0.0/8 is in (commit).
func initNode(o *Options, h nodeHost, log *slog.Logger) error {
	setUpNode(o, h, log)
	if !o.localhostNodePortsOn(bus.IPv4) {
		return nil
	}
	if err := h.sysctls.Write(routeLocalnet, "1"); err != nil {
		return fmt.Errorf("NodePorts on 127.0.0.1 need route_localnet: %w", err)
	}
	log.Info("set route_localnet=1 for NodePorts on 127.0.0.1; to leave it alone, turn off iptables.localhostNodePorts or leave 127.0.0.1 out of nodePortAddresses")
	return nil
}

// removeNFTablesMode removes the tables of kube-proxy's nftables mode, as
// kube-proxy does when it starts in another mode, so the node can switch. Best
// effort: a failure is a warning.
func removeNFTablesMode(ctx context.Context, log *slog.Logger) {
	if err := nf.DeleteNFTablesKubeProxy(ctx); err != nil {
		log.Warn("could not remove kube-proxy's nftables tables", "err", err)
	}
}

// syncPoll is how often waitFullSyncs looks at the board.
const syncPoll = 50 * time.Millisecond

// waitFullSyncs waits until every family kpipe programs has committed a full
// sync (commit's entries on board) and says whether it did before ctx ended.
// kube-proxy's nftables mode removes the iptables-mode rules when it starts,
// so on a node it ran, its tables are all that proxies services until kpipe's
// rules are in: they are removed (deps.afterSync) only then.
func waitFullSyncs(ctx context.Context, board *bus.Board, families []bus.Family) bool {
	tick := time.NewTicker(syncPoll)
	defer tick.Stop()
	for !fullySynced(board.Read(), families) {
		select {
		case <-ctx.Done():
			return false
		case <-tick.C:
		}
	}
	return true
}

// fullySynced says whether every family's commit has reported a full sync.
func fullySynced(reports map[bus.StageName]bus.Report, families []bus.Family) bool {
	for _, f := range families {
		if reports[bus.Commit.Of(f)].LastFullSync.IsZero() {
			return false
		}
	}
	return true
}

// cleanup is --cleanup: it removes every rule and chain of kube-proxy's iptables
// mode (which are kpipe's too) in each family, kube-proxy's nftables tables, and
// its ipvs mode's kube-ipvs0 link and ipsets.
// Any failure makes it return an error (exit 1), after trying everything.
func cleanup(ctx context.Context, log *slog.Logger) error {
	var errs []error
	for _, f := range hostFamilies(log) {
		if err := (nf.Tool{Family: f}).Cleanup(ctx); err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", f, err))
		}
	}
	if err := nf.DeleteNFTablesKubeProxy(ctx); err != nil {
		errs = append(errs, err)
	}
	// After the iptables rules, which may refer to the ipsets.
	if err := nf.CleanupIPVS(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cleanup left rules behind: %w", err) // serve logs it
	}
	log.Info("cleanup done: no kube-proxy rules left")
	return nil
}
