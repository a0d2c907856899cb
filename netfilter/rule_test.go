package netfilter_test

import (
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	nf "github.com/kpipe/kpipe/netfilter"
)

// TestParseRule: each shape of rule render writes (lines from its goldens)
// reads into the Rule it says.
func TestParseRule(t *testing.T) {
	pfx := netip.MustParsePrefix
	comment := func(text string) nf.Match { return nf.Match{Kind: nf.MatchComment, Text: text} }
	port := func(proto uint8, dport uint16) nf.Match {
		return nf.Match{Kind: nf.MatchPort, Proto: proto, DPort: dport}
	}
	tcp := nf.Proto{Num: nf.ProtoTCP}
	jump := func(chain string) nf.Target { return nf.Target{Kind: nf.TargetJump, Chain: chain} }
	for _, tc := range []struct {
		line string
		want nf.Rule
	}{
		{`-A KUBE-SERVICES -m comment --comment "demo/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10/32 --dport 80 -j KUBE-SVC-A`,
			nf.Rule{Chain: "KUBE-SERVICES", Proto: tcp, Dst: nf.Addr{Prefix: pfx("10.96.0.10/32")},
				Matches: []nf.Match{comment("demo/web:http cluster IP"), port(nf.ProtoTCP, 80)}, Target: jump("KUBE-SVC-A")}},
		{`-A KUBE-SVC-A -m comment --comment "demo/np cluster IP" -m udp -p udp -d 10.96.0.20/32 --dport 53 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ`,
			nf.Rule{Chain: "KUBE-SVC-A", Proto: nf.Proto{Num: nf.ProtoUDP}, Dst: nf.Addr{Prefix: pfx("10.96.0.20/32")},
				Src:     nf.Addr{Prefix: pfx("10.244.0.0/16"), Not: true},
				Matches: []nf.Match{comment("demo/np cluster IP"), port(nf.ProtoUDP, 53)}, Target: jump("KUBE-MARK-MASQ")}},
		{`-A KUBE-SVC-A -m comment --comment "demo/np cluster IP" -m tcp -p tcp -d 10.96.0.20/32 --dport 80 ! -i veth+ -j KUBE-MARK-MASQ`,
			nf.Rule{Chain: "KUBE-SVC-A", Proto: tcp, Dst: nf.Addr{Prefix: pfx("10.96.0.20/32")}, In: nf.Iface{Name: "veth+", Not: true},
				Matches: []nf.Match{comment("demo/np cluster IP"), port(nf.ProtoTCP, 80)}, Target: jump("KUBE-MARK-MASQ")}},
		{`-A KUBE-SVC-A -m comment --comment "demo/web:http -> 10.244.1.5:8080" -m statistic --mode random --probability 0.3333333333 -m sctp -p sctp -j KUBE-SEP-B`,
			nf.Rule{Chain: "KUBE-SVC-A", Proto: nf.Proto{Num: nf.ProtoSCTP},
				Matches: []nf.Match{comment("demo/web:http -> 10.244.1.5:8080"), {Kind: nf.MatchStatistic, Probability: 0.3333333333}, port(nf.ProtoSCTP, 0)},
				Target:  jump("KUBE-SEP-B")}},
		{`-A KUBE-SEP-B -m comment --comment "demo/web:http" -m tcp -p tcp -j DNAT --to-destination 10.244.1.5:8080`,
			nf.Rule{Chain: "KUBE-SEP-B", Proto: tcp, Matches: []nf.Match{comment("demo/web:http"), port(nf.ProtoTCP, 0)},
				Target: nf.Target{Kind: nf.TargetDNAT, To: netip.MustParseAddrPort("10.244.1.5:8080")}}},
		{`-A KUBE-SEP-B -m comment --comment "demo/v6:http" -m tcp -p tcp -j DNAT --to-destination [fd00:10:244:1::5]:8080`,
			nf.Rule{Chain: "KUBE-SEP-B", Proto: tcp, Matches: []nf.Match{comment("demo/v6:http"), port(nf.ProtoTCP, 0)},
				Target: nf.Target{Kind: nf.TargetDNAT, To: netip.MustParseAddrPort("[fd00:10:244:1::5]:8080")}}},
		{`-A KUBE-SEP-B -s 10.244.1.5/32 -j KUBE-MARK-MASQ`,
			nf.Rule{Chain: "KUBE-SEP-B", Src: nf.Addr{Prefix: pfx("10.244.1.5/32")}, Target: jump("KUBE-MARK-MASQ")}},
		{`-A KUBE-SVL-A -m comment --comment "demo/all:http -> 10.244.1.5:8080" -m recent --name KUBE-SEP-B --rcheck --seconds 600 --reap -m tcp -p tcp -j KUBE-SEP-B`,
			nf.Rule{Chain: "KUBE-SVL-A", Proto: tcp, Matches: []nf.Match{comment("demo/all:http -> 10.244.1.5:8080"),
				{Kind: nf.MatchRecent, Text: "KUBE-SEP-B", Recent: nf.RecentCheck, Seconds: 600, Reap: true}, port(nf.ProtoTCP, 0)},
				Target: jump("KUBE-SEP-B")}},
		// As iptables-save prints it: recent's default mask named.
		{`-A KUBE-SVL-A -p tcp -m recent --rcheck --seconds 600 --reap --name KUBE-SEP-B --mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -m tcp -j KUBE-SEP-B`,
			nf.Rule{Chain: "KUBE-SVL-A", Proto: tcp, Matches: []nf.Match{
				{Kind: nf.MatchRecent, Text: "KUBE-SEP-B", Recent: nf.RecentCheck, Seconds: 600, Reap: true}, port(nf.ProtoTCP, 0)},
				Target: jump("KUBE-SEP-B")}},
		{`-A KUBE-SEP-B -m comment --comment "demo/all:http" -m recent --name KUBE-SEP-B --set -m udp -p udp -j DNAT --to-destination 10.244.1.5:53`,
			nf.Rule{Chain: "KUBE-SEP-B", Proto: nf.Proto{Num: nf.ProtoUDP}, Matches: []nf.Match{comment("demo/all:http"),
				{Kind: nf.MatchRecent, Text: "KUBE-SEP-B", Recent: nf.RecentSet}, port(nf.ProtoUDP, 0)},
				Target: nf.Target{Kind: nf.TargetDNAT, To: netip.MustParseAddrPort("10.244.1.5:53")}}},
		{`-A KUBE-FW-A -m comment --comment "demo/all:http loadbalancer IP" -m comment --comment "other traffic to demo/all:http will be dropped by KUBE-PROXY-FIREWALL"`,
			nf.Rule{Chain: "KUBE-FW-A", Matches: []nf.Match{comment("demo/all:http loadbalancer IP"),
				comment("other traffic to demo/all:http will be dropped by KUBE-PROXY-FIREWALL")}}},
		{`-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN`,
			nf.Rule{Chain: "KUBE-POSTROUTING", Matches: []nf.Match{{Kind: nf.MatchMark, Not: true, Mark: 0x4000, Mask: 0x4000}},
				Target: nf.Target{Kind: nf.TargetReturn}}},
		{`-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000 -j ACCEPT`,
			nf.Rule{Chain: "KUBE-FORWARD", Matches: []nf.Match{comment("kubernetes forwarding rules"), {Kind: nf.MatchMark, Mark: 0x4000, Mask: 0xffffffff}},
				Target: nf.Target{Kind: nf.TargetAccept}}},
		{`-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000`,
			nf.Rule{Chain: "KUBE-POSTROUTING", Target: nf.Target{Kind: nf.TargetMark, MarkOp: nf.MarkXor, Mark: 0x4000}}},
		{`-A KUBE-MARK-MASQ -j MARK --or-mark 0x20`,
			nf.Rule{Chain: "KUBE-MARK-MASQ", Target: nf.Target{Kind: nf.TargetMark, MarkOp: nf.MarkOr, Mark: 0x20}}},
		// As iptables-save prints the three.
		{`-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000`,
			nf.Rule{Chain: "KUBE-MARK-MASQ", Target: nf.Target{Kind: nf.TargetMark, MarkOp: nf.MarkOr, Mark: 0x4000}}},
		{`-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0`,
			nf.Rule{Chain: "KUBE-POSTROUTING", Target: nf.Target{Kind: nf.TargetMark, MarkOp: nf.MarkXor, Mark: 0x4000}}},
		{`-A KUBE-POSTROUTING -j MARK --set-xmark 0x0/0xffffbfff`,
			nf.Rule{Chain: "KUBE-POSTROUTING", Target: nf.Target{Kind: nf.TargetMark, MarkOp: nf.MarkAnd, Mark: 0x4000}}},
		{`-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully`,
			nf.Rule{Chain: "KUBE-POSTROUTING", Matches: []nf.Match{comment("kubernetes service traffic requiring SNAT")},
				Target: nf.Target{Kind: nf.TargetMasquerade, RandomFully: true}}},
		{`-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP`,
			nf.Rule{Chain: "KUBE-FORWARD", Matches: []nf.Match{{Kind: nf.MatchConntrack, CtStates: nf.CtInvalid},
				{Kind: nf.MatchNFAcct, Text: "ct_state_invalid_dropped_pkts"}}, Target: nf.Target{Kind: nf.TargetDrop}}},
		{`-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP`,
			nf.Rule{Chain: "KUBE-FIREWALL", Dst: nf.Addr{Prefix: pfx("127.0.0.0/8")}, Src: nf.Addr{Prefix: pfx("127.0.0.0/8"), Not: true},
				Matches: []nf.Match{comment("block incoming localnet connections"),
					{Kind: nf.MatchConntrack, Not: true, CtStates: nf.CtRelated | nf.CtEstablished | nf.CtDNAT}},
				Target: nf.Target{Kind: nf.TargetDrop}}},
		{`-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports" -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS`,
			nf.Rule{Chain: "KUBE-SERVICES", Dst: nf.Addr{Prefix: pfx("::1/128"), Not: true},
				Matches: []nf.Match{comment("kubernetes service nodeports"), {Kind: nf.MatchAddrType, DstType: nf.AddrTypeLocal}},
				Target:  jump("KUBE-NODEPORTS")}},
		{`-A KUBE-EXT-A -m comment --comment "masquerade LOCAL traffic" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ`,
			nf.Rule{Chain: "KUBE-EXT-A", Matches: []nf.Match{comment("masquerade LOCAL traffic"), {Kind: nf.MatchAddrType, SrcType: nf.AddrTypeLocal}},
				Target: jump("KUBE-MARK-MASQ")}},
		{`-A KUBE-NODEPORTS -m comment --comment "demo/all:http" -m tcp -p tcp -d 127.0.0.0/8 --dport 30090 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-A`,
			nf.Rule{Chain: "KUBE-NODEPORTS", Proto: tcp, Dst: nf.Addr{Prefix: pfx("127.0.0.0/8")},
				Matches: []nf.Match{comment("demo/all:http"), port(nf.ProtoTCP, 30090), {Kind: nf.MatchNFAcct, Text: "localhost_nps_accepted_pkts"}},
				Target:  jump("KUBE-EXT-A")}},
		{`-A KUBE-EXTERNAL-SERVICES -m comment --comment "demo/np has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 -j REJECT`,
			nf.Rule{Chain: "KUBE-EXTERNAL-SERVICES", Proto: tcp, Matches: []nf.Match{comment("demo/np has no local endpoints"),
				{Kind: nf.MatchAddrType, DstType: nf.AddrTypeLocal}, port(nf.ProtoTCP, 30080)}, Target: nf.Target{Kind: nf.TargetReject}}},
		{`-A KUBE-EXT-A -j KUBE-SVC-A`, nf.Rule{Chain: "KUBE-EXT-A", Target: jump("KUBE-SVC-A")}},
		// What the tracer's and the netlink writer's tests write besides.
		{`-A KUBE-SERVICES -p tcp -d 10.96.0.1/32 --dport 80 -g KUBE-SVC-A`,
			nf.Rule{Chain: "KUBE-SERVICES", Proto: tcp, Dst: nf.Addr{Prefix: pfx("10.96.0.1/32")},
				Matches: []nf.Match{{Kind: nf.MatchPort, Proto: nf.ProtoTCP, DPort: 80, Implicit: true}},
				Target:  nf.Target{Kind: nf.TargetGoto, Chain: "KUBE-SVC-A"}}},
		{`-A KUBE-X -o eth0 -m recent --remove --rdest -j REJECT --reject-with tcp-reset`,
			nf.Rule{Chain: "KUBE-X", Out: nf.Iface{Name: "eth0"}, Matches: []nf.Match{{Kind: nf.MatchRecent, Text: "DEFAULT", Recent: nf.RecentRemove, RDest: true}},
				Target: nf.Target{Kind: nf.TargetReject, RejectWith: "tcp-reset"}}},
		{`-A KUBE-X ! -p 47 -j DNAT --to-destination 10.0.0.1`,
			nf.Rule{Chain: "KUBE-X", Proto: nf.Proto{Num: 47, Not: true}, Target: nf.Target{Kind: nf.TargetDNAT, To: netip.MustParseAddrPort("10.0.0.1:0")}}},
	} {
		got, err := nf.ParseRule(tc.line)
		if err != nil {
			t.Errorf("ParseRule(%q): %v", tc.line, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseRule(%q)\n = %+v\nwant %+v", tc.line, got, tc.want)
		}
	}
}

// TestParseRuleRefuses: malformed lines, and what kpipe's grammar does not
// hold, are refused with what was wrong.
func TestParseRuleRefuses(t *testing.T) {
	for _, tc := range []struct{ line, want string }{
		{`-I KUBE-X 1 -j RETURN`, "not an -A rule"},
		{`-A`, "-A without a value"},
		{`-A KUBE-X -m comment --comment "open -j RETURN`, "an open quote"},
		{`-A KUBE-X -m comment --comment a"b -j RETURN`, "quoting"},
		{`-A KUBE-X -m comment --comment "a"b -j RETURN`, "quoting"},
		{`-A KUBE-X -m comment --comment -j RETURN`, ""}, // "-j" is the comment: then RETURN is no option
		{`-A KUBE-X -m comment`, "-m comment without --comment"},
		{`-A KUBE-X -m multiport --dports 80,81 -j RETURN`, `match "multiport"`},
		{`-A KUBE-X -m tcp -p tcp --sport 80 -j RETURN`, "option --sport of -m tcp"},
		{`-A KUBE-X -m tcp -p udp --dport 80 -j RETURN`, "-m tcp without -p tcp"},
		{`-A KUBE-X -m tcp ! -p tcp --dport 80 -j RETURN`, "-m tcp without -p tcp"},
		{`-A KUBE-X --dport 80 -j RETURN`, `option "--dport"`},
		{`-A KUBE-X -m tcp -p tcp --dport 0 -j RETURN`, `--dport "0"`},
		{`-A KUBE-X -m tcp -p tcp --dport 80 --dport 81 -j RETURN`, "--dport twice"},
		{`-A KUBE-X -m tcp -p tcp ! --dport 80 -j RETURN`, "! --dport"},
		{`-A KUBE-X -p tcp -p udp -j RETURN`, "-p twice"},
		{`-A KUBE-X -p gre -j RETURN`, `protocol "gre"`},
		{`-A KUBE-X -s 10.0.0.0/33 -j RETURN`, `address "10.0.0.0/33"`},
		{`-A KUBE-X -d fe80::1%eth0 -j RETURN`, `address "fe80::1%eth0"`},
		{`-A KUBE-X -i averyveryverylongname -j RETURN`, "-i"},
		{`-A KUBE-X ! ! -s 10.0.0.1 -j RETURN`, "! twice"},
		{`-A KUBE-X -s 10.0.0.1 !`, "a trailing !"},
		{`-A KUBE-X ! -m comment --comment x -j RETURN`, "! before -m"},
		{`-A KUBE-X ! -j RETURN`, "! before -j"},
		{`-A KUBE-X -m comment ! --comment x -j RETURN`, "! --comment"},
		{`-A KUBE-X -j MARK --set-xmark 0x4000/0xff00`, "--set-xmark 0x4000/0xff00"},
		{`-A KUBE-X -j MARK --or-mark 0x1 --set-xmark 0x1/0x1`, "two operations"},
		{`-A KUBE-X -m statistic --mode nth --every 2 -j RETURN`, `statistic --mode "nth"`},
		{`-A KUBE-X -m statistic --probability 0.5 -j RETURN`, "-m statistic without --mode random --probability"},
		{`-A KUBE-X -m statistic --mode random --probability 1.5 -j RETURN`, `probability "1.5"`},
		{`-A KUBE-X -m recent --name X --seconds 10 -j RETURN`, "-m recent without --set"},
		{`-A KUBE-X -m recent --name X --rcheck --update -j RETURN`, "--update twice"},
		{`-A KUBE-X -m recent --name X --set --mask 255.255.255.0 -j RETURN`, `recent --mask "255.255.255.0"`},
		{`-A KUBE-X -m mark --mark 0x4000/zz -j RETURN`, `mark "0x4000/zz"`},
		{`-A KUBE-X -m conntrack --ctstate NEWISH -j RETURN`, `ctstate "NEWISH"`},
		{`-A KUBE-X -m addrtype --dst-type LOCALISH -j RETURN`, `address type "LOCALISH"`},
		{`-A KUBE-X -m nfacct --nfacct-name "" -j RETURN`, `nfacct name ""`},
		{`-A KUBE-X -j DNAT`, "-j DNAT without --to-destination"},
		{`-A KUBE-X -j DNAT --to-destination 10.0.0.1:0`, "--to-destination"},
		{`-A KUBE-X -j DNAT --to-destination [10.0.0.1]`, "--to-destination"},
		{`-A KUBE-X -j DNAT --to-destination 10.0.0.1:80 --persistent`, "--persistent without a value"},
		{`-A KUBE-X -j MARK --set-mark 1`, "-j MARK --set-mark"},
		{`-A KUBE-X -j MARK --or-mark 1 --xor-mark 2`, "-j MARK with two operations"},
		{`-A KUBE-X -j MARK`, "-j MARK without"},
		{`-A KUBE-X -j MASQUERADE --random --random`, "--random twice"},
		{`-A KUBE-X -j ACCEPT --now`, "-j ACCEPT --now"},
		{`-A KUBE-X -j KUBE-Y --fast 1`, "-j KUBE-Y --fast"},
		{`-A KUBE-X -j SNAT --to-source 1.2.3.4`, "-j SNAT --to-source"},
		{`-A KUBE-X -j KUBE-Y -m comment --comment x`, `"-m" after -j KUBE-Y`},
		{`-A KUBE-X -g RETURN`, "-g to the target RETURN"},
		{`-A KUBE-X -j KUBE-A-CHAIN-NAME-LONGER-THAN-28`, "target"},
		{`-A KUBE-X -x`, `option "-x"`},
	} {
		_, err := nf.ParseRule(tc.line)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseRule(%q) = %v; want an error with %q", tc.line, err, tc.want)
		}
	}
}

// TestParseRuleReadsEveryGolden: every rule render writes parses, and its
// target is the word after its -j.
func TestParseRuleReadsEveryGolden(t *testing.T) {
	files, err := filepath.Glob("../stages/render/testdata/*.golden")
	if err != nil || len(files) == 0 {
		t.Fatalf("no render goldens: %v", err)
	}
	n := 0
	for _, f := range files {
		payload, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for line := range strings.Lines(string(payload)) {
			line = strings.TrimSpace(line)
			if !strings.HasPrefix(line, "-A ") {
				continue
			}
			r, err := nf.ParseRule(line)
			if err != nil {
				t.Errorf("%s: %q: %v", filepath.Base(f), line, err)
				continue
			}
			_, after, jumps := strings.Cut(line, " -j ")
			if name, _, _ := strings.Cut(after, " "); (jumps && r.Target.Name() != name) || (!jumps && r.Target.Kind != nf.TargetNone) {
				t.Errorf("%q: target %q", line, r.Target.Name())
			}
			if chain := strings.Fields(line)[1]; r.Chain != chain {
				t.Errorf("%q: chain %q", line, r.Chain)
			}
			n++
		}
	}
	if n < 100 {
		t.Fatalf("only %d rules in the goldens", n)
	}
}

// TestTargetJumpsTo: only a jump or a goto names a chain.
func TestTargetJumpsTo(t *testing.T) {
	for line, want := range map[string]string{
		"-A KUBE-X -j KUBE-Y":                           "KUBE-Y",
		"-A KUBE-X -g KUBE-Y":                           "KUBE-Y",
		"-A KUBE-X -j RETURN":                           "",
		"-A KUBE-X -j DNAT --to-destination 10.0.0.1:1": "",
		"-A KUBE-X -s 10.0.0.1":                         "",
	} {
		r, err := nf.ParseRule(line)
		if err != nil || r.Target.JumpsTo() != want {
			t.Errorf("ParseRule(%q).Target.JumpsTo() = %q, %v; want %q", line, r.Target.JumpsTo(), err, want)
		}
	}
}
