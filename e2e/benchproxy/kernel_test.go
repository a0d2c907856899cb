package main

import (
	"context"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// TestProbeReadsUncommentedEndpoints: the probe reads the endpoints of a
// service chain whose rules carry no comments (kpipe over 1,000 endpoints)
// from its DNAT targets, over netlink as in iptables-save's text.
func TestProbeReadsUncommentedEndpoints(t *testing.T) {
	ns := netnstest.New(t)
	s := &benchService{svc: &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "svc1"}}}
	k := kernel{}
	chain := k.chain(s)
	rules := "*nat\n:" + chain + " - [0:0]\n" +
		"-A " + chain + " -m statistic --mode random --probability 0.5000000000 -p tcp -j DNAT --to-destination 10.244.1.2:8080\n" +
		"-A " + chain + " -p tcp -j DNAT --to-destination 10.244.3.4:8080\nCOMMIT\n"
	tool := netfilter.Tool{Family: bus.IPv4, Writer: netfilter.WriterNetlink}
	ns.Run(t, func() error { return tool.Prepare([]byte(rules))(context.Background()) })
	var listed [][]string
	ns.Run(t, func() (err error) {
		listed, err = tool.ChainExpressions(context.Background(), netfilter.TableNAT, chain)
		return err
	})
	want := []string{"10.244.1.2", "10.244.3.4"}
	if got := k.addresses(s, want, matchesAndVerdicts(listed)); !slices.Equal(got, want) {
		t.Errorf("over netlink: %v, want %v", got, want)
	}
	if got := k.addresses(s, want, rules); !slices.Equal(got, want) {
		t.Errorf("in iptables-save's text: %v, want %v", got, want)
	}
}
