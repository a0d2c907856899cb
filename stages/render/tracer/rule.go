package tracer

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// rule is one parsed "-A CHAIN ..." line: its matches, all of which must hold,
// and its target ("" for a rule that only counts, like the KUBE-FW- tail).
type rule struct {
	chain   string
	line    string
	matches []match
	target  string
	goTo    bool // -g rather than -j
	dnat    netip.AddrPort
	markOp  string // MARK: "or" or "xor"
	markVal uint32
}

// matchKind names the tests the tracer knows; anything else fails the parse.
type matchKind int

const (
	matchSource matchKind = iota
	matchDest
	matchInInterface
	matchProto
	matchDPort
	matchDstLocal
	matchSrcLocal
	matchStatistic
	matchRecentCheck // --rcheck / --update: the traced packet has no affinity recorded
	matchRecentSet   // --set: matches, and records the client on the path
	matchMark
	matchCtState
)

type match struct {
	kind   matchKind
	neg    bool
	prefix netip.Prefix
	iface  string
	proto  string
	port   int
	prob   float64
	recent string // the xt_recent list name
	mark   uint32
	mask   uint32
	states []string
}

// negatable are the options a "!" may precede in kpipe's rules.
var negatable = map[string]bool{"-s": true, "-d": true, "-i": true, "-p": true, "--dport": true,
	"--dst-type": true, "--src-type": true, "--mark": true, "--ctstate": true}

// modules are the -m match modules kpipe writes.
var modules = map[string]bool{"comment": true, "tcp": true, "udp": true, "sctp": true, "addrtype": true,
	"statistic": true, "recent": true, "mark": true, "conntrack": true, "nfacct": true}

var ctStates = map[string]bool{"NEW": true, "INVALID": true, "ESTABLISHED": true, "RELATED": true,
	"UNTRACKED": true, "SNAT": true, "DNAT": true}

// builtinTargets are the targets that are not chains.
var builtinTargets = map[string]bool{"ACCEPT": true, "DROP": true, "REJECT": true, "RETURN": true,
	"DNAT": true, "MARK": true, "MASQUERADE": true}

// parseRule parses one rule line of chain.
func parseRule(chain, line string) (*rule, error) {
	words, err := splitWords(line)
	if err != nil {
		return nil, fmt.Errorf("%q: %w", line, err)
	}
	if len(words) < 2 || words[0] != "-A" || words[1] != chain {
		return nil, fmt.Errorf("%q: not an -A %s rule", line, chain)
	}
	p := &ruleParser{r: &rule{chain: chain, line: line}, words: words, i: 2}
	if err := p.parse(); err != nil {
		return nil, fmt.Errorf("%q: %w", line, err)
	}
	return p.r, nil
}

type ruleParser struct {
	r      *rule
	words  []string
	i      int
	module string // the last -m
	proto  string // the -p
	protoM string // a -m tcp/udp/sctp, which iptables only accepts with the same -p
	recent string // the --name of a -m recent still waiting for its --rcheck/--update/--set
}

// next returns the word after option opt.
func (p *ruleParser) next(opt string) (string, error) {
	if p.i+1 >= len(p.words) {
		return "", fmt.Errorf("%s without a value", opt)
	}
	p.i++
	return p.words[p.i], nil
}

func (p *ruleParser) parse() error {
	neg := false
	for ; p.i < len(p.words); p.i++ {
		opt := p.words[p.i]
		if opt == "!" {
			if neg {
				return fmt.Errorf("a match negated twice")
			}
			neg = true
			continue
		}
		if neg && !negatable[opt] {
			return fmt.Errorf("! before %s, which the tracer does not negate", opt)
		}
		if opt == "-j" || opt == "-g" {
			return p.target(opt)
		}
		m, ok, err := p.option(opt)
		if err != nil {
			return err
		}
		if ok {
			m.neg = neg
			p.r.matches = append(p.r.matches, m)
		}
		neg = false
	}
	if neg {
		return fmt.Errorf("! at the end of the rule")
	}
	if p.recent != "" {
		return fmt.Errorf("-m recent --name %s without --rcheck, --update or --set", p.recent)
	}
	return p.checkProto()
}

// checkProto rejects what iptables rejects: --dport or -m tcp/udp/sctp without the
// same -p.
func (p *ruleParser) checkProto() error {
	if p.protoM != "" && p.protoM != p.proto {
		return fmt.Errorf("-m %s with -p %q", p.protoM, p.proto)
	}
	return nil
}

// option parses one match option; ok is false for options that test nothing
// (-m, comments, recent's bookkeeping).
func (p *ruleParser) option(opt string) (m match, ok bool, err error) {
	val := ""
	needsValue := opt != "--reap" && opt != "--rcheck" && opt != "--update" && opt != "--set"
	if needsValue {
		if val, err = p.next(opt); err != nil {
			return m, false, err
		}
	}
	switch opt {
	case "-m":
		if !modules[val] {
			return m, false, fmt.Errorf("unknown match module -m %s", val)
		}
		p.module = val
		if val == "tcp" || val == "udp" || val == "sctp" {
			p.protoM = val
		}
		return m, false, nil
	case "-s", "-d":
		pfx, err := parsePrefix(val)
		if err != nil {
			return m, false, err
		}
		kind := matchSource
		if opt == "-d" {
			kind = matchDest
		}
		return match{kind: kind, prefix: pfx}, true, nil
	case "-i":
		return match{kind: matchInInterface, iface: val}, true, nil
	case "-p":
		if val != "tcp" && val != "udp" && val != "sctp" {
			return m, false, fmt.Errorf("unknown protocol -p %s", val)
		}
		p.proto = val
		return match{kind: matchProto, proto: val}, true, nil
	}
	if err := p.inModule(opt); err != nil {
		return m, false, err
	}
	switch opt {
	case "--comment", "--nfacct-name": // nfacct only counts
		return m, false, nil
	case "--dport":
		port, err := strconv.Atoi(val)
		if err != nil || port < 1 || port > 65535 {
			return m, false, fmt.Errorf("bad --dport %q", val)
		}
		return match{kind: matchDPort, port: port}, true, nil
	case "--dst-type", "--src-type":
		if val != "LOCAL" {
			return m, false, fmt.Errorf("unsupported %s %s", opt, val)
		}
		kind := matchDstLocal
		if opt == "--src-type" {
			kind = matchSrcLocal
		}
		return match{kind: kind}, true, nil
	case "--mode":
		if val != "random" {
			return m, false, fmt.Errorf("unsupported --mode %s", val)
		}
		return m, false, nil
	case "--probability":
		prob, err := strconv.ParseFloat(val, 64)
		if err != nil || prob < 0 || prob > 1 {
			return m, false, fmt.Errorf("bad --probability %q", val)
		}
		return match{kind: matchStatistic, prob: prob}, true, nil
	case "--name":
		if p.recent != "" {
			return m, false, fmt.Errorf("-m recent --name %s without --rcheck, --update or --set", p.recent)
		}
		p.recent = val
		return m, false, nil
	case "--seconds":
		if _, err := strconv.Atoi(val); err != nil {
			return m, false, fmt.Errorf("bad --seconds %q", val)
		}
		return m, false, nil
	case "--reap":
		return m, false, nil
	case "--rcheck", "--update", "--set":
		name := p.recent
		if name == "" {
			return m, false, fmt.Errorf("%s before --name", opt)
		}
		p.recent = ""
		if opt == "--set" {
			return match{kind: matchRecentSet, recent: name}, true, nil
		}
		return match{kind: matchRecentCheck, recent: name}, true, nil
	case "--mark":
		mark, mask, err := parseMark(val)
		if err != nil {
			return m, false, err
		}
		return match{kind: matchMark, mark: mark, mask: mask}, true, nil
	case "--ctstate":
		states := strings.Split(val, ",")
		for _, s := range states {
			if !ctStates[s] {
				return m, false, fmt.Errorf("unknown --ctstate %s", s)
			}
		}
		return match{kind: matchCtState, states: states}, true, nil
	}
	return m, false, fmt.Errorf("unknown option %s", opt)
}

// optionModule says which -m module each module option belongs to.
var optionModule = map[string][]string{
	"--comment": {"comment"}, "--dport": {"tcp", "udp", "sctp"},
	"--dst-type": {"addrtype"}, "--src-type": {"addrtype"},
	"--mode": {"statistic"}, "--probability": {"statistic"},
	"--name": {"recent"}, "--seconds": {"recent"}, "--reap": {"recent"},
	"--rcheck": {"recent"}, "--update": {"recent"}, "--set": {"recent"},
	"--mark": {"mark"}, "--ctstate": {"conntrack"}, "--nfacct-name": {"nfacct"},
}

func (p *ruleParser) inModule(opt string) error {
	mods, known := optionModule[opt]
	if !known {
		return fmt.Errorf("unknown option %s", opt)
	}
	if opt == "--dport" && p.proto != "" {
		return nil // -p tcp loads the tcp match too
	}
	if !slices.Contains(mods, p.module) {
		return fmt.Errorf("%s after -m %q", opt, p.module)
	}
	return nil
}

// target parses -j/-g and the target's options, which end the rule.
func (p *ruleParser) target(opt string) error {
	name, err := p.next(opt)
	if err != nil {
		return err
	}
	r := p.r
	r.target, r.goTo = name, opt == "-g"
	if p.recent != "" {
		return fmt.Errorf("-m recent --name %s without --rcheck, --update or --set", p.recent)
	}
	rest := p.words[p.i+1:]
	if r.goTo && builtinTargets[name] {
		return fmt.Errorf("-g to the built-in target %s", name)
	}
	switch {
	case name == "DNAT":
		if len(rest) != 2 || rest[0] != "--to-destination" {
			return fmt.Errorf("DNAT wants exactly --to-destination ADDR:PORT, got %q", rest)
		}
		if r.dnat, err = netip.ParseAddrPort(rest[1]); err != nil {
			return fmt.Errorf("DNAT: %w", err)
		}
	case name == "MARK":
		if len(rest) != 2 || (rest[0] != "--or-mark" && rest[0] != "--xor-mark") {
			return fmt.Errorf("MARK wants --or-mark or --xor-mark VALUE, got %q", rest)
		}
		v, err := strconv.ParseUint(rest[1], 0, 32)
		if err != nil {
			return fmt.Errorf("MARK: bad value %q", rest[1])
		}
		r.markOp, r.markVal = strings.TrimSuffix(strings.TrimPrefix(rest[0], "--"), "-mark"), uint32(v)
	case name == "MASQUERADE":
		if len(rest) > 1 || (len(rest) == 1 && rest[0] != "--random-fully") {
			return fmt.Errorf("MASQUERADE: unknown options %q", rest)
		}
	case len(rest) > 0:
		return fmt.Errorf("unknown options after -j %s: %q", name, rest)
	case !builtinTargets[name] && !strings.HasPrefix(name, "KUBE-"):
		return fmt.Errorf("unknown target %s", name)
	}
	p.i = len(p.words)
	return p.checkProto()
}

func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return p, err
		}
		if p != p.Masked() {
			return p, fmt.Errorf("%s has host bits set", s)
		}
		return p, nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

func parseMark(s string) (mark, mask uint32, err error) {
	v, m, hasMask := strings.Cut(s, "/")
	mv, err := strconv.ParseUint(v, 0, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("bad --mark %q", s)
	}
	mask = 0xffffffff
	if hasMask {
		mk, err := strconv.ParseUint(m, 0, 32)
		if err != nil {
			return 0, 0, fmt.Errorf("bad --mark mask %q", s)
		}
		mask = uint32(mk)
	}
	return uint32(mv), mask, nil
}

// splitWords splits a rule line as iptables-restore does: on spaces, with
// double quotes around a word that holds spaces.
func splitWords(line string) ([]string, error) {
	var words []string
	var cur strings.Builder
	inWord, quoted := false, false
	for _, c := range line {
		switch {
		case c == '"':
			quoted, inWord = !quoted, true
		case (c == ' ' || c == '\t') && !quoted:
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(c)
			inWord = true
		}
	}
	if quoted {
		return nil, fmt.Errorf("unterminated quote")
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words, nil
}
