package tracer

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// plan builds a plan from "table chain rule" specs: each chain's rules are the
// lines given for it; a chain named with no rules is declared empty.
func plan(nat, filter map[string][]string) *bus.Plan {
	table := func(name string, chains map[string][]string) bus.TablePayload {
		tp := bus.TablePayload{Table: name}
		names := make([]string, 0, len(chains))
		for c := range chains {
			names = append(names, c)
		}
		slices.Sort(names)
		for _, c := range names {
			var b strings.Builder
			for _, r := range chains[c] {
				b.WriteString("-A " + c + " " + r + "\n")
			}
			tp.Chains = append(tp.Chains, bus.Chain{Name: c, Rules: b.String()})
		}
		return tp
	}
	return &bus.Plan{Family: bus.IPv4, Tables: []bus.TablePayload{table(nf.TableNAT, nat), table(nf.TableFilter, filter)}}
}

// fixed are the chains every kpipe plan has, with kpipe's masquerade machinery.
func fixed(nat map[string][]string) map[string][]string {
	out := map[string][]string{
		nf.ChainServices: nil, nf.ChainNodePorts: nil,
		nf.ChainPostrouting: {"-m mark ! --mark 0x4000/0x4000 -j RETURN", "-j MARK --xor-mark 0x4000", "-j MASQUERADE --random-fully"},
		nf.ChainMarkMasq:    {"-j MARK --or-mark 0x4000"},
	}
	for c, rules := range nat {
		out[c] = append(out[c], rules...)
	}
	return out
}

func filterChains(extra map[string][]string) map[string][]string {
	out := map[string][]string{nf.ChainServices: nil, nf.ChainExternalServices: nil, nf.ChainForward: nil, nf.ChainNodePorts: nil, nf.ChainProxyFirewall: nil}
	for c, rules := range extra {
		out[c] = append(out[c], rules...)
	}
	return out
}

var (
	podSrc  = netip.MustParseAddr("10.244.1.20")
	vip     = netip.MustParseAddr("10.96.0.1")
	nodeIPs = []netip.Addr{netip.MustParseAddr("192.168.1.10")}
)

func tcp(src, dst netip.Addr, port int) Packet {
	return Packet{Source: src, Dest: dst, Proto: "tcp", DPort: port, From: FromPrerouting, InInterface: "veth1"}
}

func aps(s ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, a := range s {
		out = append(out, netip.MustParseAddrPort(a))
	}
	return out
}

// TestStatisticForksEveryEndpoint: three endpoints behind 1/3, 1/2 and an
// unconditional rule give three paths, one per endpoint.
func TestStatisticForksEveryEndpoint(t *testing.T) {
	p := plan(fixed(map[string][]string{
		nf.ChainServices: {"-d 10.96.0.1/32 -m tcp -p tcp --dport 80 -j KUBE-SVC-A"},
		"KUBE-SVC-A": {
			"-m statistic --mode random --probability 0.3333333333 -m tcp -p tcp -j DNAT --to-destination 10.244.1.5:8080",
			"-m statistic --mode random --probability 0.5000000000 -m tcp -p tcp -j DNAT --to-destination 10.244.2.5:8080",
			"-m tcp -p tcp -j DNAT --to-destination 10.244.3.5:8080",
		},
	}), filterChains(nil))
	res := Trace(p, nodeIPs, nil, tcp(podSrc, vip, 80))
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if want := aps("10.244.1.5:8080", "10.244.2.5:8080", "10.244.3.5:8080"); !slices.Equal(res.Endpoints, want) || len(res.Paths) != 3 {
		t.Errorf("endpoints %v over %d paths, want %v over 3", res.Endpoints, len(res.Paths), want)
	}
	if res.Verdict != Accept || res.Masqueraded {
		t.Errorf("got %v, want ACCEPT unmasqueraded", res)
	}
	if other := Trace(p, nodeIPs, nil, tcp(podSrc, vip, 81)); len(other.Endpoints) != 0 || other.Verdict != Accept {
		t.Errorf("port 81: %v, want ACCEPT, not DNATed", other)
	}
}

// TestMarkAndPostrouting: KUBE-MARK-MASQ's mark makes KUBE-POSTROUTING
// masquerade a forwarded packet; a mark KUBE-POSTROUTING does not test does not.
func TestMarkAndPostrouting(t *testing.T) {
	for _, tc := range []struct {
		mark string
		masq bool
	}{{"0x4000", true}, {"0x2000", false}} {
		p := plan(fixed(map[string][]string{
			nf.ChainServices: {"-d 10.96.0.1/32 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ", "-d 10.96.0.1/32 -j DNAT --to-destination 10.244.1.5:8080"},
			nf.ChainMarkMasq: nil,
		}), filterChains(nil))
		nat := p.Table(nf.TableNAT)
		nat.Chains = slices.DeleteFunc(nat.Chains, func(c bus.Chain) bool { return c.Name == nf.ChainMarkMasq })
		nat.Chains = append(nat.Chains, bus.Chain{Name: nf.ChainMarkMasq, Rules: "-A KUBE-MARK-MASQ -j MARK --or-mark " + tc.mark + "\n"})
		outside := Trace(p, nodeIPs, nil, tcp(netip.MustParseAddr("1.2.3.4"), vip, 80))
		if outside.Err != nil || outside.Masqueraded != tc.masq {
			t.Errorf("mark %s, from outside: %v, want masqueraded %v", tc.mark, outside, tc.masq)
		}
		if pod := Trace(p, nodeIPs, nil, tcp(podSrc, vip, 80)); pod.Err != nil || pod.Masqueraded {
			t.Errorf("mark %s, from a pod: %v, want not masqueraded", tc.mark, pod)
		}
	}
}

// TestInterfaceMatches: "-i veth+" is a prefix, "! -i" negates, and a packet from
// a local process has no input interface.
func TestInterfaceMatches(t *testing.T) {
	p := plan(fixed(map[string][]string{
		nf.ChainServices: {"! -i veth+ -j KUBE-MARK-MASQ", "-d 10.96.0.1/32 -j DNAT --to-destination 10.244.1.5:8080"},
	}), filterChains(nil))
	for _, tc := range []struct {
		in, from string
		masq     bool
	}{{"veth1234", FromPrerouting, false}, {"eth0", FromPrerouting, true}, {"vet", FromPrerouting, true}, {"", FromOutput, true}} {
		pkt := tcp(netip.MustParseAddr("192.168.1.10"), vip, 80)
		pkt.InInterface, pkt.From = tc.in, tc.from
		if res := Trace(p, nodeIPs, nil, pkt); res.Err != nil || res.Masqueraded != tc.masq {
			t.Errorf("in %q from %s: %v, want masqueraded %v", tc.in, tc.from, res, tc.masq)
		}
	}
}

// TestGotoAndReturn: -g returns to the caller of the chain that jumped, RETURN
// ends a chain early.
func TestGotoAndReturn(t *testing.T) {
	p := plan(fixed(map[string][]string{
		nf.ChainServices: {"-j KUBE-SVC-A", "-j DNAT --to-destination 10.244.9.9:1"},
		"KUBE-SVC-A":     {"-g KUBE-SVC-B", "-j DNAT --to-destination 10.244.1.1:1"},
		"KUBE-SVC-B":     {"-j RETURN", "-j DNAT --to-destination 10.244.2.2:1"},
	}), filterChains(nil))
	res := Trace(p, nodeIPs, nil, tcp(podSrc, vip, 80))
	if want := aps("10.244.9.9:1"); res.Err != nil || !slices.Equal(res.Endpoints, want) {
		t.Errorf("got %v, want %v", res, want)
	}
}

// TestImplicitProtocolMatch: "-p tcp --dport" needs no "-m tcp", as in iptables.
func TestImplicitProtocolMatch(t *testing.T) {
	p := plan(fixed(map[string][]string{
		nf.ChainServices: {"-p tcp -d 10.96.0.1/32 --dport 80 -j DNAT --to-destination 10.244.1.5:8080"},
	}), filterChains(nil))
	if res := Trace(p, nodeIPs, nil, tcp(podSrc, vip, 80)); res.Err != nil || len(res.Endpoints) != 1 {
		t.Errorf("got %v, want one endpoint", res)
	}
	if res := Trace(p, nodeIPs, nil, tcp(podSrc, vip, 81)); res.Err != nil || len(res.Endpoints) != 0 {
		t.Errorf("port 81: got %v, want no endpoint", res)
	}
}

// TestFilterVerdicts: REJECT and DROP in filter end the packet; ACCEPT in a
// kpipe chain ends filter for that hook; the localnet firewall drops an
// unDNATed packet from outside to 127.0.0.1 but lets a DNATed one through, even
// one DNATed to another loopback port.
func TestFilterVerdicts(t *testing.T) {
	p := plan(fixed(map[string][]string{
		nf.ChainServices: {
			"-d 127.0.0.1/32 -m tcp -p tcp --dport 30080 -j DNAT --to-destination 10.244.1.5:8080",
			"-d 127.0.0.1/32 -m tcp -p tcp --dport 30081 -j DNAT --to-destination 127.0.0.1:8081",
		},
	}), filterChains(map[string][]string{
		nf.ChainServices:         {"-d 10.96.0.1/32 -m tcp -p tcp --dport 80 -j REJECT"},
		nf.ChainProxyFirewall:    {"-d 10.96.0.2/32 -j DROP"},
		nf.ChainLocalnetFirewall: {`-m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP`},
	}))
	outside := netip.MustParseAddr("1.2.3.4")
	lo := netip.MustParseAddr("127.0.0.1")
	for _, tc := range []struct {
		pkt  Packet
		want string
	}{
		{tcp(podSrc, vip, 80), Reject},
		{tcp(podSrc, vip, 81), Accept},
		{tcp(podSrc, netip.MustParseAddr("10.96.0.2"), 80), Drop},
		{tcp(outside, lo, 30080), Accept},
		{tcp(outside, lo, 30081), Accept}, // still to 127.0.0.1, but DNATed
		{tcp(outside, lo, 22), Drop},
		{Packet{Source: lo, Dest: lo, Proto: "tcp", DPort: 22, From: FromOutput}, Accept},
	} {
		if res := Trace(p, nodeIPs, nil, tc.pkt); res.Err != nil || res.Verdict != tc.want {
			t.Errorf("%+v: %v, want %s\n%s", tc.pkt, res, tc.want, strings.Join(res.Trace(), "\n"))
		}
	}
}

// TestUnknownRulesFail: what the tracer does not know is an error, not a guess.
func TestUnknownRulesFail(t *testing.T) {
	for _, bad := range []string{
		"-m multiport --dports 80,81 -j KUBE-MARK-MASQ",
		"-m tcp -p tcp --sport 80 -j KUBE-MARK-MASQ",
		"-m tcp -p udp --dport 80 -j KUBE-MARK-MASQ",
		"-m addrtype --dst-type UNICAST -j KUBE-MARK-MASQ",
		"-j SNAT --to-source 1.2.3.4",
		"-j DNAT --to-destination 10.244.1.5:8080 --persistent",
		"-j KUBE-NOWHERE",
		"! -m comment --comment x -j RETURN",
		"-m recent --name X --seconds 10 -j RETURN",
		"-m conntrack --ctstate NEWISH -j RETURN",
		"-m comment --comment \"unterminated -j RETURN",
		"-j ACCEPT",
	} {
		p := plan(fixed(map[string][]string{nf.ChainServices: {bad}}), filterChains(nil))
		res := Trace(p, nodeIPs, nil, tcp(podSrc, vip, 80))
		if res.Err == nil || res.Verdict != Error {
			t.Errorf("rule %q: %v, want an error", bad, res)
		}
	}
	good := plan(fixed(nil), filterChains(nil))
	for _, pkt := range []Packet{
		{Source: podSrc, Dest: netip.MustParseAddr("fd00::1"), Proto: "tcp", DPort: 80, From: FromPrerouting},
		{Source: podSrc, Dest: vip, Proto: "icmp", DPort: 80, From: FromPrerouting},
		{Source: podSrc, Dest: vip, Proto: "tcp", DPort: 80, From: "input"},
	} {
		if res := Trace(good, nodeIPs, nil, pkt); res.Err == nil {
			t.Errorf("packet %+v: %v, want an error", pkt, res)
		}
	}
}
