package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render/tracer"
)

// explainFlags are `kpipe explain`'s flags.
type explainFlags struct {
	src, dst, proto, from, iface, rules string
	kubeconfig                          string
	nodeIPs                             []string
	json                                bool
}

// Where a packet comes from, as --from names it.
const (
	fromPod     = "pod"     // a pod on this node: routed in on its interface
	fromNode    = "node"    // a process on this node
	fromOutside = "outside" // another host: routed in on an interface
)

func explainCommand() *cobra.Command {
	var fl explainFlags
	cmd := &cobra.Command{
		Use:   "explain --dst IP:PORT [--src IP] [--proto tcp|udp|sctp] [--from pod|node|outside]",
		Short: "Say where a new connection's first packet goes through this node's rules, and why",
		Long: `explain follows the first packet of a new connection through the node's live nat
and filter rules (read with iptables-save; or through --rules FILE, such as
` + "`kpipe render`" + `'s output) as the kernel would: the chains it traverses with the
Service and port behind each rule, the endpoints it may be DNATed to with their
probabilities, whether it is masqueraded, or which rule rejects or drops it. It
reads rules written by kpipe or by kube-proxy's iptables mode, and never writes
anything. Other agents' rules it cannot evaluate are taken as not matching and
listed. Session affinity is traced as for a client seen for the first time.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := explain(cmd.Context(), fl, cmd.OutOrStdout()); err != nil {
				return fmt.Errorf("explain: %w", err)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&fl.dst, "dst", "", "The packet's destination, IP:PORT ([IPv6]:PORT): a ClusterIP, node, external or load-balancer address and port.")
	f.StringVar(&fl.src, "src", "", "The packet's source IP (required from a pod or from outside; from the node, the address the node's route to --dst gives).")
	f.StringVar(&fl.proto, "proto", "tcp", "The protocol: tcp, udp or sctp.")
	f.StringVar(&fl.from, "from", fromPod, "Where the packet enters: pod (a pod on this node), node (a process on this node) or outside (another host).")
	f.StringVar(&fl.iface, "in-interface", "", "The interface the packet arrives on, from a pod or from outside (default: the interface of this node's route to --src).")
	f.StringVar(&fl.rules, "rules", "", "Read the rules from this file (iptables-save's or `kpipe render`'s output) instead of the node's.")
	f.StringSliceVar(&fl.nodeIPs, "node-ip", nil, "More addresses of this node (addrtype LOCAL), besides its interfaces' (with --rules off the node).")
	f.StringVar(&fl.kubeconfig, "kubeconfig", "", "Ask the apiserver this kubeconfig reaches about the Services the rules name: their type, traffic policies and session affinity.")
	f.BoolVar(&fl.json, "json", false, "Print the explanation as JSON.")
	return cmd
}

// explain traces the packet fl describes and prints what happens to it.
func explain(ctx context.Context, fl explainFlags, out io.Writer) error {
	pkt, local, note, err := fl.packet()
	if err != nil {
		return err
	}
	family := bus.FamilyOf(pkt.Dest)
	rules, err := fl.readRules(ctx, family)
	if err != nil {
		return err
	}
	res := tracer.TraceRuleset(rules, local, pkt)
	if res.Err != nil {
		return res.Err
	}
	e := newExplanation(fl, pkt, note, res)
	if fl.kubeconfig != "" {
		if e.Objects, err = fl.lookUp(ctx, e.Services); err != nil {
			return err
		}
	}
	if fl.json {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(e)
	}
	_, err = out.Write([]byte(e.text()))
	return err
}

// lookUp asks the apiserver --kubeconfig reaches about the Services ports name.
func (fl explainFlags) lookUp(ctx context.Context, ports []string) ([]serviceFacts, error) {
	opts := defaultOptions()
	opts.Kubeconfig = fl.kubeconfig
	client, err := newClient(opts)
	if err != nil {
		return nil, err
	}
	return lookUpServices(ctx, client, ports)
}

// packet reads the flags into the traced packet, the node's LOCAL addresses
// and a note on what was found out rather than given.
func (fl explainFlags) packet() (p tracer.Packet, local []netip.Addr, note string, err error) {
	dst, err := parseDestination(fl.dst)
	if err != nil {
		return p, nil, "", err
	}
	p = tracer.Packet{Dest: dst.Addr().Unmap(), DPort: int(dst.Port()), Proto: strings.ToLower(fl.proto)}
	if !slices.Contains([]string{"tcp", "udp", "sctp"}, p.Proto) {
		return p, nil, "", fmt.Errorf("--proto %q: want tcp, udp or sctp", fl.proto)
	}
	for _, s := range fl.nodeIPs {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return p, nil, "", fmt.Errorf("--node-ip %q is not an IP address", s)
		}
		local = append(local, a.Unmap())
	}
	if addrs, err := nf.LocalAddrs(); err == nil {
		local = append(local, addrs...)
	}
	if fl.src != "" {
		if p.Source, err = netip.ParseAddr(fl.src); err != nil {
			return p, nil, "", fmt.Errorf("--src %q is not an IP address", fl.src)
		}
		p.Source = p.Source.Unmap()
	}
	switch fl.from {
	case fromNode:
		if fl.iface != "" {
			return p, nil, "", errors.New("--in-interface: a packet from the node itself comes in on no interface")
		}
		p.From = tracer.FromOutput
		if !p.Source.IsValid() {
			_, src, err := nf.RouteTo(p.Dest)
			if err != nil || !src.IsValid() {
				return p, nil, "", fmt.Errorf("--src not given, and this node's route to %s names no source address: give --src", p.Dest)
			}
			p.Source, note = src, "source "+src.String()+" from the node's route to "+p.Dest.String()
		}
	case fromPod, fromOutside:
		if !p.Source.IsValid() {
			return p, nil, "", fmt.Errorf("--src is required for a packet from %s", map[string]string{fromPod: "a pod", fromOutside: "outside"}[fl.from])
		}
		p.From, p.InInterface = tracer.FromPrerouting, fl.iface
		if p.InInterface == "" {
			iface, _, err := nf.RouteTo(p.Source)
			if err != nil {
				return p, nil, "", fmt.Errorf("--in-interface not given, and %v: give --in-interface", err)
			}
			p.InInterface, note = iface, "in on "+iface+", this node's route to "+p.Source.String()
		}
	default:
		return p, nil, "", fmt.Errorf("--from %q: want pod, node or outside", fl.from)
	}
	if bus.FamilyOf(p.Source) != bus.FamilyOf(p.Dest) {
		return p, nil, "", fmt.Errorf("source %s and destination %s are not of one IP family", p.Source, p.Dest)
	}
	return p, local, note, nil
}

// parseDestination reads --dst: IP:PORT, [IPv6]:PORT, the port in 1-65535.
func parseDestination(v string) (netip.AddrPort, error) {
	if v == "" {
		return netip.AddrPort{}, errors.New("--dst IP:PORT is required")
	}
	host, port, err := net.SplitHostPort(v)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("--dst %q is not IP:PORT ([IPv6]:PORT for IPv6)", v)
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("--dst %q: %q is not an IP address", v, host)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return netip.AddrPort{}, fmt.Errorf("--dst %q: port %q is out of range (1-65535)", v, port)
	}
	return netip.AddrPortFrom(addr, uint16(n)), nil
}

// readTimeout bounds reading the node's rules.
const readTimeout = 30 * time.Second

// readRules reads family's nat and filter tables: from --rules, or the node's.
func (fl explainFlags) readRules(ctx context.Context, family bus.Family) (*nf.Ruleset, error) {
	if fl.rules != "" {
		text, err := os.ReadFile(fl.rules)
		if err != nil {
			return nil, fmt.Errorf("read --rules: %w", err)
		}
		rs, err := nf.ParseRulesetOf(text, family)
		if err != nil {
			return nil, fmt.Errorf("--rules %s: %w", fl.rules, err)
		}
		return rs, nil
	}
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	if nf.NFTablesKubeProxyPresent(ctx, family) { // an answer from the iptables rules alone would be wrong
		return nil, fmt.Errorf("this node's %s Services are programmed in the nf_tables table kube-proxy (kube-proxy's nftables mode), which explain does not read: it reads iptables rules, kpipe's or kube-proxy's iptables mode's", family)
	}
	return nf.Tool{Family: family}.SavedRuleset(ctx)
}
