package netfilter

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Rule is one rule of kpipe's rule language: an "-A CHAIN ..." line of an
// iptables-restore payload, as render writes it and as the netlink writer, the
// expected digest, the packet tracer and the fake kernel read it. ParseRule is
// its only parser. Its strings are slices of the parsed line.
type Rule struct {
	Chain string
	// The ip header part (iptables' ipt_ip), wherever it stood on the line.
	Proto    Proto
	Src, Dst Addr
	In, Out  Iface
	// Matches are the -m matches, in the order of the line (the order
	// iptables runs and encodes them).
	Matches []Match
	Target  Target
}

// Proto is -p: a protocol number (0: no -p), negated by Not.
type Proto struct {
	Num uint8
	Not bool
}

// Protocol numbers.
const (
	ProtoICMP   = 1
	ProtoTCP    = 6
	ProtoUDP    = 17
	ProtoICMPv6 = 58
	ProtoSCTP   = 132
)

// Addr is -s or -d: an address prefix (invalid: no match), negated by Not.
type Addr struct {
	Prefix netip.Prefix
	Not    bool
}

// Iface is -i or -o: an interface name ("": no match), a prefix when it ends
// in "+", negated by Not.
type Iface struct {
	Name string
	Not  bool
}

// MatchKind says which match module a Match is, and so which of its fields
// mean something.
type MatchKind uint8

const (
	MatchComment   MatchKind = iota + 1 // -m comment --comment Text
	MatchPort                           // -m tcp|udp|sctp (Proto) [--dport DPort]
	MatchStatistic                      // -m statistic --mode random --probability Probability
	MatchRecent                         // -m recent [--name Text] Recent [--seconds] [--hitcount] [--reap] [--rsource|--rdest]
	MatchMark                           // -m mark [!] --mark Mark[/Mask]
	MatchConntrack                      // -m conntrack [!] --ctstate CtStates
	MatchAddrType                       // -m addrtype [[!] --src-type SrcType] [[!] --dst-type DstType]
	MatchNFAcct                         // -m nfacct --nfacct-name Text
)

// matchNames are the modules' names on the line, by kind.
var matchNames = [...]string{MatchComment: "comment", MatchPort: "", MatchStatistic: "statistic",
	MatchRecent: "recent", MatchMark: "mark", MatchConntrack: "conntrack", MatchAddrType: "addrtype", MatchNFAcct: "nfacct"}

// Match is one -m match; Kind says which fields are its.
type Match struct {
	Kind MatchKind
	Not  bool   // mark, conntrack: ! before their one option
	Text string // comment, nfacct name, recent list name ("DEFAULT" when not given)

	Proto    uint8  // port: ProtoTCP, ProtoUDP or ProtoSCTP
	DPort    uint16 // port: 0 when no --dport
	Implicit bool   // port: loaded by --dport after -p, without -m

	Probability float64 // statistic

	Recent   RecentCommand // recent
	Seconds  uint32        // recent: 0 when not given
	HitCount uint32        // recent: 0 when not given
	Reap     bool          // recent
	RDest    bool          // recent: --rdest (the default is --rsource)

	Mark, Mask uint32 // mark: Mask is all ones when not given

	CtStates uint16 // conntrack: CtState bits

	SrcType, DstType       uint16 // addrtype: AddrType bits, 0 when not given
	NotSrcType, NotDstType bool   // addrtype
}

// RecentCommand is what -m recent does (xt_recent's check_set bits).
type RecentCommand uint8

const (
	RecentCheck  RecentCommand = recentCheck  // --rcheck
	RecentSet    RecentCommand = recentSet    // --set
	RecentUpdate RecentCommand = recentUpdate // --update
	RecentRemove RecentCommand = recentRemove // --remove
)

// Conntrack states as xt_conntrack's state_mask has them: INVALID, then
// XT_CONNTRACK_STATE_BIT(IP_CT_ESTABLISHED, _RELATED, _NEW), then SNAT, DNAT
// and UNTRACKED above IP_CT_NUMBER (5).
const (
	CtInvalid     = 1 << 0
	CtEstablished = 1 << 1
	CtRelated     = 1 << 2
	CtNew         = 1 << 3
	CtSNAT        = 1 << 6
	CtDNAT        = 1 << 7
	CtUntracked   = 1 << 8
)

var ctStates = map[string]uint16{"INVALID": CtInvalid, "ESTABLISHED": CtEstablished, "RELATED": CtRelated,
	"NEW": CtNew, "SNAT": CtSNAT, "DNAT": CtDNAT, "UNTRACKED": CtUntracked}

// AddrTypeLocal is addrtype's LOCAL (1 << RTN_LOCAL), the one kpipe writes.
const AddrTypeLocal = 1 << 2

// Address types as xt_addrtype's masks have them (1 << RTN_*).
var addrTypes = map[string]uint16{
	"UNSPEC": 1 << 0, "UNICAST": 1 << 1, "LOCAL": AddrTypeLocal, "BROADCAST": 1 << 3,
	"ANYCAST": 1 << 4, "MULTICAST": 1 << 5, "BLACKHOLE": 1 << 6, "UNREACHABLE": 1 << 7,
	"PROHIBIT": 1 << 8, "THROW": 1 << 9, "NAT": 1 << 10, "XRESOLVE": 1 << 11,
}

// TargetKind says what a rule's target is.
type TargetKind uint8

const (
	TargetNone       TargetKind = iota // no -j: the rule only matches (and counts)
	TargetJump                         // -j Chain
	TargetGoto                         // -g Chain
	TargetAccept                       // -j ACCEPT
	TargetDrop                         // -j DROP
	TargetReturn                       // -j RETURN
	TargetReject                       // -j REJECT [--reject-with RejectWith]
	TargetDNAT                         // -j DNAT --to-destination To (port 0: none)
	TargetMasquerade                   // -j MASQUERADE [--random] [--random-fully]
	TargetMark                         // -j MARK --or-mark|--xor-mark|--and-mark Mark
)

// builtinTargets are the targets that are not chains, by name: the only list.
var builtinTargets = map[string]TargetKind{"ACCEPT": TargetAccept, "DROP": TargetDrop, "RETURN": TargetReturn,
	"REJECT": TargetReject, "DNAT": TargetDNAT, "MASQUERADE": TargetMasquerade, "MARK": TargetMark}

var targetNames = [...]string{TargetAccept: "ACCEPT", TargetDrop: "DROP", TargetReturn: "RETURN",
	TargetReject: "REJECT", TargetDNAT: "DNAT", TargetMasquerade: "MASQUERADE", TargetMark: "MARK"}

// Target is a rule's -j or -g; Kind says which fields are its.
type Target struct {
	Kind        TargetKind
	Chain       string         // jump, goto
	RejectWith  string         // reject: "" for the family's default
	To          netip.AddrPort // DNAT
	Random      bool           // masquerade
	RandomFully bool           // masquerade
	MarkOp      MarkOp         // mark
	Mark        uint32         // mark
}

// MarkOp is how -j MARK changes the packet's mark.
type MarkOp uint8

const (
	MarkOr  MarkOp = iota + 1 // --or-mark
	MarkXor                   // --xor-mark
	MarkAnd                   // --and-mark
)

// Name is the target as the line names it: a chain, a built-in target, or "".
func (t Target) Name() string {
	if t.Kind == TargetJump || t.Kind == TargetGoto {
		return t.Chain
	}
	return targetNames[t.Kind]
}

// JumpsTo is the chain the rule jumps or goes to; "" for any other target.
func (t Target) JumpsTo() string {
	if t.Kind == TargetJump || t.Kind == TargetGoto {
		return t.Chain
	}
	return ""
}

// ParseRule reads one "-A CHAIN ..." line of the rule language: the only
// parser of rule text. It refuses what kpipe's grammar does not hold, naming
// the first thing it could not read.
func ParseRule(line string) (Rule, error) {
	var r Rule
	err := r.parse(line)
	return r, err
}

// parse is ParseRule into r, reusing r.Matches' array: the netlink writer
// parses a quarter of a million rules at 10k services.
func (r *Rule) parse(line string) error {
	*r = Rule{Matches: r.Matches[:0]}
	p := ruleParser{r: r, rest: line}
	if w, _, err := p.word(); err != nil || w != "-A" {
		return errors.New("not an -A rule")
	}
	chain, err := p.value("-A")
	if err != nil {
		return err
	}
	if !isChainName(chain) {
		return fmt.Errorf("chain %q", chain)
	}
	r.Chain = chain
	not := false
	for r.Target.Kind == TargetNone {
		w, ok, err := p.word()
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		if w == "!" {
			if not {
				return errors.New("! twice")
			}
			not = true
			continue
		}
		if err := p.option(w, not); err != nil {
			return err
		}
		not = false
	}
	if not {
		return errors.New("a trailing !")
	}
	if err := p.endMatch(); err != nil {
		return err
	}
	for _, m := range r.Matches {
		if m.Kind == MatchPort && (m.Proto != r.Proto.Num || r.Proto.Not) {
			return fmt.Errorf("-m %s without -p %s", protoName(m.Proto), protoName(m.Proto))
		}
	}
	return nil
}

// ruleParser reads one line into a Rule.
type ruleParser struct {
	r    *Rule
	rest string // the line not read yet
	seen uint16 // the options of the last match given so far, by optionBit
}

// word reads the next word, as iptables-restore splits a rule for the quoting
// kpipe writes: double quotes around a whole word, no escapes. ok is false at
// the end of the line.
func (p *ruleParser) word() (w string, ok bool, err error) {
	s := strings.TrimLeft(p.rest, " \t")
	if s == "" {
		p.rest = ""
		return "", false, nil
	}
	if s[0] == '"' {
		end := strings.IndexByte(s[1:], '"')
		if end < 0 {
			return "", false, errors.New("an open quote")
		}
		w, p.rest = s[1:1+end], s[2+end:]
		if strings.IndexByte(w, '\\') >= 0 || (p.rest != "" && p.rest[0] != ' ' && p.rest[0] != '\t') {
			return "", false, errors.New("quoting")
		}
		return w, true, nil
	}
	end := strings.IndexAny(s, " \t")
	if end < 0 {
		end = len(s)
	}
	w, p.rest = s[:end], s[end:]
	if strings.ContainsAny(w, "\"'\\") {
		return "", false, errors.New("quoting")
	}
	return w, true, nil
}

// value reads the value of option opt.
func (p *ruleParser) value(opt string) (string, error) {
	v, ok, err := p.word()
	if err == nil && !ok {
		err = fmt.Errorf("%s without a value", opt)
	}
	return v, err
}

// option reads one option (and its value): a header option, -m, a match's
// option, or -j/-g and the target's options, which end the rule.
func (p *ruleParser) option(opt string, not bool) error {
	r := p.r
	switch opt {
	case "-p", "--protocol":
		v, err := p.value(opt)
		if err != nil {
			return err
		}
		if r.Proto.Num != 0 {
			return errors.New("-p twice")
		}
		n, err := ParseProto(v)
		r.Proto = Proto{n, not}
		return err
	case "-s", "--source", "-d", "--destination":
		a := &r.Src
		if opt == "-d" || opt == "--destination" {
			a = &r.Dst
		}
		v, err := p.value(opt)
		if err != nil {
			return err
		}
		if a.Prefix.IsValid() {
			return fmt.Errorf("%s twice", opt)
		}
		pfx, err := parsePrefix(v)
		*a = Addr{pfx, not}
		return err
	case "-i", "--in-interface", "-o", "--out-interface":
		iface := &r.In
		if opt == "-o" || opt == "--out-interface" {
			iface = &r.Out
		}
		v, err := p.value(opt)
		if err != nil {
			return err
		}
		if iface.Name != "" || v == "" || len(v) > 15 {
			return fmt.Errorf("%s %q", opt, v)
		}
		*iface = Iface{v, not}
		return nil
	case "-m", "--match":
		v, err := p.value(opt)
		if err != nil {
			return err
		}
		if not {
			return errors.New("! before -m")
		}
		return p.startMatch(v)
	case "-j", "--jump", "-g", "--goto":
		v, err := p.value(opt)
		if err != nil {
			return err
		}
		if not {
			return fmt.Errorf("! before %s", opt)
		}
		if err := p.endMatch(); err != nil {
			return err
		}
		return p.target(v, opt == "-g" || opt == "--goto")
	}
	if !strings.HasPrefix(opt, "--") {
		return fmt.Errorf("option %q", opt)
	}
	return p.matchOption(opt, not)
}

// startMatch begins the match -m name.
func (p *ruleParser) startMatch(name string) error {
	if err := p.endMatch(); err != nil {
		return err
	}
	m := Match{}
	switch name {
	case "tcp", "udp", "sctp":
		m.Kind, m.Proto = MatchPort, protoNumbers[name]
	default:
		for k, n := range matchNames {
			if n == name && n != "" {
				m.Kind = MatchKind(k)
			}
		}
	}
	switch m.Kind {
	case 0:
		return fmt.Errorf("match %q", name)
	case MatchRecent:
		m.Text = "DEFAULT"
	case MatchMark:
		m.Mask = 1<<32 - 1
	}
	p.r.Matches = append(p.r.Matches, m)
	p.seen = 0
	return nil
}

// endMatch checks that the last match got what it needs.
func (p *ruleParser) endMatch() error {
	if len(p.r.Matches) == 0 {
		return nil
	}
	m := &p.r.Matches[len(p.r.Matches)-1]
	var missing string
	switch m.Kind {
	case MatchComment:
		missing = p.need(bitComment, "--comment")
	case MatchStatistic:
		missing = p.need(bitMode|bitProbability, "--mode random --probability")
	case MatchRecent:
		if m.Recent == 0 {
			missing = "--set, --rcheck, --update or --remove"
		}
	case MatchMark:
		missing = p.need(bitMark, "--mark")
	case MatchConntrack:
		missing = p.need(bitCtState, "--ctstate")
	case MatchNFAcct:
		missing = p.need(bitNFAcct, "--nfacct-name")
	}
	if missing != "" {
		return fmt.Errorf("-m %s without %s", matchNames[m.Kind], missing)
	}
	return nil
}

// need returns what is missing when not all of bits were seen.
func (p *ruleParser) need(bits uint16, what string) string {
	if p.seen&bits != bits {
		return what
	}
	return ""
}

// Bits of ruleParser.seen: each option once per match.
const (
	bitComment = 1 << iota
	bitDPort
	bitMode
	bitProbability
	bitName
	bitRecent // --set, --rcheck, --update, --remove
	bitSeconds
	bitHitCount
	bitReap
	bitSide // --rsource, --rdest
	bitMark
	bitCtState
	bitSrcType
	bitDstType
	bitNFAcct
	bitRecentMask // recent's --mask
)

// matchOption reads an option of the last match. --dport after -p and no
// match that takes it loads the protocol's match, as iptables does.
func (p *ruleParser) matchOption(opt string, not bool) error {
	ms := p.r.Matches
	isDPort := opt == "--dport" || opt == "--destination-port"
	if isDPort && (len(ms) == 0 || ms[len(ms)-1].Kind != MatchPort) && !p.r.Proto.Not &&
		(p.r.Proto.Num == ProtoTCP || p.r.Proto.Num == ProtoUDP || p.r.Proto.Num == ProtoSCTP) {
		if err := p.endMatch(); err != nil {
			return err
		}
		p.r.Matches = append(p.r.Matches, Match{Kind: MatchPort, Proto: p.r.Proto.Num, Implicit: true})
		p.seen, ms = 0, p.r.Matches
	}
	if len(ms) == 0 {
		return fmt.Errorf("option %q", opt)
	}
	m := &ms[len(ms)-1]
	bit, flag, negatable := matchOptionOf(m.Kind, opt)
	if bit == 0 {
		name := matchNames[m.Kind]
		if m.Kind == MatchPort {
			name = protoName(m.Proto)
		}
		return fmt.Errorf("option %s of -m %s", opt, name)
	}
	if not && !negatable {
		return fmt.Errorf("! %s", opt)
	}
	if p.seen&bit != 0 {
		return fmt.Errorf("%s twice", opt)
	}
	p.seen |= bit
	var v string
	if !flag {
		var err error
		if v, err = p.value(opt); err != nil {
			return err
		}
	}
	return m.set(opt, v, not)
}

// matchOptionOf says whether a match of kind takes opt (bit is 0 if not),
// whether opt is a flag without a value, and whether a ! may precede it.
func matchOptionOf(kind MatchKind, opt string) (bit uint16, flag, negatable bool) {
	switch kind {
	case MatchComment:
		if opt == "--comment" {
			return bitComment, false, false
		}
	case MatchPort:
		if opt == "--dport" || opt == "--destination-port" {
			return bitDPort, false, false
		}
	case MatchStatistic:
		switch opt {
		case "--mode":
			return bitMode, false, false
		case "--probability":
			return bitProbability, false, false
		}
	case MatchRecent:
		switch opt {
		case "--name":
			return bitName, false, false
		case "--set", "--rcheck", "--update", "--remove":
			return bitRecent, true, false
		case "--seconds":
			return bitSeconds, false, false
		case "--hitcount":
			return bitHitCount, false, false
		case "--reap":
			return bitReap, true, false
		case "--rsource", "--rdest":
			return bitSide, true, false
		case "--mask":
			return bitRecentMask, false, false
		}
	case MatchMark:
		if opt == "--mark" {
			return bitMark, false, true
		}
	case MatchConntrack:
		if opt == "--ctstate" {
			return bitCtState, false, true
		}
	case MatchAddrType:
		switch opt {
		case "--src-type":
			return bitSrcType, false, true
		case "--dst-type":
			return bitDstType, false, true
		}
	case MatchNFAcct:
		if opt == "--nfacct-name" {
			return bitNFAcct, false, false
		}
	}
	return 0, false, false
}

// set stores one option (which matchOptionOf said m takes) and its value.
func (m *Match) set(opt, v string, not bool) error {
	var err error
	switch opt {
	case "--comment":
		if len(v) > 255 || strings.IndexByte(v, 0) >= 0 {
			return fmt.Errorf("comment %q", v)
		}
		m.Text = v
	case "--dport", "--destination-port":
		n, perr := strconv.ParseUint(v, 10, 16)
		if perr != nil || n == 0 {
			return fmt.Errorf("%s %q", opt, v)
		}
		m.DPort = uint16(n)
	case "--mode":
		if v != "random" {
			return fmt.Errorf("statistic --mode %q", v)
		}
	case "--probability":
		f, perr := strconv.ParseFloat(v, 64)
		if perr != nil || f < 0 || f > 1 {
			return fmt.Errorf("probability %q", v)
		}
		m.Probability = f
	case "--name":
		if v == "" || len(v) >= 200 {
			return fmt.Errorf("recent name %q", v)
		}
		m.Text = v
	case "--set":
		m.Recent = RecentSet
	case "--rcheck":
		m.Recent = RecentCheck
	case "--update":
		m.Recent = RecentUpdate
	case "--remove":
		m.Recent = RecentRemove
	case "--seconds":
		m.Seconds, err = parseUint32(opt, v, 10)
	case "--hitcount":
		m.HitCount, err = parseUint32(opt, v, 10)
	case "--reap":
		m.Reap = true
	case "--rsource", "--rdest":
		m.RDest = opt == "--rdest"
	case "--mask":
		// iptables-save prints recent's default, the full mask: no other
		// is kpipe's.
		if a, perr := netip.ParseAddr(v); perr != nil || !fullMask(a) {
			return fmt.Errorf("recent --mask %q: only the full mask", v)
		}
	case "--mark":
		m.Not = not
		m.Mark, m.Mask, err = parseMark(v)
	case "--ctstate":
		m.Not = not
		for name := range strings.SplitSeq(v, ",") {
			bit, ok := ctStates[name]
			if !ok {
				return fmt.Errorf("ctstate %q", name)
			}
			m.CtStates |= bit
		}
	case "--src-type", "--dst-type":
		bits, ok := addrTypes[v]
		if !ok {
			return fmt.Errorf("address type %q", v)
		}
		if opt == "--src-type" {
			m.SrcType, m.NotSrcType = bits, not
		} else {
			m.DstType, m.NotDstType = bits, not
		}
	case "--nfacct-name":
		if v == "" || len(v) > 31 {
			return fmt.Errorf("nfacct name %q", v)
		}
		m.Text = v
	}
	return err
}

// fullMask says whether every bit of a is set.
func fullMask(a netip.Addr) bool {
	for _, b := range a.AsSlice() {
		if b != 0xff {
			return false
		}
	}
	return true
}

// target reads -j name (-g when goTo) and the target's options, the rest of
// the line.
func (p *ruleParser) target(name string, goTo bool) error {
	t := &p.r.Target
	kind, builtin := builtinTargets[name]
	switch {
	case builtin && goTo:
		return fmt.Errorf("-g to the target %s", name)
	case builtin:
		t.Kind = kind
	case !isChainName(name):
		return fmt.Errorf("target %q", name)
	case goTo:
		t.Kind, t.Chain = TargetGoto, name
	default:
		t.Kind, t.Chain = TargetJump, name
	}
	for {
		opt, ok, err := p.word()
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		if !strings.HasPrefix(opt, "--") {
			return fmt.Errorf("%q after -j %s", opt, name)
		}
		if err := p.targetOption(name, opt); err != nil {
			return err
		}
	}
	switch {
	case t.Kind == TargetDNAT && !t.To.Addr().IsValid():
		return errors.New("-j DNAT without --to-destination")
	case t.Kind == TargetMark && t.MarkOp == 0:
		return errors.New("-j MARK without --or-mark, --xor-mark or --and-mark")
	}
	return nil
}

// targetOption reads one option of the target name.
func (p *ruleParser) targetOption(name, opt string) error {
	t := &p.r.Target
	switch {
	case t.Kind != TargetDNAT && t.Kind != TargetMasquerade && t.Kind != TargetMark && t.Kind != TargetReject:
		return fmt.Errorf("-j %s %s", name, opt) // a chain or a verdict: no options
	case t.Kind == TargetMasquerade && opt == "--random":
		if t.Random {
			return fmt.Errorf("%s twice", opt)
		}
		t.Random = true
		return nil
	case t.Kind == TargetMasquerade && opt == "--random-fully":
		if t.RandomFully {
			return fmt.Errorf("%s twice", opt)
		}
		t.RandomFully = true
		return nil
	}
	v, err := p.value(opt)
	if err != nil {
		return err
	}
	switch {
	case t.Kind == TargetDNAT && opt == "--to-destination":
		if t.To.IsValid() {
			return fmt.Errorf("%s twice", opt)
		}
		t.To, err = parseNATDestination(v)
		return err
	case t.Kind == TargetReject && opt == "--reject-with":
		if t.RejectWith != "" || v == "" {
			return fmt.Errorf("-j REJECT %s %q", opt, v)
		}
		t.RejectWith = v
		return nil
	case t.Kind == TargetMark && t.MarkOp != 0:
		return errors.New("-j MARK with two operations")
	case t.Kind == TargetMark:
		switch opt {
		case "--or-mark":
			t.MarkOp = MarkOr
		case "--xor-mark":
			t.MarkOp = MarkXor
		case "--and-mark":
			t.MarkOp = MarkAnd
		case "--set-xmark":
			return t.setXMark(v)
		default:
			return fmt.Errorf("-j MARK %s", opt)
		}
		t.Mark, err = parseUint32("-j MARK "+opt, v, 0)
		return err
	}
	return fmt.Errorf("-j %s %s", name, opt)
}

// setXMark reads MARK's --set-xmark value[/mask] (mark = mark&^mask ^ value),
// which is how iptables-save prints --or-mark (value/value), --xor-mark
// (value/0) and --and-mark (0/^value): as that operation. Any other is not
// kpipe's rule language.
func (t *Target) setXMark(v string) error {
	value, mask, err := parseMark(v)
	switch {
	case err != nil:
		return err
	case mask == value:
		t.MarkOp, t.Mark = MarkOr, value
	case mask == 0:
		t.MarkOp, t.Mark = MarkXor, value
	case value == 0:
		t.MarkOp, t.Mark = MarkAnd, ^mask
	default:
		return fmt.Errorf("-j MARK --set-xmark %s: not an or, xor or and", v)
	}
	return nil
}

// isChainName says whether name can name a chain: iptables' limit of 28
// characters, and nothing a rule's words could not hold.
func isChainName(name string) bool {
	return name != "" && len(name) <= 28 && name[0] != '-' && name != "!" && !strings.ContainsAny(name, " \t\"'\\")
}

var protoNumbers = map[string]uint8{"tcp": ProtoTCP, "udp": ProtoUDP, "sctp": ProtoSCTP, "icmp": ProtoICMP,
	"ipv6-icmp": ProtoICMPv6, "icmpv6": ProtoICMPv6}

// ParseProto reads a protocol as -p takes it: a name iptables knows, in any
// case, or a number.
func ParseProto(v string) (uint8, error) {
	if n, ok := protoNumbers[strings.ToLower(v)]; ok {
		return n, nil
	}
	n, err := strconv.ParseUint(v, 10, 8)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("protocol %q", v)
	}
	return uint8(n), nil
}

// protoName is the name of a transport protocol's match.
func protoName(n uint8) string {
	switch n {
	case ProtoTCP:
		return "tcp"
	case ProtoUDP:
		return "udp"
	case ProtoSCTP:
		return "sctp"
	}
	return strconv.Itoa(int(n))
}

// parsePrefix reads an address with an optional /length.
func parsePrefix(v string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(v)
	if err != nil {
		a, aerr := netip.ParseAddr(v)
		if aerr != nil || a.Zone() != "" {
			return netip.Prefix{}, fmt.Errorf("address %q", v)
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if p.Addr().Is4In6() {
		return netip.Prefix{}, fmt.Errorf("address %q", v)
	}
	return p, nil
}

// parseNATDestination reads DNAT's address[:port] (IPv6 as [address]:port);
// the port is 0 when not given.
func parseNATDestination(v string) (netip.AddrPort, error) {
	ap, err := netip.ParseAddrPort(v)
	if err != nil {
		var a netip.Addr
		if a, err = netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(v, "["), "]")); err == nil {
			ap = netip.AddrPortFrom(a, 0)
		}
	} else if ap.Port() == 0 {
		err = errors.New("port 0")
	}
	if a := ap.Addr(); err != nil || a.Zone() != "" || a.Is4In6() || (a.Is4() && strings.HasPrefix(v, "[")) {
		return netip.AddrPort{}, fmt.Errorf("--to-destination %q", v)
	}
	return ap, nil
}

// parseMark reads "value[/mask]" (numbers in C's notations).
func parseMark(v string) (mark, mask uint32, err error) {
	vs, ms, hasMask := strings.Cut(v, "/")
	mark, err = parseUint32("mark", vs, 0)
	mask = 1<<32 - 1
	if err == nil && hasMask {
		mask, err = parseUint32("mark mask", ms, 0)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("mark %q", v)
	}
	return mark, mask, nil
}

// parseUint32 reads a 32-bit number in base (0: C's notations).
func parseUint32(what, v string, base int) (uint32, error) {
	n, err := strconv.ParseUint(v, base, 32)
	if err != nil {
		return 0, fmt.Errorf("%s %q", what, v)
	}
	return uint32(n), nil
}
