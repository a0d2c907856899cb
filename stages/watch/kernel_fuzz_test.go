package watch

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/netfilter/writertest"
	"github.com/kpipe/kpipe/stages/render"
)

// FuzzWatchRenderKernel runs fuzzed API objects the whole way to the kernel:
// converted as watch converts them, next to a well-formed service, rendered
// into a full plan of each family, and fed to the real iptables-restore (and
// ip6tables-restore) in a throwaway network namespace, twice, as the first
// and every later sync write it. Every payload must be accepted; the plan must
// not depend on the order the objects came in, and must keep the well-formed
// service's rules. One namespace serves a fuzz worker; its tables are emptied
// between inputs.
func FuzzWatchRenderKernel(f *testing.F) {
	netnstest.RequireRoot(f)
	for _, tool := range []string{"iptables-restore", "ip6tables-restore"} {
		if _, err := exec.LookPath(tool); err != nil {
			netnstest.Unavailable(f, tool+" not installed (go tool task setup)")
		}
	}
	beds := map[bus.Family]*writertest.Bed{bus.IPv4: writertest.New(f, bus.IPv4), bus.IPv6: writertest.New(f, bus.IPv6)}
	fuzzObjects(f, func(t *testing.T, svc *corev1.Service, slices []*discoveryv1.EndpointSlice) {
		// Bound the chains (ports) and endpoint rules (ports × endpoints) so
		// an input takes well under a second; the conversion target and the
		// e2e tests cover the full sizes.
		const budget = 300
		ports := min(len(svc.Spec.Ports), 50)
		for _, sl := range slices {
			sl.Endpoints = sl.Endpoints[:min(len(sl.Endpoints), budget)]
			ports = min(ports, max(1, budget/max(1, len(sl.Endpoints))))
		}
		svc.Spec.Ports = svc.Spec.Ports[:ports]
		st := kernelState(svc, slices)
		reversed := kernelState(svc, reverse(slices))
		for _, fam := range []bus.Family{bus.IPv4, bus.IPv6} {
			cfg := kernelConfig(fam)
			plan := render.Render(cfg, &bus.Snapshot{State: st, Full: true})
			payload := assemble(plan)
			if again := assemble(render.Render(cfg, &bus.Snapshot{State: reversed, Full: true})); again != payload {
				t.Fatalf("%v: the plan depends on the order of the slices:\n--- one order\n%s\n--- the other\n%s", fam, payload, again)
			}
			if !strings.Contains(payload, `"fuzz/other:http cluster IP"`) {
				t.Fatalf("%v: the well-formed service has no rules:\n%s", fam, payload)
			}
			// Both writers, each into its own namespace, twice (the second
			// time over the first, as every later sync), must leave the same
			// rules: iptables-save byte for byte, the same expressions.
			bed := beds[fam]
			bed.Reset(t)
			for _, run := range []string{"first", "second"} {
				bed.Restore.Run(t, func() error {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					if err := (nf.Tool{Family: fam, Writer: nf.WriterRestore}).Restore(ctx, []byte(payload)); err != nil {
						return fmt.Errorf("%v: the kernel refused the %s restore: %w\n%s", fam, run, err, around(payload, err))
					}
					return nil
				})
				bed.Netlink.Run(t, func() error {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					if err := (nf.Tool{Family: fam}).RestoreNetlink(ctx, []byte(payload)); err != nil {
						return fmt.Errorf("%v: the netlink writer's %s write failed: %w", fam, run, err)
					}
					return nil
				})
				bed.RequireSame(t, fmt.Sprintf("%v, %s write", fam, run))
			}
		}
	})
}

// kernelState is the desired state watch would hand on: the fuzzed objects
// as converted, and a well-formed service with one endpoint per family.
func kernelState(svc *corev1.Service, in []*discoveryv1.EndpointSlice) bus.State {
	conv := Converter{NodeName: kernelNode}
	st := bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}, Node: &bus.Node{
		Name: kernelNode, Zone: "zone-a",
		Addrs:    []netip.Addr{netip.MustParseAddr("192.168.1.10"), netip.MustParseAddr("2001:db8::10")},
		PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24"), netip.MustParsePrefix("fd00:10:244:1::/64")},
	}}
	other := service("other", "10.96.200.1", nil)
	other.Namespace = "fuzz"
	other.Spec.ClusterIPs = append(other.Spec.ClusterIPs, "fd00:10:96::200:1")
	all := []*discoveryv1.EndpointSlice{slice("other-v4", "other", "10.244.2.2", nil), slice("other-v6", "other", "fd00:10:244:2::2", nil)}
	all[1].AddressType = discoveryv1.AddressTypeIPv6
	for _, sl := range all {
		sl.Namespace = "fuzz"
	}
	for _, s := range []*corev1.Service{other, svc} {
		if out, _ := conv.Service(s); out != nil {
			st.Services[out.ServiceKey] = out
		}
	}
	for _, s := range append(all, in...) {
		if out, _ := conv.Slice(s); out != nil {
			if st.Slices[out.Service] == nil {
				st.Slices[out.Service] = map[string]*bus.EndpointSlice{}
			}
			st.Slices[out.Service][out.Name] = out
		}
	}
	return st
}

const kernelNode = "node-a"

func kernelConfig(fam bus.Family) render.Config {
	cfg := render.Config{Family: fam, NodeName: kernelNode, MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR,
		ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}, LocalhostNodePorts: true}
	if fam == bus.IPv6 {
		cfg.ClusterCIDRs, cfg.LocalhostNodePorts = []netip.Prefix{netip.MustParsePrefix("fd00:10:244::/48")}, false
	}
	return cfg
}

func reverse[T any](s []T) []T {
	out := slices.Clone(s)
	slices.Reverse(out)
	return out
}

// assemble is the iptables-restore input of a whole plan, as a full sync
// writes it.
func assemble(p *bus.Plan) string {
	var b strings.Builder
	for _, tp := range p.Tables {
		if len(tp.Chains) > 0 {
			b.Write(nf.Assemble(tp.Table, tp.Chains, nil))
		}
	}
	return b.String()
}

var failedLine = regexp.MustCompile(`line (\d+) failed`)

// around shows the payload lines near the one iptables-restore says failed
// (the first lines when it names none), numbered.
func around(payload string, err error) string {
	lines := strings.Split(payload, "\n")
	from, to := 0, min(len(lines), 40)
	if m := failedLine.FindStringSubmatch(err.Error()); m != nil {
		n, _ := strconv.Atoi(m[1])
		from, to = max(0, n-5), min(len(lines), n+2)
	}
	var b strings.Builder
	for i := from; i < to; i++ {
		fmt.Fprintf(&b, "%5d %s\n", i+1, lines[i])
	}
	fmt.Fprintf(&b, "(%d lines in all)", len(lines))
	return b.String()
}
