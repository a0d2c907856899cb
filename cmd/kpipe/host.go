package main

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render"
)

// hostProbes are what the choice of IP families looks at; tests replace them.
type hostProbes struct {
	exists   func(path string) bool
	lookPath func(file string) (string, error)
	// listNAT lists a family's nat POSTROUTING (kube-proxy's Present check).
	listNAT func(f bus.Family) error
}

var realHost = hostProbes{
	exists:   func(path string) bool { _, err := os.Stat(path); return err == nil },
	lookPath: exec.LookPath,
	listNAT:  listNAT,
}

// natProbeWait bounds the nat probe (its iptables waits up to 5 s for the lock).
const natProbeWait = 10 * time.Second

// listNAT lists f's nat POSTROUTING, which reads the table and writes nothing.
func listNAT(f bus.Family) error {
	ctx, cancel := context.WithTimeout(context.Background(), natProbeWait)
	defer cancel()
	_, err := nf.Tool{Family: f}.ListChain(ctx, nf.TableNAT, "POSTROUTING")
	return err
}

// hostFamilies lists the IP families kpipe programs on this host.
func hostFamilies(log *slog.Logger) []bus.Family { return familiesOf(realHost, log) }

// familiesOf decides the families from what the host is, never from a failure
// that may pass: IPv4 always; IPv6 when the kernel has IPv6, ip6tables-restore is
// installed and the kernel has an IPv6 nat table (as kube-proxy, which runs a
// family only if its iptables can list nat POSTROUTING). Only a table the kernel
// cannot have (nf.ErrNoTable) leaves IPv6 out: a family whose tools fail
// otherwise (a held lock, a slow module load) is retried by the pipeline (and
// shows on /healthz); it is not switched off for the life of the process.
func familiesOf(p hostProbes, log *slog.Logger) []bus.Family {
	fams := []bus.Family{bus.IPv4}
	kernel := p.exists("/proc/net/if_inet6") || p.exists("/proc/sys/net/ipv6")
	_, toolErr := p.lookPath("ip6tables-restore")
	switch {
	case !kernel:
		log.Info("IPv6 off: the kernel has no IPv6 (no /proc/net/if_inet6 or /proc/sys/net/ipv6)")
	case toolErr != nil:
		log.Info("IPv6 off: ip6tables-restore is not installed", "err", toolErr)
	default:
		natErr := p.listNAT(bus.IPv6)
		if errors.Is(natErr, nf.ErrNoTable) {
			log.Warn("IPv6 off: the kernel has no IPv6 nat table; kpipe programs IPv4 alone", "err", natErr)
			break
		}
		if natErr != nil {
			log.Warn("ip6tables failed at start; IPv6 kept, its commits retry", "err", natErr)
		}
		fams = append(fams, bus.IPv6)
	}
	return fams
}

// registerFamilies reports on the metrics listener which families kpipe programs
// (1) and which the host left out (0). Not on /healthz: its body stays
// kube-proxy's, on a port every pod can reach.
func registerFamilies(reg prometheus.Registerer, programmed []bus.Family) {
	on := map[string]bool{}
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		on[f.String()] = slices.Contains(programmed, f)
	}
	reg.MustRegister(metrics.FamiliesProgrammed(on))
}

// hostFacts are what start-up learned about the host that render needs.
type hostFacts struct {
	// conntrackLiberal: conntrack is TCP-liberal (then INVALID packets are not dropped).
	conntrackLiberal bool
	// noRandomFully: that family's iptables cannot do MASQUERADE --random-fully.
	noRandomFully map[bus.Family]bool
	// nfacct: which of kube-proxy's nfacct objects exist (the rules count in them).
	nfacct render.NFAcctObjects
}

// prepareHost learns what render must know about the host, creating
// kube-proxy's nfacct objects where missing.
func prepareHost(log *slog.Logger) hostFacts { return readHost(ensureNFAcct(nf.NFAcct{}, log), log) }

// observeHost is prepareHost without writing anything: `kpipe render` renders
// with the nfacct objects the node has.
func observeHost(log *slog.Logger) hostFacts {
	exists := func(name string) bool { _, err := nf.NFAcct{}.Packets(name); return err == nil }
	return readHost(render.NFAcctObjects{InvalidDropped: exists(nf.NFAcctInvalidDropped),
		LocalhostNodePorts: exists(nf.NFAcctLocalhostNodePorts)}, log)
}

// readHost reads the host's facts, given which nfacct objects exist.
func readHost(nfacct render.NFAcctObjects, log *slog.Logger) hostFacts {
	// route_localnet is set by commit, once the rule that guards 127.0.0.0/8 is in.
	v, err := nf.ReadSysctl("net/netfilter/nf_conntrack_tcp_be_liberal")
	facts := hostFacts{conntrackLiberal: err == nil && v != "0", noRandomFully: map[bus.Family]bool{}}
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		if !nf.HasRandomFully(f) {
			facts.noRandomFully[f] = true
			log.Info("MASQUERADE without --random-fully: this iptables does not support it", "family", f)
		}
	}
	facts.nfacct = nfacct
	return facts
}

// nfacctCreator is what ensureNFAcct needs of netfilter.NFAcct; tests fake it.
type nfacctCreator interface{ Ensure(name string) error }

// ensureNFAcct creates kube-proxy's nfacct objects where missing, as kube-proxy
// does, and says which exist. A rule counts in one only if it exists (iptables
// refuses the rule otherwise); without it the rule is the same without counting,
// and its metric is absent.
func ensureNFAcct(a nfacctCreator, log *slog.Logger) render.NFAcctObjects {
	exists := func(name string) bool {
		if err := a.Ensure(name); err != nil {
			log.Warn("No nfacct counter: the rule counts nothing and its metric is absent", "counter", name, "err", err)
			return false
		}
		return true
	}
	return render.NFAcctObjects{
		InvalidDropped:     exists(nf.NFAcctInvalidDropped),
		LocalhostNodePorts: exists(nf.NFAcctLocalhostNodePorts),
	}
}
