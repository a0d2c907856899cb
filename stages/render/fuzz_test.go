package render

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

// FuzzRender builds a small cluster from the fuzzer's bytes (services with every
// feature switched on or off, endpoints in every condition, both families) and
// checks what must hold for any input: the plan only jumps to chains it writes,
// every rule is one well-formed line, and the cached renderer agrees with a fresh one.
func FuzzRender(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	f.Add([]byte{255, 0, 255, 0, 17, 34, 51, 68, 85, 102, 119, 136, 153, 170})
	f.Fuzz(func(t *testing.T, data []byte) {
		st := fuzzState(data)
		for _, fam := range []bus.Family{bus.IPv4, bus.IPv6} {
			cfg := baseConfig()
			cfg.Family = fam
			if fam == bus.IPv6 {
				cfg.ClusterCIDRs, cfg.LocalhostNodePorts = []netip.Prefix{prefix("fd00:10:244::/48")}, false
			}
			p := Render(cfg, full(st))
			checkConsistent(t, p)
			for _, tp := range p.Tables {
				for _, c := range tp.Chains {
					if len(c.Rules) == 0 {
						continue
					}
					for _, line := range strings.Split(strings.TrimSuffix(string(c.Rules), "\n"), "\n") {
						if !strings.HasPrefix(line, "-A "+c.Name+" ") {
							t.Fatalf("chain %s holds a line for another chain: %q", c.Name, line)
						}
						if strings.Count(line, `"`)%2 != 0 {
							t.Fatalf("unbalanced quotes: %q", line)
						}
					}
				}
			}
			rr := NewRenderer(cfg)
			rr.Render(full(st))
			if g, w := payload(rr.Render(full(st))), payload(p); g != w {
				t.Fatalf("cached render differs:\n%s", diff(w, g))
			}
		}
	})
}

// fuzzState turns bytes into services and slices: each service takes 4 bytes of
// switches, each endpoint 1 byte of conditions.
func fuzzState(data []byte) bus.State {
	st := bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}, Node: node()}
	next := func() byte {
		if len(data) == 0 {
			return 0
		}
		b := data[0]
		data = data[1:]
		return b
	}
	for i := 0; len(data) > 0 && i < 8; i++ {
		a, b, c, d := next(), next(), next(), next()
		key := bus.ServiceKey{Namespace: "ns", Name: fmt.Sprintf("s%d", i)}
		s := &bus.Service{ServiceKey: key, ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 0, byte(i)})}}
		if a&1 != 0 {
			s.ClusterIPs = append(s.ClusterIPs, netip.AddrFrom16([16]byte{0xfd, 0, 0, 0x10, 0, 0x96, 15: byte(i)}))
		}
		protos := []bus.Protocol{bus.TCP, bus.UDP, bus.SCTP}
		for p := range int(b%3) + 1 {
			port := bus.Port{Name: fmt.Sprintf("p%d", p), Protocol: protos[(int(b)+p)%3], Port: int32(80 + p)}
			if a&2 != 0 {
				port.NodePort = int32(30000 + i*10 + p)
			}
			s.Ports = append(s.Ports, port)
		}
		if a&4 != 0 {
			s.ExternalIPs = []netip.Addr{netip.AddrFrom4([4]byte{203, 0, 113, byte(i)})}
		}
		if a&8 != 0 {
			s.LoadBalancerIPs = []netip.Addr{netip.AddrFrom4([4]byte{198, 51, 100, byte(i)}), netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(i)})}
		}
		if a&16 != 0 {
			s.LoadBalancerSourceRanges = []netip.Prefix{prefix("192.168.1.0/24"), prefix("2001:db8::/32")}
		}
		s.ExternalPolicyLocal, s.InternalPolicyLocal = a&32 != 0, a&64 != 0
		if a&128 != 0 {
			s.AffinitySeconds, s.HealthCheckNodePort = int32(c)+1, 32000+int32(i)
		}
		st.Services[key] = s
		for fam, famByte := range map[bus.Family]byte{bus.IPv4: c, bus.IPv6: d} {
			sl := &bus.EndpointSlice{Service: key, Name: fmt.Sprintf("%s-%v", key.Name, fam), Family: fam}
			for p := range int(b%3) + 1 {
				sl.Ports = append(sl.Ports, bus.EndpointPort{Name: fmt.Sprintf("p%d", p), Protocol: protos[(int(b)+p)%3], Port: int32(8080 + p)})
			}
			for j := range int(famByte % 5) {
				e := next()
				addr := netip.AddrFrom4([4]byte{10, 244, byte(i), byte(j)})
				if fam == bus.IPv6 {
					addr = netip.AddrFrom16([16]byte{0xfd, 0, 0, 0x10, 0x02, 0x44, 14: byte(i), 15: byte(j)})
				}
				ep := bus.Endpoint{Addr: addr, Ready: e&1 != 0, Serving: e&2 != 0, Terminating: e&4 != 0, NodeName: "node-b"}
				if e&8 != 0 {
					ep.NodeName = testNode
				}
				if e&16 != 0 {
					ep.Hints = &bus.Hints{Zones: []string{"zone-a"}}
				} else if e&32 != 0 {
					ep.Hints = &bus.Hints{Zones: []string{"zone-b"}}
				}
				sl.Items = append(sl.Items, ep)
			}
			if st.Slices[key] == nil {
				st.Slices[key] = map[string]*bus.EndpointSlice{}
			}
			st.Slices[key][sl.Name] = sl
		}
	}
	return st
}
