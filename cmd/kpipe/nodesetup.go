package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
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
	cpus            func() int
}

var realNodeHost = nodeHost{sysctls: nf.HostSysctls, oomScoreAdjFile: "/proc/self/oom_score_adj", cpus: runtime.NumCPU}

// sysctlSetting is one sysctl node set-up writes.
type sysctlSetting struct{ name, value string }

// conntrackSysctls are the sysctls kube-proxy sets from its conntrack settings;
// a zero setting leaves its sysctl as it is.
func conntrackSysctls(c ConntrackOptions, cpus int) []sysctlSetting {
	var out []sysctlSetting
	if max := conntrackMax(c, cpus); max > 0 {
		out = append(out, sysctlSetting{"net/netfilter/nf_conntrack_max", strconv.Itoa(max)})
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

// conntrackMax is kube-proxy's nf_conntrack_max: maxPerCore times the cores, at
// least min; 0 (leave it) when maxPerCore is 0.
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
	for _, s := range conntrackSysctls(o.Conntrack, h.cpus()) {
		if err := h.sysctls.Write(s.name, s.value); err != nil {
			log.Warn("could not set a conntrack sysctl; going on without it", "sysctl", s.name, "value", s.value, "err", err)
			failed = append(failed, events.SetupFailure{Step: "SetSysctl/" + s.name, Note: fmt.Sprintf("could not set %s to %s: %v", s.name, s.value, err)})
			continue
		}
		log.Info("set conntrack sysctl", "sysctl", s.name, "value", s.value)
	}
	if err := os.WriteFile(h.oomScoreAdjFile, []byte(strconv.Itoa(int(o.OOMScoreAdj))), 0o644); err != nil {
		log.Warn("could not set the OOM score adjustment; going on without it", "oomScoreAdj", o.OOMScoreAdj, "err", err)
		failed = append(failed, events.SetupFailure{Step: "SetOOMScoreAdj", Note: fmt.Sprintf("could not set oom_score_adj to %d: %v", o.OOMScoreAdj, err)})
	}
	return failed
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
// mode (which are kpipe's too) in each family, and kube-proxy's nftables tables.
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
	if err := errors.Join(errs...); err != nil {
		log.Error("cleanup left rules behind", "err", err)
		return err
	}
	log.Info("cleanup done: no kube-proxy rules left")
	return nil
}
