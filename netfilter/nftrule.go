package netfilter

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"strconv"
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

// ipHeader is what iptables keeps in its ipt_ip / ip6t_ip6 part of a rule,
// wherever the options stood on the line; iptables-nft encodes it first, in
// this order: in and out interface, protocol, source, destination.
type ipHeader struct {
	in, out                  string
	invIn, invOut            bool
	proto                    uint8
	invProto                 bool
	src, dst                 netip.Prefix
	invSrc, invDst           bool
	haveIn, haveOut, haveSrc bool
	haveDst                  bool
}

// ruleTranslator turns one family's iptables rules, as kpipe writes them, into
// the expressions iptables-nft 1.8.9 would write for them. It reuses its match
// parser from rule to rule (a map a rule was a tenth of a 10k-service
// encoding's allocations), so it serves one goroutine at a time.
type ruleTranslator struct {
	family bus.Family
	m      *matchParser
}

func newRuleTranslator(family bus.Family) ruleTranslator {
	return ruleTranslator{family: family, m: &matchParser{}}
}

// parser returns the match parser, emptied for the next rule.
func (x ruleTranslator) parser() *matchParser {
	*x.m = matchParser{x: x, opts: x.m.opts, needProto: x.m.needProto[:0]}
	return x.m
}

// translate reads the arguments of one "-A" line (after "-A CHAIN").
func (x ruleTranslator) translate(chain string, args []string) (nftRule, error) {
	var h ipHeader
	var matches []expr
	var target []expr
	m := x.parser()
	invert := false
	for i := 0; i < len(args); i++ {
		arg := args[i]
		if arg == "!" {
			if invert {
				return nftRule{}, untranslatable("double !")
			}
			invert = true
			continue
		}
		value := func() (string, error) {
			if i+1 >= len(args) {
				return "", untranslatable("%s without a value", arg)
			}
			i++
			return args[i], nil
		}
		var err error
		switch arg {
		case "-p", "--protocol":
			var v string
			if v, err = value(); err == nil {
				h.proto, err = protoNumber(v)
				h.invProto = invert
			}
		case "-s", "--source", "-d", "--destination":
			var v string
			var p netip.Prefix
			if v, err = value(); err == nil {
				p, err = x.prefix(v)
			}
			if err == nil && p.Bits() == 0 && invert {
				err = untranslatable("! %s %s", arg, v)
			}
			if arg == "-s" || arg == "--source" {
				h.src, h.invSrc, h.haveSrc = p, invert, true
			} else {
				h.dst, h.invDst, h.haveDst = p, invert, true
			}
		case "-i", "--in-interface", "-o", "--out-interface":
			var v string
			if v, err = value(); err == nil && (v == "" || len(v) > 15) {
				err = untranslatable("interface %q", v)
			}
			if arg == "-i" || arg == "--in-interface" {
				h.in, h.invIn, h.haveIn = v, invert, true
			} else {
				h.out, h.invOut, h.haveOut = v, invert, true
			}
		case "-m", "--match":
			if invert {
				return nftRule{}, untranslatable("! before -m")
			}
			if err = m.finish(&matches); err == nil {
				var v string
				if v, err = value(); err == nil {
					err = m.start(v)
				}
			}
		case "-j", "--jump":
			if invert || target != nil {
				return nftRule{}, untranslatable("-j twice or inverted")
			}
			var v string
			if v, err = value(); err == nil {
				target, i, err = x.target(v, args, i+1)
				i--
			}
		default:
			if !strings.HasPrefix(arg, "--") || m.name == "" {
				return nftRule{}, untranslatable("option %q", arg)
			}
			var v string
			if m.takesValue(arg) {
				v, err = value()
			}
			if err == nil {
				err = m.option(arg, v, invert)
			}
		}
		if err != nil {
			return nftRule{}, err
		}
		invert = false
	}
	if invert {
		return nftRule{}, untranslatable("a trailing !")
	}
	if err := m.finish(&matches); err != nil {
		return nftRule{}, err
	}
	for _, need := range m.needProto {
		if need != h.proto || h.invProto {
			return nftRule{}, untranslatable("a protocol match without -p")
		}
	}
	r := nftRule{chain: chain, proto: h.proto, invertProto: h.invProto}
	r.exprs = x.header(h)
	r.exprs = append(r.exprs, matches...)
	r.exprs = append(r.exprs, counter)
	r.exprs = append(r.exprs, target...)
	return r, nil
}

// header encodes the ip header part (iptables-nft's nft_ipv4_add / nft_ipv6_add).
func (x ruleTranslator) header(h ipHeader) []expr {
	var out []expr
	iface := func(load expr, name string, inv bool) {
		op := cmpOp(inv)
		if strings.HasSuffix(name, "+") {
			name = strings.TrimSuffix(name, "+")
			if name == "" {
				return // "+" matches every interface: iptables-nft writes nothing
			}
			out = append(out, load, cmp(op, []byte(name)))
			return
		}
		out = append(out, load, cmp(op, append([]byte(name), 0)))
	}
	if h.haveIn {
		iface(loadIIFName, h.in, h.invIn)
	}
	if h.haveOut {
		iface(loadOIFName, h.out, h.invOut)
	}
	if h.proto != 0 {
		out = append(out, loadL4Proto, cmp(cmpOp(h.invProto), []byte{h.proto}))
	}
	srcOff, dstOff := uint32(12), uint32(16) // struct iphdr
	if x.family == bus.IPv6 {
		srcOff, dstOff = 8, 24 // struct ipv6hdr
	}
	if h.haveSrc && h.src.Bits() != 0 {
		out = append(out, addrMatch(srcOff, h.src, h.invSrc)...)
	}
	if h.haveDst && h.dst.Bits() != 0 {
		out = append(out, addrMatch(dstOff, h.dst, h.invDst)...)
	}
	return out
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

// prefix reads an address of x's family with an optional /length.
func (x ruleTranslator) prefix(v string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(v)
	if err != nil {
		a, aerr := netip.ParseAddr(v)
		if aerr != nil {
			return netip.Prefix{}, untranslatable("address %q", v)
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if p.Addr().Zone() != "" || p.Addr().Is4In6() || (x.family == bus.IPv6) != p.Addr().Is6() {
		return netip.Prefix{}, untranslatable("address %q in %s", v, x.family)
	}
	return p, nil
}

// protoNumber reads -p: a name iptables knows or a number.
func protoNumber(v string) (uint8, error) {
	switch strings.ToLower(v) {
	case "tcp":
		return 6, nil
	case "udp":
		return 17, nil
	case "sctp":
		return 132, nil
	case "icmp":
		return 1, nil
	case "ipv6-icmp", "icmpv6":
		return 58, nil
	}
	n, err := strconv.ParseUint(v, 10, 8)
	if err != nil || n == 0 {
		return 0, untranslatable("protocol %q", v)
	}
	return uint8(n), nil
}

// matchParser collects the options of the match most recently named by -m
// (iptables gives an option to the newest match only) and encodes it when the
// next -m or the end of the rule comes.
type matchParser struct {
	x         ruleTranslator
	name      string
	opts      map[string]matchOpt
	needProto []uint8 // protocols that tcp, udp and sctp matches need -p for
}

type matchOpt struct {
	value  string
	invert bool
}

// matchOptions are the options kpipe's matches take, and whether each has a value.
var matchOptions = map[string]map[string]bool{
	"comment":   {"--comment": true},
	"statistic": {"--mode": true, "--probability": true},
	"tcp":       {"--dport": true, "--destination-port": true},
	"udp":       {"--dport": true, "--destination-port": true},
	"sctp":      {"--dport": true, "--destination-port": true},
	"mark":      {"--mark": true},
	"conntrack": {"--ctstate": true},
	"addrtype":  {"--src-type": true, "--dst-type": true},
	"recent": {"--name": true, "--set": false, "--rcheck": false, "--update": false, "--remove": false,
		"--seconds": true, "--reap": false, "--hitcount": true, "--rsource": false, "--rdest": false, "--mask": true},
	"nfacct": {"--nfacct-name": true},
}

func (m *matchParser) start(name string) error {
	if _, ok := matchOptions[name]; !ok {
		return untranslatable("match %q", name)
	}
	m.name = name
	if m.opts == nil {
		m.opts = make(map[string]matchOpt, 4)
	}
	clear(m.opts) // one map for all of a rule's matches
	return nil
}

func (m *matchParser) takesValue(opt string) bool { return matchOptions[m.name][opt] }

func (m *matchParser) option(opt, value string, invert bool) error {
	if _, ok := matchOptions[m.name][opt]; !ok {
		return untranslatable("option %s of -m %s", opt, m.name)
	}
	if _, dup := m.opts[opt]; dup {
		return untranslatable("%s twice", opt)
	}
	m.opts[opt] = matchOpt{value, invert}
	return nil
}

// finish encodes the current match, if any, onto out.
func (m *matchParser) finish(out *[]expr) error {
	if m.name == "" {
		return nil
	}
	e, err := m.encode()
	if err != nil {
		return err
	}
	*out = append(*out, e...)
	m.name = ""
	return nil
}

func (m *matchParser) encode() ([]expr, error) {
	o := m.opts
	get := func(opt string) (matchOpt, bool) {
		v, ok := o[opt]
		return v, ok
	}
	if err := noInvertUnless(m.name, o); err != nil {
		return nil, err
	}
	switch m.name {
	case "comment":
		c, ok := get("--comment")
		if !ok || len(c.value) > 255 || strings.IndexByte(c.value, 0) >= 0 {
			return nil, untranslatable("comment %q", c.value)
		}
		return []expr{commentMatch(c.value)}, nil
	case "statistic":
		mode, _ := get("--mode")
		p, ok := get("--probability")
		if mode.value != "random" || !ok || len(o) != 2 {
			return nil, untranslatable("statistic other than --mode random --probability")
		}
		f, err := strconv.ParseFloat(p.value, 64)
		if err != nil || f < 0 || f > 1 {
			return nil, untranslatable("probability %q", p.value)
		}
		// libxt_statistic: lround(0x80000000 * probability).
		return []expr{xt("match", "statistic", 0, xtStatisticRandomInfo(uint32(math.Round(0x80000000*f)), p.invert))}, nil
	case "tcp", "udp", "sctp":
		proto, _ := protoNumber(m.name)
		m.needProto = append(m.needProto, proto)
		d, ok := get("--dport")
		if !ok {
			d, ok = get("--destination-port")
		}
		if !ok {
			switch m.name {
			case "tcp":
				return []expr{xt("match", "tcp", 0, xtPortsInfo(xtTCPSize))}, nil
			case "udp":
				return []expr{xt("match", "udp", 0, xtPortsInfo(xtUDPSize))}, nil
			}
			return []expr{xt("match", "sctp", 0, xtSCTPInfo(0))}, nil
		}
		port, err := strconv.ParseUint(d.value, 10, 16)
		if err != nil || d.invert || len(o) != 1 {
			return nil, untranslatable("--dport %q", d.value)
		}
		if m.name == "sctp" {
			if port == 0 {
				return nil, untranslatable("sctp --dport 0")
			}
			return []expr{xt("match", "sctp", 0, xtSCTPInfo(uint16(port)))}, nil
		}
		// iptables-nft matches one tcp or udp port natively.
		b := []byte{byte(port >> 8), byte(port)}
		return []expr{loadDPort, cmp(nftCmpEq, b)}, nil
	case "mark":
		mk, ok := get("--mark")
		if !ok {
			return nil, untranslatable("-m mark without --mark")
		}
		value, mask, err := markAndMask(mk.value)
		if err != nil {
			return nil, err
		}
		// iptables-nft's add_nft_mark: meta mark, masked unless the mask is full.
		out := []expr{loadMark}
		if mask != math.MaxUint32 {
			out = append(out, bitwise(ne32(mask)))
		}
		return append(out, cmp(cmpOp(mk.invert), ne32(value))), nil
	case "conntrack":
		s, ok := get("--ctstate")
		if !ok {
			return nil, untranslatable("conntrack without --ctstate")
		}
		var states uint16
		for _, name := range strings.Split(s.value, ",") {
			bit, ok := ctStates[name]
			if !ok {
				return nil, untranslatable("ctstate %q", name)
			}
			states |= bit
		}
		return []expr{xt("match", "conntrack", 3, xtConntrackStateInfo(states, s.invert))}, nil
	case "addrtype":
		var src, dst uint16
		var flags uint32
		for opt, v := range o {
			bits, ok := addrTypes[v.value]
			if !ok {
				return nil, untranslatable("address type %q", v.value)
			}
			if opt == "--src-type" {
				src = bits
				if v.invert {
					flags |= 1
				}
			} else {
				dst = bits
				if v.invert {
					flags |= 2
				}
			}
		}
		return []expr{xt("match", "addrtype", 1, xtAddrtypeInfo(src, dst, flags))}, nil
	case "recent":
		return m.recent()
	case "nfacct":
		n, ok := get("--nfacct-name")
		if !ok || n.value == "" || len(n.value) > 31 || n.invert {
			return nil, untranslatable("nfacct name %q", n.value)
		}
		return []expr{xt("match", "nfacct", 1, xtNFAcctInfo(n.value))}, nil
	}
	return nil, untranslatable("match %q", m.name)
}

// noInvertUnless refuses ! on options whose match kpipe never inverts.
func noInvertUnless(match string, o map[string]matchOpt) error {
	for opt, v := range o {
		if !v.invert {
			continue
		}
		switch {
		case match == "mark" && opt == "--mark",
			match == "conntrack" && opt == "--ctstate",
			match == "addrtype":
			continue
		}
		return untranslatable("! %s", opt)
	}
	return nil
}

func (m *matchParser) recent() ([]expr, error) {
	o := m.opts
	var checkSet uint8
	for opt, bit := range map[string]uint8{"--set": recentSet, "--rcheck": recentCheck, "--update": recentUpdate, "--remove": recentRemove} {
		if _, ok := o[opt]; ok {
			if checkSet != 0 {
				return nil, untranslatable("recent with two commands")
			}
			checkSet = bit
		}
	}
	if checkSet == 0 {
		return nil, untranslatable("recent without a command")
	}
	if _, ok := o["--reap"]; ok {
		checkSet |= recentReap
	}
	name := "DEFAULT"
	if n, ok := o["--name"]; ok {
		name = n.value
	}
	if name == "" || len(name) >= 200 {
		return nil, untranslatable("recent name %q", name)
	}
	number := func(opt string) (uint32, error) {
		v, ok := o[opt]
		if !ok {
			return 0, nil
		}
		n, err := strconv.ParseUint(v.value, 10, 32)
		if err != nil {
			return 0, untranslatable("%s %q", opt, v.value)
		}
		return uint32(n), nil
	}
	seconds, err := number("--seconds")
	if err != nil {
		return nil, err
	}
	hits, err := number("--hitcount")
	if err != nil {
		return nil, err
	}
	var side uint8 // XT_RECENT_SOURCE
	if _, ok := o["--rdest"]; ok {
		side = 1
	}
	if _, ok := o["--mask"]; ok {
		return nil, untranslatable("recent --mask")
	}
	return []expr{xt("match", "recent", 1, xtRecentInfo(seconds, hits, checkSet, name, side, recentMask))}, nil
}

// markAndMask reads "value[/mask]" (numbers in C's notations).
func markAndMask(v string) (value, mask uint32, err error) {
	mask = math.MaxUint32
	vs, ms, hasMask := strings.Cut(v, "/")
	n, err := strconv.ParseUint(vs, 0, 32)
	if err != nil {
		return 0, 0, untranslatable("mark %q", v)
	}
	if hasMask {
		mn, err := strconv.ParseUint(ms, 0, 32)
		if err != nil {
			return 0, 0, untranslatable("mark %q", v)
		}
		mask = uint32(mn)
	}
	return uint32(n), mask, nil
}

// ne32 is a 32-bit register value as the kernel holds it (host byte order).
func ne32(v uint32) []byte {
	b := make([]byte, 4)
	ne.PutUint32(b, v)
	return b
}

// target encodes -j name and its options, which run from args[i] to the end
// of the rule; it returns the index after what it read.
func (x ruleTranslator) target(name string, args []string, i int) ([]expr, int, error) {
	opts := map[string]string{}
	for i < len(args) {
		opt := args[i]
		if !strings.HasPrefix(opt, "--") {
			return nil, i, untranslatable("%q after -j %s", opt, name)
		}
		switch opt {
		case "--random-fully", "--random":
			opts[opt] = ""
			i++
			continue
		}
		if i+1 >= len(args) {
			return nil, i, untranslatable("%s without a value", opt)
		}
		opts[opt] = args[i+1]
		i += 2
	}
	only := func(allowed ...string) error {
		for opt := range opts {
			ok := false
			for _, a := range allowed {
				ok = ok || a == opt
			}
			if !ok {
				return untranslatable("-j %s %s", name, opt)
			}
		}
		return nil
	}
	switch name {
	case "ACCEPT", "DROP", "RETURN":
		if len(opts) > 0 {
			return nil, i, untranslatable("-j %s with options", name)
		}
		return []expr{verdictExprs[name]}, i, nil
	case "DNAT":
		if err := only("--to-destination"); err != nil {
			return nil, i, err
		}
		addr, port, err := x.natDestination(opts["--to-destination"])
		if err != nil {
			return nil, i, err
		}
		flags := uint32(natMapIPs)
		if port != 0 {
			flags |= natProtoSpecified
		}
		return []expr{xt("target", "DNAT", 2, xtNATRange2(flags, addr, port))}, i, nil
	case "MASQUERADE":
		if err := only("--random-fully", "--random"); err != nil {
			return nil, i, err
		}
		var flags uint32
		if _, ok := opts["--random"]; ok {
			flags |= natRandom
		}
		if _, ok := opts["--random-fully"]; ok {
			flags |= natRandomFully
		}
		if x.family == bus.IPv6 {
			return []expr{xt("target", "MASQUERADE", 0, xtMasqueradeIPv6(flags))}, i, nil
		}
		return []expr{xt("target", "MASQUERADE", 0, xtMasqueradeIPv4(flags))}, i, nil
	case "MARK":
		if len(opts) != 1 {
			return nil, i, untranslatable("-j MARK needs one option")
		}
		for opt, v := range opts {
			n, err := strconv.ParseUint(v, 0, 32)
			if err != nil {
				return nil, i, untranslatable("-j MARK %s %q", opt, v)
			}
			bits := uint32(n)
			// libxt_MARK (rev 2): new mark = (mark & ^mask) ^ value.
			switch opt {
			case "--or-mark":
				return []expr{xt("target", "MARK", 2, xtMarkInfo(bits, bits))}, i, nil
			case "--xor-mark":
				return []expr{xt("target", "MARK", 2, xtMarkInfo(bits, 0))}, i, nil
			case "--and-mark":
				return []expr{xt("target", "MARK", 2, xtMarkInfo(0, ^bits))}, i, nil
			}
			return nil, i, untranslatable("-j MARK %s", opt)
		}
	case "REJECT":
		if err := only("--reject-with"); err != nil {
			return nil, i, err
		}
		table, def := rejectWithIPv4, "icmp-port-unreachable"
		if x.family == bus.IPv6 {
			table, def = rejectWithIPv6, "icmp6-port-unreachable"
		}
		with, ok := opts["--reject-with"]
		if !ok {
			with = def
		}
		code, known := table[with]
		if !known {
			return nil, i, untranslatable("--reject-with %q", with)
		}
		return []expr{xt("target", "REJECT", 0, xtRejectInfo(code))}, i, nil
	}
	if len(opts) > 0 || !isUserChain(name) {
		return nil, i, untranslatable("-j %s", name)
	}
	return []expr{verdict(verdictJump, name)}, i, nil
}

// isUserChain says whether name can only be a chain: kpipe's chains are
// upper-case KUBE- names; any other upper-case name might be a target.
func isUserChain(name string) bool {
	return strings.HasPrefix(name, "KUBE-") && len(name) <= 28 && !strings.ContainsAny(name, " \t\"'")
}

// natDestination reads DNAT's address[:port] (IPv6 as [address]:port).
func (x ruleTranslator) natDestination(v string) (netip.Addr, uint16, error) {
	if x.family == bus.IPv6 {
		if ap, err := netip.ParseAddrPort(v); err == nil && ap.Addr().Is6() && ap.Port() != 0 {
			return ap.Addr(), ap.Port(), nil
		}
		if a, err := netip.ParseAddr(strings.Trim(v, "[]")); err == nil && a.Is6() && !a.Is4In6() && a.Zone() == "" {
			return a, 0, nil
		}
		return netip.Addr{}, 0, untranslatable("--to-destination %q", v)
	}
	host, port, hasPort := strings.Cut(v, ":")
	a, err := netip.ParseAddr(host)
	if err != nil || !a.Is4() {
		return netip.Addr{}, 0, untranslatable("--to-destination %q", v)
	}
	if !hasPort {
		return a, 0, nil
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 {
		return netip.Addr{}, 0, untranslatable("--to-destination %q", v)
	}
	return a, uint16(p), nil
}
