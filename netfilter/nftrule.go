package netfilter

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"strings"

	"github.com/kpipe/kpipe/bus"
)

// ErrUntranslatable says that a payload has something the netlink writer does
// not encode exactly as iptables-nft would; iptables-restore writes it instead.
var ErrUntranslatable = errors.New("not translatable to nf_tables netlink")

func untranslatable(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUntranslatable, fmt.Sprintf(format, args...))
}

// nftRule is one "-A CHAIN ..." line as nf_tables expressions, with the
// protocol its xt matches are checked against (NFTA_RULE_COMPAT).
type nftRule struct {
	chain       string
	exprs       []expr
	proto       uint8
	invertProto bool
}

// ruleTranslator turns one family's rules, as kpipe writes them, into the
// expressions iptables-nft 1.8.9 would write for them.
type ruleTranslator struct {
	family bus.Family
}

func newRuleTranslator(family bus.Family) ruleTranslator {
	return ruleTranslator{family: family}
}

// translate encodes a parsed rule: its ip header part first (as iptables-nft
// does, wherever the options stood on the line), then its matches in order, a
// counter and its target.
func (x ruleTranslator) translate(r *Rule) (nftRule, error) {
	if !isUserChain(r.Chain) {
		return nftRule{}, untranslatable("chain %q", r.Chain)
	}
	exprs, err := x.header(r)
	if err != nil {
		return nftRule{}, err
	}
	for i := range r.Matches {
		if exprs, err = x.match(exprs, &r.Matches[i]); err != nil {
			return nftRule{}, err
		}
	}
	exprs = append(exprs, counter)
	if exprs, err = x.target(exprs, r.Target); err != nil {
		return nftRule{}, err
	}
	return nftRule{chain: r.Chain, exprs: exprs, proto: r.Proto.Num, invertProto: r.Proto.Not}, nil
}

// header encodes the ip header part (iptables-nft's nft_ipv4_add /
// nft_ipv6_add): in and out interface, protocol, source, destination.
func (x ruleTranslator) header(r *Rule) ([]expr, error) {
	out := make([]expr, 0, 12) // a service rule's whole encoding
	iface := func(load expr, i Iface) {
		if i.Name == "" {
			return
		}
		op := cmpOp(i.Not)
		if name, wild := strings.CutSuffix(i.Name, "+"); wild {
			if name == "" {
				return // "+" matches every interface: iptables-nft writes nothing
			}
			out = append(out, load, cmp(op, []byte(name)))
			return
		}
		out = append(out, load, cmp(op, append([]byte(i.Name), 0)))
	}
	iface(loadIIFName, r.In)
	iface(loadOIFName, r.Out)
	if r.Proto.Num != 0 {
		out = append(out, loadL4Proto, cmp(cmpOp(r.Proto.Not), []byte{r.Proto.Num}))
	}
	srcOff, dstOff := uint32(12), uint32(16) // struct iphdr
	if x.family == bus.IPv6 {
		srcOff, dstOff = 8, 24 // struct ipv6hdr
	}
	for _, a := range []struct {
		opt    string
		addr   Addr
		offset uint32
	}{{"-s", r.Src, srcOff}, {"-d", r.Dst, dstOff}} {
		p := a.addr.Prefix
		switch {
		case !p.IsValid():
		case (x.family == bus.IPv6) != p.Addr().Is6():
			return nil, untranslatable("address %s in %s", p, x.family)
		case p.Bits() == 0 && a.addr.Not:
			return nil, untranslatable("! %s %s", a.opt, p)
		case p.Bits() != 0:
			out = append(out, addrMatch(a.offset, p, a.addr.Not)...)
		}
	}
	return out, nil
}

// addrMatch is iptables-nft's add_addr: a prefix on a byte boundary loads only
// its bytes; any other is masked with bitwise.
func addrMatch(offset uint32, p netip.Prefix, inv bool) []expr {
	addr := p.Masked().Addr().AsSlice()
	bits := p.Bits()
	if bits%8 == 0 {
		n := bits / 8
		return []expr{payloadLoad(nftPayloadNetworkHeader, offset, uint32(n)), cmp(cmpOp(inv), addr[:n])}
	}
	mask := make([]byte, len(addr))
	for i := range mask {
		switch {
		case bits >= 8:
			mask[i] = 0xff
			bits -= 8
		case bits > 0:
			mask[i] = byte(0xff << (8 - bits))
			bits = 0
		}
	}
	return []expr{payloadLoad(nftPayloadNetworkHeader, offset, uint32(len(addr))), bitwise(mask), cmp(cmpOp(inv), addr)}
}

func cmpOp(inv bool) uint32 {
	if inv {
		return nftCmpNeq
	}
	return nftCmpEq
}

// match appends the expressions of one match to out.
func (x ruleTranslator) match(out []expr, m *Match) ([]expr, error) {
	switch m.Kind {
	case MatchComment:
		return append(out, commentMatch(m.Text)), nil
	case MatchStatistic:
		// libxt_statistic: lround(0x80000000 * probability).
		return append(out, xt("match", "statistic", 0, xtStatisticRandomInfo(uint32(math.Round(0x80000000*m.Probability)), false))), nil
	case MatchPort:
		if m.Implicit {
			return nil, untranslatable("--dport without -m %s", protoName(m.Proto))
		}
		switch {
		case m.Proto == ProtoSCTP:
			return append(out, xt("match", "sctp", 0, xtSCTPInfo(m.DPort))), nil
		case m.DPort != 0:
			// iptables-nft matches one tcp or udp port natively.
			return append(out, loadDPort, cmp(nftCmpEq, []byte{byte(m.DPort >> 8), byte(m.DPort)})), nil
		case m.Proto == ProtoTCP:
			return append(out, xt("match", "tcp", 0, xtPortsInfo(xtTCPSize))), nil
		}
		return append(out, xt("match", "udp", 0, xtPortsInfo(xtUDPSize))), nil
	case MatchMark:
		// iptables-nft's add_nft_mark: meta mark, masked unless the mask is full.
		out = append(out, loadMark)
		if m.Mask != math.MaxUint32 {
			out = append(out, bitwise(ne32(m.Mask)))
		}
		return append(out, cmp(cmpOp(m.Not), ne32(m.Mark))), nil
	case MatchConntrack:
		return append(out, xt("match", "conntrack", 3, xtConntrackStateInfo(m.CtStates, m.Not))), nil
	case MatchAddrType:
		var flags uint32
		if m.NotSrcType {
			flags |= 1
		}
		if m.NotDstType {
			flags |= 2
		}
		return append(out, xt("match", "addrtype", 1, xtAddrtypeInfo(m.SrcType, m.DstType, flags))), nil
	case MatchRecent:
		checkSet := uint8(m.Recent)
		if m.Reap {
			checkSet |= recentReap
		}
		var side uint8 // XT_RECENT_SOURCE
		if m.RDest {
			side = 1
		}
		return append(out, xt("match", "recent", 1, xtRecentInfo(m.Seconds, m.HitCount, checkSet, m.Text, side, recentMask))), nil
	case MatchNFAcct:
		return append(out, xt("match", "nfacct", 1, xtNFAcctInfo(m.Text))), nil
	}
	return nil, untranslatable("match %d", m.Kind)
}

// ne32 is a 32-bit register value as the kernel holds it (host byte order).
func ne32(v uint32) []byte {
	b := make([]byte, 4)
	ne.PutUint32(b, v)
	return b
}

// target appends the expressions of t to out.
func (x ruleTranslator) target(out []expr, t Target) ([]expr, error) {
	switch t.Kind {
	case TargetNone:
		return out, nil
	case TargetAccept, TargetDrop, TargetReturn:
		return append(out, verdictExprs[t.Kind]), nil
	case TargetDNAT:
		a, port := t.To.Addr(), t.To.Port()
		if (x.family == bus.IPv6) != a.Is6() {
			return nil, untranslatable("--to-destination %s in %s", t.To, x.family)
		}
		flags := uint32(natMapIPs)
		if port != 0 {
			flags |= natProtoSpecified
		}
		return append(out, xt("target", "DNAT", 2, xtNATRange2(flags, a, port))), nil
	case TargetMasquerade:
		var flags uint32
		if t.Random {
			flags |= natRandom
		}
		if t.RandomFully {
			flags |= natRandomFully
		}
		if x.family == bus.IPv6 {
			return append(out, xt("target", "MASQUERADE", 0, xtMasqueradeIPv6(flags))), nil
		}
		return append(out, xt("target", "MASQUERADE", 0, xtMasqueradeIPv4(flags))), nil
	case TargetMark:
		// libxt_MARK (rev 2): new mark = (mark & ^mask) ^ value.
		switch t.MarkOp {
		case MarkOr:
			return append(out, xt("target", "MARK", 2, xtMarkInfo(t.Mark, t.Mark))), nil
		case MarkXor:
			return append(out, xt("target", "MARK", 2, xtMarkInfo(t.Mark, 0))), nil
		}
		return append(out, xt("target", "MARK", 2, xtMarkInfo(0, ^t.Mark))), nil
	case TargetReject:
		table, with := rejectWithIPv4, "icmp-port-unreachable"
		if x.family == bus.IPv6 {
			table, with = rejectWithIPv6, "icmp6-port-unreachable"
		}
		if t.RejectWith != "" {
			with = t.RejectWith
		}
		code, known := table[with]
		if !known {
			return nil, untranslatable("--reject-with %q", with)
		}
		return append(out, xt("target", "REJECT", 0, xtRejectInfo(code))), nil
	case TargetJump:
		if !isUserChain(t.Chain) {
			return nil, untranslatable("-j %s", t.Chain)
		}
		return append(out, verdict(verdictJump, t.Chain)), nil
	}
	return nil, untranslatable("-g %s", t.Chain)
}

// isUserChain says whether name can only be a chain: kpipe's chains are
// upper-case KUBE- names; any other upper-case name might be a target.
func isUserChain(name string) bool {
	return strings.HasPrefix(name, "KUBE-") && len(name) <= 28 && !strings.ContainsAny(name, " \t\"'")
}
