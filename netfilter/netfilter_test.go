package netfilter

import (
	"net/netip"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/ti-mo/conntrack"

	"github.com/kpipe/kpipe/bus"
)

func TestAssemble(t *testing.T) {
	chains := []bus.Chain{
		{Name: "KUBE-SERVICES", Rules: "-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA\n"},
		{Name: "KUBE-SVC-AAAAAAAAAAAAAAAA", Rules: "-A KUBE-SVC-AAAAAAAAAAAAAAAA -p tcp -j DNAT --to-destination 10.244.1.5:8080\n"},
		{Name: "KUBE-NODEPORTS"}, // declared empty: its old rules go
	}
	got := string(Assemble("nat", chains, []string{"KUBE-SVC-BBBBBBBBBBBBBBBB", "KUBE-SEP-CCCCCCCCCCCCCCCC"}))
	want := `*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-SVC-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SEP-CCCCCCCCCCCCCCCC - [0:0]
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SVC-AAAAAAAAAAAAAAAA -p tcp -j DNAT --to-destination 10.244.1.5:8080
-X KUBE-SVC-BBBBBBBBBBBBBBBB
-X KUBE-SEP-CCCCCCCCCCCCCCCC
COMMIT
`
	if got != want {
		t.Errorf("Assemble =\n%s\nwant\n%s", got, want)
	}
}

func TestAssembleOrder(t *testing.T) {
	// Whatever the contents: the table header first, every declaration before any
	// rule, every rule before any deletion (a deleted chain must be emptied, and no
	// longer referenced, first), and COMMIT last.
	chains := []bus.Chain{
		{Name: "KUBE-FORWARD", Rules: "-A KUBE-FORWARD -j ACCEPT\n"},
		{Name: "KUBE-PROXY-FIREWALL", Rules: "-A KUBE-PROXY-FIREWALL -d 198.51.100.1/32 -j DROP\n"},
	}
	lines := strings.Split(strings.TrimSuffix(string(Assemble("filter", chains, []string{"KUBE-FW-AAAAAAAAAAAAAAAA"})), "\n"), "\n")
	if lines[0] != "*filter" || lines[len(lines)-1] != "COMMIT" {
		t.Fatalf("payload %q does not start with *filter and end with COMMIT", lines)
	}
	phase := 0 // 0 declarations, 1 rules, 2 deletions
	for _, l := range lines[1 : len(lines)-1] {
		p := 1
		switch {
		case strings.HasPrefix(l, ":"):
			p = 0
		case strings.HasPrefix(l, "-X "):
			p = 2
		}
		if p < phase {
			t.Fatalf("line %q out of order in %q", l, lines)
		}
		phase = p
	}
	if phase != 2 {
		t.Fatalf("no deletion in %q", lines)
	}
}

func TestAssembleOnlyDeletes(t *testing.T) {
	got := string(Assemble("nat", nil, []string{"KUBE-SVC-AAAAAAAAAAAAAAAA"}))
	want := "*nat\n:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]\n-X KUBE-SVC-AAAAAAAAAAAAAAAA\nCOMMIT\n"
	if got != want {
		t.Errorf("Assemble = %q; want %q", got, want)
	}
}

var chainName = regexp.MustCompile(`^[A-Z2-7=-]+$`)

func TestServiceChainStableAndDistinct(t *testing.T) {
	key := bus.ServiceKey{Namespace: "ns", Name: "web"}
	ports := []bus.ServicePortName{
		{ServiceKey: key, Port: "http", Protocol: bus.TCP},
		{ServiceKey: key, Port: "http", Protocol: bus.UDP},
		{ServiceKey: key, Port: "https", Protocol: bus.TCP},
		{ServiceKey: key, Port: "", Protocol: bus.TCP},
		{ServiceKey: bus.ServiceKey{Namespace: "ns", Name: "web2"}, Port: "http", Protocol: bus.TCP},
		{ServiceKey: bus.ServiceKey{Namespace: "other", Name: "web"}, Port: "http", Protocol: bus.TCP},
	}
	seen := map[string]bus.ServicePortName{}
	for _, prefix := range []string{PrefixService, PrefixServiceLocal, PrefixExternal, PrefixFirewall} {
		for _, p := range ports {
			c := ServiceChain(prefix, p)
			if again := ServiceChain(prefix, p); again != c {
				t.Errorf("ServiceChain(%s, %v) not stable: %s then %s", prefix, p, c, again)
			}
			if !strings.HasPrefix(c, prefix) || len(c) != len(prefix)+16 {
				t.Errorf("ServiceChain(%s, %v) = %q; want the prefix and 16 hash characters", prefix, p, c)
			}
			if len(c) > 28 {
				t.Errorf("chain %q longer than iptables' 28 characters", c)
			}
			if !chainName.MatchString(c) {
				t.Errorf("chain %q has characters outside base32", c)
			}
			if !KindOf(c).PerService() {
				t.Errorf("KindOf(%q) = %d, not a per-service chain", c, KindOf(c))
			}
			if prev, dup := seen[c]; dup {
				t.Errorf("ServiceChain gives %q to both %v and %v", c, prev, p)
			}
			seen[c] = p
		}
	}
}

func TestEndpointNameStableAndDistinct(t *testing.T) {
	key := bus.ServiceKey{Namespace: "ns", Name: "web"}
	tcp := bus.ServicePortName{ServiceKey: key, Port: "http", Protocol: bus.TCP}
	udp := bus.ServicePortName{ServiceKey: key, Port: "http", Protocol: bus.UDP}
	names := map[string]string{}
	for _, c := range []struct {
		port bus.ServicePortName
		ep   string
	}{{tcp, "10.244.1.5:8080"}, {tcp, "10.244.1.6:8080"}, {tcp, "10.244.1.5:8081"}, {udp, "10.244.1.5:8080"}} {
		n := EndpointName(c.port, c.ep)
		if n != EndpointName(c.port, c.ep) {
			t.Errorf("EndpointName(%v, %s) not stable", c.port, c.ep)
		}
		if !strings.HasPrefix(n, PrefixEndpoint) || len(n) > 28 {
			t.Errorf("EndpointName(%v, %s) = %q", c.port, c.ep, n)
		}
		what := c.port.String() + string(c.port.Protocol) + " " + c.ep
		if prev, dup := names[n]; dup {
			t.Errorf("EndpointName gives %q to both %s and %s", n, prev, what)
		}
		names[n] = what
	}
	if EndpointName(tcp, "10.244.1.5:8080") == ServiceChain(PrefixService, tcp) {
		t.Error("endpoint name equals the service chain")
	}
}

// udpFlow is a UDP conntrack flow from client to dst that answerer replied from
// (the endpoint after DNAT; dst itself when nothing translated it).
func udpFlow(client, dst, answerer string) conntrack.Flow {
	c, d, a := netip.MustParseAddrPort(client), netip.MustParseAddrPort(dst), netip.MustParseAddrPort(answerer)
	var f conntrack.Flow
	f.TupleOrig.IP = conntrack.IPTuple{SourceAddress: c.Addr(), DestinationAddress: d.Addr()}
	f.TupleOrig.Proto = conntrack.ProtoTuple{Protocol: syscall.IPPROTO_UDP, SourcePort: c.Port(), DestinationPort: d.Port()}
	f.TupleReply.IP = conntrack.IPTuple{SourceAddress: a.Addr(), DestinationAddress: c.Addr()}
	f.TupleReply.Proto = conntrack.ProtoTuple{Protocol: syscall.IPPROTO_UDP, SourcePort: a.Port(), DestinationPort: c.Port()}
	return f
}

func aps(ss ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, s := range ss {
		out = append(out, netip.MustParseAddrPort(s))
	}
	return out
}

func TestStaleUDP(t *testing.T) {
	local := map[netip.Addr]bool{netip.MustParseAddr("192.168.0.1"): true, netip.MustParseAddr("127.0.0.1"): true}
	s := StaleUDP{
		Family: bus.IPv4,
		Now: map[netip.AddrPort][]netip.AddrPort{
			netip.MustParseAddrPort("10.96.0.10:53"):    aps("10.244.1.5:53", "10.244.2.5:53"), // cluster IP
			netip.MustParseAddrPort("203.0.113.7:53"):   aps("10.244.1.5:53"),                  // external IP
			netip.MustParseAddrPort("0.0.0.0:30053"):    aps("10.244.1.5:53"),                  // node port
			netip.MustParseAddrPort("10.96.0.30:5000"):  nil,                                   // no endpoints
			netip.MustParseAddrPort("198.51.100.1:514"): aps("10.244.3.3:514"),                 // load-balancer IP
		},
		Gone: map[netip.AddrPort]bool{
			netip.MustParseAddrPort("10.96.0.20:514"): true, // a deleted service
			netip.MustParseAddrPort("0.0.0.0:31000"):  true, // a deleted node port
		},
		IsLocal: func(a netip.Addr) bool { return local[a] },
	}
	tests := []struct {
		name  string
		flow  conntrack.Flow
		stale bool
	}{
		{"cluster IP answered by a current endpoint", udpFlow("10.244.9.9:40000", "10.96.0.10:53", "10.244.2.5:53"), false},
		{"cluster IP answered by a removed endpoint", udpFlow("10.244.9.9:40000", "10.96.0.10:53", "10.244.7.7:53"), true},
		{"cluster IP, endpoint address right but port wrong", udpFlow("10.244.9.9:40000", "10.96.0.10:53", "10.244.1.5:5353"), true},
		{"cluster IP flow from before there were endpoints (not translated)", udpFlow("10.244.9.9:40000", "10.96.0.10:53", "10.96.0.10:53"), true},
		{"external IP answered by its endpoint", udpFlow("198.18.0.1:40000", "203.0.113.7:53", "10.244.1.5:53"), false},
		{"external IP answered by another", udpFlow("198.18.0.1:40000", "203.0.113.7:53", "10.244.2.5:53"), true},
		{"load-balancer IP answered by its endpoint", udpFlow("198.18.0.1:40000", "198.51.100.1:514", "10.244.3.3:514"), false},
		{"front-end gone", udpFlow("10.244.9.9:40000", "10.96.0.20:514", "10.244.4.4:514"), true},
		{"node port on a local address, current endpoint", udpFlow("198.18.0.1:40000", "192.168.0.1:30053", "10.244.1.5:53"), false},
		{"node port on loopback, current endpoint", udpFlow("127.0.0.1:40000", "127.0.0.1:30053", "10.244.1.5:53"), false},
		{"node port on a local address, stale endpoint", udpFlow("198.18.0.1:40000", "192.168.0.1:30053", "10.244.7.7:53"), true},
		{"gone node port on a local address", udpFlow("198.18.0.1:40000", "192.168.0.1:31000", "10.244.7.7:53"), true},
		{"unrelated flow", udpFlow("10.244.9.9:40000", "8.8.8.8:53", "8.8.8.8:53"), false},
		{"unrelated flow to a local address", udpFlow("10.244.9.9:40000", "192.168.0.1:123", "192.168.0.1:123"), false},
		{"remote address on a node port's number", udpFlow("10.244.9.9:40000", "8.8.8.8:30053", "8.8.8.8:30053"), false},
		{"remote address on a gone node port's number", udpFlow("10.244.9.9:40000", "8.8.8.8:31000", "8.8.8.8:31000"), false},
		{"cluster IP's port on another address", udpFlow("10.244.9.9:40000", "10.96.0.11:53", "10.96.0.11:53"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := s.stale(tt.flow); got != tt.stale {
				t.Errorf("stale = %v; want %v", got, tt.stale)
			}
		})
	}
}

func TestStaleUDPIPv6(t *testing.T) {
	s := StaleUDP{
		Family:  bus.IPv6,
		Now:     map[netip.AddrPort][]netip.AddrPort{netip.MustParseAddrPort("[::]:30053"): aps("[fd00:1::5]:53")},
		Gone:    map[netip.AddrPort]bool{netip.MustParseAddrPort("[fd00::20]:514"): true},
		IsLocal: func(a netip.Addr) bool { return a == netip.MustParseAddr("fd00:ffff::1") },
	}
	if s.stale(udpFlow("[fd00:9::9]:40000", "[fd00:ffff::1]:30053", "[fd00:1::5]:53")) {
		t.Error("IPv6 node port flow to its endpoint marked stale")
	}
	if !s.stale(udpFlow("[fd00:9::9]:40000", "[fd00:ffff::1]:30053", "[fd00:1::6]:53")) {
		t.Error("IPv6 node port flow to another endpoint kept")
	}
	if !s.stale(udpFlow("[fd00:9::9]:40000", "[fd00::20]:514", "[fd00:1::7]:514")) {
		t.Error("IPv6 flow to a gone front-end kept")
	}
}

func TestStaleUDPWithoutIsLocal(t *testing.T) {
	// Without a way to tell local addresses, node ports match nothing.
	s := StaleUDP{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{netip.MustParseAddrPort("0.0.0.0:30053"): aps("10.244.1.5:53")}}
	if s.stale(udpFlow("198.18.0.1:40000", "192.168.0.1:30053", "10.244.7.7:53")) {
		t.Error("flow marked stale by a node port without knowing the address is local")
	}
}
