package render

import (
	"fmt"
	"net/netip"

	"github.com/kpipe/kpipe/bus"
)

// SyntheticState is a cluster of n services with eps endpoints each (two ports:
// TCP and UDP), none on this node: the shape the benchmarks measure.
func SyntheticState(n, eps int) bus.State {
	st := bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}, Node: &bus.Node{Name: "bench-node"}}
	for i := range n {
		s := &bus.Service{ServiceKey: bus.ServiceKey{Namespace: fmt.Sprintf("ns%d", i%100), Name: fmt.Sprintf("svc%d", i)},
			ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})},
			Ports:      []bus.Port{{Name: "http", Protocol: bus.TCP, Port: 80}, {Name: "dns", Protocol: bus.UDP, Port: 53}}}
		sl := &bus.EndpointSlice{Service: s.ServiceKey, Name: s.Name + "-1", Family: bus.IPv4,
			Ports: []bus.EndpointPort{{Name: "http", Protocol: bus.TCP, Port: 8080}, {Name: "dns", Protocol: bus.UDP, Port: 5353}}}
		for j := range eps {
			k := i*eps + j
			sl.Items = append(sl.Items, bus.Endpoint{Addr: netip.AddrFrom4([4]byte{10, byte(128 + k>>16), byte(k >> 8), byte(k)}), Ready: true, Serving: true, NodeName: "node-b"})
		}
		st.Services[s.ServiceKey] = s
		st.Slices[s.ServiceKey] = map[string]*bus.EndpointSlice{sl.Name: sl}
	}
	return st
}
