package netfilter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/kpipe/kpipe/bus"
)

// The chains of kube-proxy's ipvs mode that its iptables mode has not
// (pkg/proxy/ipvs, v1.34). kpipe never makes them; --cleanup deletes them.
const (
	ipvsChainNodePort        = "KUBE-NODE-PORT"
	ipvsChainLoadBalancer    = "KUBE-LOAD-BALANCER"
	ipvsChainSourceRangesFW  = "KUBE-SOURCE-RANGES-FIREWALL"
	ipvsChainAccessFilter    = "KUBE-IPVS-FILTER"
	ipvsChainOutAccessFilter = "KUBE-IPVS-OUT-FILTER"
)

// fixedChains are, per table, the fixed chains kube-proxy's iptables and ipvs
// modes (and kpipe) create and that kube-proxy's --cleanup deletes.
// KUBE-FIREWALL is not among them: kubelet owns one of that name too, so
// kube-proxy leaves it.
var fixedChains = map[string][]string{
	TableNAT: {ChainServices, ChainNodePorts, ChainPostrouting, ChainMarkMasq, ChainCanary,
		ipvsChainNodePort, ipvsChainLoadBalancer},
	TableFilter: {ChainServices, ChainExternalServices, ChainForward, ChainNodePorts, ChainProxyFirewall, ChainCanary,
		ipvsChainNodePort, ipvsChainSourceRangesFW, ipvsChainAccessFilter, ipvsChainOutAccessFilter},
	TableMangle: {ChainCanary},
}

// ipvsJumps are the jumps of kube-proxy's ipvs mode (iptablesJumpChain) that
// are not among its iptables mode's (Jumps): its nat jumps and its FORWARD
// jump to KUBE-FORWARD are the same rules.
var ipvsJumps = []Jump{
	{TableFilter, "INPUT", ipvsChainNodePort, "kubernetes health check rules", nil},
	{TableFilter, "INPUT", ChainProxyFirewall, "kube-proxy firewall rules", nil},
	{TableFilter, "FORWARD", ChainProxyFirewall, "kube-proxy firewall rules", nil},
	{TableFilter, "INPUT", ipvsChainAccessFilter, "kubernetes ipvs access filter", nil},
	{TableFilter, "OUTPUT", ipvsChainOutAccessFilter, "kubernetes ipvs access filter", nil},
}

// Cleanup removes what kube-proxy's iptables and ipvs modes and kpipe
// programmed in this family: the jumps from the built-in chains, then every
// chain they own (the fixed ones and the per-service and dispatch chains), each
// table in one iptables-restore --noflush. Nobody else's rules or chains are
// touched. It goes on past a failure and returns all errors.
func (t Tool) Cleanup(ctx context.Context) error {
	var errs []error
	existing := map[string]map[string]bool{}
	for _, table := range []string{TableNAT, TableFilter, TableMangle} {
		names, err := t.ChainNames(ctx, table)
		if err != nil {
			errs = append(errs, fmt.Errorf("list chains of %s: %w", table, err))
			continue
		}
		existing[table] = map[string]bool{}
		for _, n := range names {
			existing[table][n] = true
		}
	}
	for _, j := range append(Jumps(false), ipvsJumps...) {
		if existing[j.Table][j.To] {
			errs = append(errs, t.deleteJump(ctx, j))
		}
	}
	for _, table := range []string{TableNAT, TableFilter, TableMangle} {
		if chains := ownedChains(table, existing[table]); len(chains) > 0 {
			if err := t.Restore(ctx, deletePayload(table, chains)); err != nil {
				errs = append(errs, fmt.Errorf("delete chains of %s: %w", table, err))
			}
		}
	}
	return errors.Join(errs...)
}

// deleteJump deletes j from its built-in chain; a jump that is not there is fine.
func (t Tool) deleteJump(ctx context.Context, j Jump) error {
	_, err := t.iptables(ctx, append([]string{"-t", j.Table, "-D", j.From}, j.spec()...)...)
	if err == nil || notThere(err) {
		return nil
	}
	return fmt.Errorf("delete jump %s/%s -> %s: %w", j.Table, j.From, j.To, err)
}

// ownedChains are the chains of table that Cleanup deletes, of those that exist.
func ownedChains(table string, existing map[string]bool) []string {
	var chains []string
	for _, c := range fixedChains[table] {
		if existing[c] {
			chains = append(chains, c)
		}
	}
	for c := range existing {
		if KindOf(c).Disposable() {
			chains = append(chains, c)
		}
	}
	return chains
}

// deletePayload flushes chains (declaring them) and then deletes them, so that
// chains jumping to each other go in one transaction.
func deletePayload(table string, chains []string) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "*%s\n", table)
	for _, c := range chains {
		fmt.Fprintf(&b, ":%s - [0:0]\n", c)
	}
	for _, c := range chains {
		fmt.Fprintf(&b, "-X %s\n", c)
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}

// nftBinary is the nft command line tool; a variable so tests can point it at a
// missing binary.
var nftBinary = "nft"

// nftWait bounds one run of nft.
const nftWait = 10 * time.Second

// NFTablesTable is the nf_tables table kube-proxy's nftables mode programs
// Services in, in both families ("ip kube-proxy", "ip6 kube-proxy").
const NFTablesTable = "kube-proxy"

// NFTFamily is f as nft names it: "ip" or "ip6".
func NFTFamily(f bus.Family) string {
	if f == bus.IPv6 {
		return "ip6"
	}
	return "ip"
}

// DeleteNFTablesKubeProxy deletes the nf_tables tables kube-proxy's nftables mode
// creates, if they exist, so a node that ran kube-proxy in nftables mode can
// switch to the iptables mode. It deletes nothing else. With no nft installed
// there is nothing it could have made.
func DeleteNFTablesKubeProxy(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, nftWait)
	defer cancel()
	var errs []error
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		if !NFTablesKubeProxyPresent(ctx, f) {
			continue // not there (or no nf_tables, or no nft, at all)
		}
		if _, err := runNFT(ctx, "delete", "table", NFTFamily(f), NFTablesTable); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// NFTablesKubeProxyPresent says whether family has NFTablesTable; false
// without nft, which kube-proxy's nftables mode cannot run without.
func NFTablesKubeProxyPresent(ctx context.Context, family bus.Family) bool {
	if _, err := exec.LookPath(nftBinary); err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, nftWait)
	defer cancel()
	_, err := runNFT(ctx, "list", "table", NFTFamily(family), NFTablesTable)
	return err == nil
}

func runNFT(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, nftBinary, args...)
	cmd.WaitDelay = time.Second
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("nft %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// IPVSDummyLink is the dummy link kube-proxy's ipvs mode puts service addresses on.
const IPVSDummyLink = "kube-ipvs0"

// ipvsIPSets are the ipsets kube-proxy's ipvs mode makes (pkg/proxy/ipvs,
// v1.34), by their IPv4 names.
var ipvsIPSets = []string{
	"KUBE-LOOP-BACK", "KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL",
	"KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-FW", "KUBE-LOAD-BALANCER-LOCAL",
	"KUBE-LOAD-BALANCER-SOURCE-IP", "KUBE-LOAD-BALANCER-SOURCE-CIDR",
	"KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-NODE-PORT-UDP", "KUBE-NODE-PORT-LOCAL-UDP",
	"KUBE-NODE-PORT-SCTP-HASH", "KUBE-NODE-PORT-LOCAL-SCTP-HASH", "KUBE-HEALTH-CHECK-NODE-PORT", "KUBE-IPVS-IPS",
}

// kubeProxyIPSets are kube-proxy's ipsets: the IPv4 names of ipvsIPSets and
// their IPv6 twins, whose "KUBE-" kube-proxy makes "KUBE-6-" and cuts to the
// kernel's 31 characters.
var kubeProxyIPSets = func() []string {
	names := slices.Clone(ipvsIPSets)
	for _, v4 := range ipvsIPSets {
		v6 := "KUBE-6-" + strings.TrimPrefix(v4, "KUBE-")
		names = append(names, v6[:min(len(v6), 31)])
	}
	return names
}()

// CleanupIPVS removes what kube-proxy's ipvs mode leaves in this network
// namespace besides its iptables rules, as kube-proxy's --cleanup does: the
// kube-ipvs0 dummy link and kube-proxy's ipsets, where they exist; nothing
// else. The ipsets go after the iptables rules (Tool.Cleanup), which refer to
// them: the kernel refuses to destroy a set a rule matches on. kube-proxy also
// flushes every IPVS virtual server; kpipe has no IPVS client and leaves them.
func CleanupIPVS() error {
	return errors.Join(removeIPVSLink(netlinkLinks{}), destroyKubeProxyIPSets())
}

// links is what removeIPVSLink needs of netlink; tests fake it.
type links interface {
	LinkByName(name string) (netlink.Link, error)
	LinkDel(link netlink.Link) error
}

type netlinkLinks struct{}

func (netlinkLinks) LinkByName(name string) (netlink.Link, error) { return netlink.LinkByName(name) }
func (netlinkLinks) LinkDel(link netlink.Link) error              { return netlink.LinkDel(link) }

// removeIPVSLink deletes kube-ipvs0 if it is there and a dummy link. One of
// another type is not kube-proxy's: it stays, and that is an error, as in
// kube-proxy.
func removeIPVSLink(l links) error {
	link, err := l.LinkByName(IPVSDummyLink)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("look up %s: %w", IPVSDummyLink, err)
	}
	if link.Type() != "dummy" {
		return fmt.Errorf("%s is a %s link, not kube-proxy's dummy: left alone", IPVSDummyLink, link.Type())
	}
	if err := l.LinkDel(link); err != nil {
		return fmt.Errorf("delete %s: %w", IPVSDummyLink, err)
	}
	return nil
}

// ipsetModule is there when the kernel has ipsets; without, none can exist.
const ipsetModule = "/sys/module/ip_set"

// destroyKubeProxyIPSets destroys those of kube-proxy's ipsets that exist.
func destroyKubeProxyIPSets() error {
	if _, err := os.Stat(ipsetModule); err != nil {
		return nil
	}
	// Each by name, as kube-proxy does: listing them all would read every
	// member of every set on the node (a CNI's may hold thousands).
	var errs []error
	for _, name := range kubeProxyIPSets {
		if err := netlink.IpsetDestroy(name); err != nil && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("destroy ipset %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}
