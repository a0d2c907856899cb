package conntrack

import (
	"context"
	"fmt"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	ct "github.com/ti-mo/conntrack"
	"github.com/vishvananda/netlink"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// flow is a conntrack flow from client to dst, answered from answerer (the
// endpoint dst was translated to).
func flow(proto uint8, client, dst, answerer string) ct.Flow {
	c, d, a := netip.MustParseAddrPort(client), netip.MustParseAddrPort(dst), netip.MustParseAddrPort(answerer)
	f := ct.NewFlow(proto, 0, c.Addr(), d.Addr(), c.Port(), d.Port(), 120, 0)
	f.TupleReply.IP.SourceAddress = a.Addr()
	f.TupleReply.Proto.SourcePort = a.Port()
	if proto == syscall.IPPROTO_TCP {
		f.ProtoInfo.TCP = &ct.ProtoInfoTCP{State: 3} // established
	}
	return f
}

// counter is the value of one ip_family's series of a counter, as kube-proxy
// labels the conntrack reconciler's.
func counter(reg *prometheus.Registry, name, family string) float64 {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "ip_family" && l.GetValue() == family {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// The stage clears, in the kernel, the UDP flows to a service front-end that the
// rules no longer send to, and leaves every other flow alone.
func TestStageClearsStaleUDPFlows(t *testing.T) {
	netnstest.New(t).Run(t, func() error {
		conn, err := ct.Dial(nil)
		if err != nil {
			netnstest.Unavailable(t, fmt.Sprintf("conntrack netlink: %v", err))
		}
		defer conn.Close()
		// Loopback up: 127.0.0.1 is then this host's address, where node ports answer.
		lo, err := netlink.LinkByName("lo")
		if err == nil {
			err = netlink.LinkSetUp(lo)
		}
		if err != nil {
			netnstest.Unavailable(t, fmt.Sprintf("loopback: %v", err))
		}
		flows := map[string]ct.Flow{
			"current endpoint":  flow(syscall.IPPROTO_UDP, "10.0.0.1:40001", "10.96.0.10:53", "10.244.1.5:53"),
			"stale endpoint":    flow(syscall.IPPROTO_UDP, "10.0.0.2:40002", "10.96.0.10:53", "10.244.7.7:53"),
			"gone front-end":    flow(syscall.IPPROTO_UDP, "10.0.0.3:40003", "10.96.0.20:514", "10.244.8.8:514"),
			"unrelated":         flow(syscall.IPPROTO_UDP, "10.0.0.4:40004", "8.8.8.8:53", "8.8.8.8:53"),
			"TCP":               flow(syscall.IPPROTO_TCP, "10.0.0.5:40005", "10.96.0.10:53", "10.244.7.7:53"),
			"node port, stale":  flow(syscall.IPPROTO_UDP, "127.0.0.1:40006", "127.0.0.1:30053", "10.244.7.7:53"),
			"node port, ok":     flow(syscall.IPPROTO_UDP, "127.0.0.1:40007", "127.0.0.1:30053", "10.244.1.5:53"),
			"remote, same port": flow(syscall.IPPROTO_UDP, "10.0.0.8:40008", "8.8.4.4:30053", "8.8.4.4:30053"),
			"remote, gone port": flow(syscall.IPPROTO_UDP, "10.0.0.9:40009", "8.8.4.4:31000", "8.8.4.4:31000"),
			"node port, gone":   flow(syscall.IPPROTO_UDP, "127.0.0.1:40010", "127.0.0.1:31000", "10.244.8.8:80"),
		}
		for name, f := range flows {
			if err := conn.Create(f); err != nil {
				netnstest.Unavailable(t, fmt.Sprintf("cannot create a conntrack flow (%s): %v", name, err))
			}
		}

		in := bus.NewMergingMailbox(bus.MergeStaleFlows)
		in.Put(bus.StaleFlows{Family: bus.IPv4,
			Now: map[netip.AddrPort][]netip.AddrPort{
				netip.MustParseAddrPort("10.96.0.10:53"): {netip.MustParseAddrPort("10.244.1.5:53")},
				netip.MustParseAddrPort("0.0.0.0:30053"): {netip.MustParseAddrPort("10.244.1.5:53")},
			},
			Gone: map[netip.AddrPort]bool{netip.MustParseAddrPort("10.96.0.20:514"): true, netip.MustParseAddrPort("0.0.0.0:31000"): true}})
		reg := prometheus.NewRegistry()
		s := NewStage(Params{Family: bus.IPv4, In: in, Env: bus.Envs{Metrics: metrics.New(reg), Board: bus.NewBoard()}.For(bus.Conntrack.Of(bus.IPv4))})
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			deadline := time.Now().Add(5 * time.Second)
			for time.Now().Before(deadline) && counter(reg, "kubeproxy_conntrack_reconciler_deleted_entries_total", "IPv4") < 4 {
				time.Sleep(10 * time.Millisecond)
			}
			time.Sleep(50 * time.Millisecond) // let a wrong extra deletion show
			cancel()
		}()
		// Run on this thread: its netlink sockets open in this namespace.
		if err := s.Run(ctx); err != nil {
			t.Fatalf("Run = %v", err)
		}
		if n := counter(reg, "kubeproxy_conntrack_reconciler_deleted_entries_total", "IPv4"); n != 4 {
			t.Errorf("deleted entries metric = %v; want 4", n)
		}
		left, err := conn.Dump(nil)
		if err != nil {
			t.Fatal(err)
		}
		have := map[uint16]bool{} // by client port: each flow has its own
		for _, f := range left {
			have[f.TupleOrig.Proto.SourcePort] = true
		}
		for name, f := range flows {
			want := !map[string]bool{"stale endpoint": true, "gone front-end": true, "node port, stale": true, "node port, gone": true}[name]
			if got := have[f.TupleOrig.Proto.SourcePort]; got != want {
				t.Errorf("flow %q present = %v; want %v", name, got, want)
			}
		}
		if _, ok := in.TryTake(); ok {
			t.Error("the work is still in the mailbox after it was done")
		}
		return nil
	})
}
