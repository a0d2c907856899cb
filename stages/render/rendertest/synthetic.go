// Package rendertest holds the synthetic clusters that render's, commit's and
// netfilter's tests and benchmarks render: test support, not part of kpipe.
package rendertest

import (
	"fmt"
	"math/rand/v2"
	"net/netip"

	"github.com/kpipe/kpipe/bus"
)

// Synthetic service CIDRs: kubeadm's default IPv4 range, and an IPv6 range of the
// same size (the largest the apiserver allows).
var (
	syntheticServiceCIDR4 = netip.MustParsePrefix("10.96.0.0/12")
	syntheticServiceCIDR6 = netip.MustParsePrefix("fd00:10:96::/108")
)

// SyntheticState is an IPv4 cluster of n services with eps endpoints each (two
// ports: TCP and UDP), none on this node: the shape the benchmarks measure.
func SyntheticState(n, eps int) bus.State { return SyntheticStateOf(bus.IPv4, n, eps) }

// SyntheticStateOf is SyntheticState in either family. ClusterIPs are spread at
// random over the service CIDR, as the apiserver allocates them (the same ones
// on every call), so service addresses fall in as many /24s as in a real cluster.
func SyntheticStateOf(family bus.Family, n, eps int) bus.State {
	st := bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}, Node: &bus.Node{Name: "bench-node"}}
	clusterIPs := randomAddrs(family, n)
	for i := range n {
		s := &bus.Service{ServiceKey: bus.ServiceKey{Namespace: fmt.Sprintf("ns%d", i%100), Name: fmt.Sprintf("svc%d", i)},
			ClusterIPs: []netip.Addr{clusterIPs[i]},
			Ports:      []bus.Port{{Name: "http", Protocol: bus.TCP, Port: 80}, {Name: "dns", Protocol: bus.UDP, Port: 53}}}
		sl := &bus.EndpointSlice{Service: s.ServiceKey, Name: s.Name + "-1", Family: family,
			Ports: []bus.EndpointPort{{Name: "http", Protocol: bus.TCP, Port: 8080}, {Name: "dns", Protocol: bus.UDP, Port: 5353}}}
		for j := range eps {
			sl.Items = append(sl.Items, bus.Endpoint{Addr: podAddr(family, i*eps+j), Ready: true, Serving: true, NodeName: "node-b"})
		}
		st.Services[s.ServiceKey] = s
		st.Slices[s.ServiceKey] = map[string]*bus.EndpointSlice{sl.Name: sl}
	}
	return st
}

// randomAddrs draws n distinct addresses of the family's service CIDR, leaving out
// its first and last, from a fixed seed. n must be smaller than the CIDR.
func randomAddrs(family bus.Family, n int) []netip.Addr {
	cidr := syntheticServiceCIDR4
	if family == bus.IPv6 {
		cidr = syntheticServiceCIDR6
	}
	size := uint64(1) << (cidr.Addr().BitLen() - cidr.Bits())
	rnd := rand.New(rand.NewPCG(96, 12))
	seen := map[uint64]bool{}
	out := make([]netip.Addr, 0, n)
	for len(out) < n {
		off := 1 + rnd.Uint64N(size-2)
		if seen[off] {
			continue
		}
		seen[off] = true
		out = append(out, addOffset(cidr.Addr(), off))
	}
	return out
}

// addOffset adds off (less than 2^32) to the low bits of a.
func addOffset(a netip.Addr, off uint64) netip.Addr {
	b := a.AsSlice()
	for i := len(b) - 1; i >= 0 && off > 0; i-- {
		sum := uint64(b[i]) + off&0xff
		b[i] = byte(sum)
		off = off>>8 + sum>>8
	}
	out, _ := netip.AddrFromSlice(b)
	return out
}

// podAddr is the k-th pod address: 10.128.0.0/9 or fd00:10:244::/64.
func podAddr(family bus.Family, k int) netip.Addr {
	if family == bus.IPv6 {
		return addOffset(netip.MustParseAddr("fd00:10:244::"), uint64(k))
	}
	return addOffset(netip.MustParseAddr("10.128.0.0"), uint64(k))
}
