package netfilter

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// nf_tables objects written over netlink, with no nft binary: the tables,
// chains, sets, verdict maps and elements of kube-proxy's nftables mode, each
// encoded as nft v1.0.6 encodes the same "add" command (its comments in
// libnftnl's userdata), so that `nft list` prints them as it prints what nft
// wrote. The objects are plain data, written as nft writes them ("ipv4_addr .
// inet_proto . inet_service : verdict", "goto CHAIN"); an NFTTransaction
// collects changes to one table and commits them as one nf_tables transaction,
// all or none. Rules are not written here.

// NFTTable is an nf_tables table of one family ("table ip NAME").
type NFTTable struct {
	Family  bus.Family
	Name    string
	Comment string
}

// NFTChain is a chain; Type, Hook and Priority make it a base chain, whose
// policy is the kernel's default, accept (kube-proxy never sets one).
type NFTChain struct {
	Name     string
	Comment  string
	Type     string // "filter" or "nat"; "" for a regular chain
	Hook     string // "prerouting", "input", "forward", "output" or "postrouting"
	Priority int32  // a number: nft's names (dstnat, filter, srcnat) are -100, 0, 100
}

// NFTSet is a set, or a verdict map when its Type ends in ": verdict".
type NFTSet struct {
	Name string
	// Type as nft writes it: "ipv4_addr", "ipv6_addr . inet_proto .
	// inet_service" (a concatenation), "inet_proto . inet_service : verdict".
	Type    string
	Dynamic bool          // flags dynamic: rules may add elements
	Timeout time.Duration // flags timeout, and the elements' default timeout (0: neither)
	Comment string
}

// NFTElement is an element of a set or verdict map.
type NFTElement struct {
	Key     []string // a value for each field of the set's type: "172.30.0.41", "tcp", "80"
	Value   string   // a verdict map's verdict: "drop", "accept", "goto CHAIN", "jump CHAIN"
	Comment string
}

// NFTTransaction is changes to one table, sent as one nf_tables transaction.
type NFTTransaction struct {
	table   NFTTable
	proto   uint8
	section nftSection
	sets    uint32 // sets added so far, which number them
}

// NewNFTTransaction starts an empty transaction on table.
func NewNFTTransaction(table NFTTable) *NFTTransaction {
	return &NFTTransaction{table: table, proto: nfproto(table.Family), section: newNFTSection(table.Name, 4096)}
}

// newNFTSection is an empty batch: its begin, numbered 1, and no message yet.
func newNFTSection(table string, capacity int) nftSection {
	const seq = 1 // the batch's begin; its messages follow
	s := nftSection{table: table, firstSeq: seq + 1, msgs: nlBuf{b: make([]byte, 0, capacity)}}
	at := s.msgs.msg(nfnlMsgBatchBegin, syscall.NLM_F_REQUEST, seq, 0, nfnlSubsysNFTables)
	s.msgs.done(at)
	return s
}

// Commit sends the transaction: the kernel makes all of its changes or none.
// An empty transaction sends nothing.
func (x *NFTTransaction) Commit(ctx context.Context) error {
	return Tool{Family: x.table.Family}.writeBatches(ctx, []nftSection{x.section})
}

// Len is the number of messages in the transaction.
func (x *NFTTransaction) Len() int { return len(x.section.whats) }

// add appends one message naming the table, then body's attributes.
func (x *NFTTransaction) add(typ int, flags uint16, op, name string, tableAttr uint16, body func(n *nlBuf)) {
	x.section.add(typ, flags, x.proto, nftWhat{op, name}, func(n *nlBuf) {
		n.str(tableAttr, x.table.Name)
		body(n)
	})
}

// AddTable adds the table, or leaves it as it is if it is there.
func (x *NFTTransaction) AddTable() error {
	comment := x.table.Comment
	if err := checkComment(comment); err != nil {
		return fmt.Errorf("table %s: %w", x.table.Name, err)
	}
	x.add(nftMsgNewTable, syscall.NLM_F_CREATE, "add table", x.table.Name, nftaTableName, func(n *nlBuf) {
		n.u32(nftaTableFlags, 0)
		if comment != "" {
			n.attr(nftaTableUserdata, udataString(nil, udataComment, comment))
		}
	})
	return nil
}

// DeleteTable deletes the table and everything in it.
func (x *NFTTransaction) DeleteTable() {
	x.add(nftMsgDelTable, 0, "delete table", x.table.Name, nftaTableName, func(*nlBuf) {})
}

// hooks are the netfilter hooks' numbers (NF_INET_*), by nft's names.
var hooks = map[string]uint32{"prerouting": 0, "input": 1, "forward": 2, "output": 3, "postrouting": 4}

// AddChain adds c, or leaves it as it is if it is there.
func (x *NFTTransaction) AddChain(c NFTChain) error {
	hook, known := hooks[c.Hook]
	switch {
	case c.Type == "" && c.Hook != "":
		return fmt.Errorf("chain %s: hook %s without a type", c.Name, c.Hook)
	case c.Type != "" && c.Type != "filter" && c.Type != "nat":
		return fmt.Errorf("chain %s: type %q", c.Name, c.Type)
	case c.Type != "" && !known:
		return fmt.Errorf("chain %s: hook %q", c.Name, c.Hook)
	}
	if err := checkComment(c.Comment); err != nil {
		return fmt.Errorf("chain %s: %w", c.Name, err)
	}
	x.add(nftMsgNewChain, syscall.NLM_F_CREATE, "add chain", c.Name, nftaChainTable, func(n *nlBuf) {
		n.str(nftaChainName, c.Name)
		if c.Type != "" {
			n.str(nftaChainType, c.Type)
			at := n.begin(nftaChainHook)
			n.u32(nftaHookHooknum, hook)
			n.u32(nftaHookPriority, uint32(c.Priority))
			n.end(at)
		}
		if c.Comment != "" {
			n.attr(nftaChainUserdata, udataString(nil, udataComment, c.Comment))
		}
	})
	return nil
}

// FlushChain deletes every rule of a chain.
func (x *NFTTransaction) FlushChain(name string) {
	// DELRULE without a handle deletes every rule of the chain.
	x.add(nftMsgDelRule, 0, "flush chain", name, nftaRuleTable, func(n *nlBuf) { n.str(nftaRuleChain, name) })
}

// DeleteChain deletes a chain, which must have no rules and no references.
func (x *NFTTransaction) DeleteChain(name string) {
	x.add(nftMsgDelChain, 0, "delete chain", name, nftaChainTable, func(n *nlBuf) { n.str(nftaChainName, name) })
}

// AddSet adds s, or leaves it as it is if it is there (the kernel refuses
// one of the same name with another type or flags).
func (x *NFTTransaction) AddSet(s NFTSet) error {
	t, err := parseSetType(s.Type)
	if err == nil {
		err = checkComment(s.Comment)
	}
	if err != nil {
		return fmt.Errorf("set %s: %w", s.Name, err)
	}
	var flags uint32
	if t.verdictMap {
		flags |= nftSetMap
	}
	if s.Timeout != 0 {
		flags |= nftSetTimeout
	}
	if s.Dynamic {
		flags |= nftSetEval
	}
	x.sets++
	x.add(nftMsgNewSet, syscall.NLM_F_CREATE, "add set", s.Name, nftaSetTable, func(n *nlBuf) {
		n.str(nftaSetName, s.Name)
		n.u32(nftaSetFlags, flags)
		n.u32(nftaSetKeyType, t.id())
		n.u32(nftaSetKeyLen, uint32(t.keyLen()))
		if t.verdictMap {
			n.u32(nftaSetDataType, nftDataVerdictType)
			n.u32(nftaSetDataLen, 0)
		}
		if s.Timeout != 0 {
			n.u64(nftaSetTimeout, uint64(s.Timeout.Milliseconds()))
		}
		n.u32(nftaSetID, x.sets)
		n.attr(nftaSetUserdata, t.userdata(s.Comment))
	})
	return nil
}

// FlushSet deletes every element of a set or map.
func (x *NFTTransaction) FlushSet(name string) {
	// DELSETELEM without elements deletes them all.
	x.add(nftMsgDelSetElem, 0, "flush set", name, nftaSetElemListTable, func(n *nlBuf) { n.str(nftaSetElemListSet, name) })
}

// DeleteSet deletes a set or map, which no rule may use.
func (x *NFTTransaction) DeleteSet(name string) {
	x.add(nftMsgDelSet, 0, "delete set", name, nftaSetTable, func(n *nlBuf) { n.str(nftaSetName, name) })
}

// AddElements adds elements to set (declared as set says, whether or not
// this transaction adds it). An element already there with the same value
// stays; with another value the kernel refuses it (delete it first).
func (x *NFTTransaction) AddElements(set NFTSet, elems []NFTElement) error {
	return x.elements(nftMsgNewSetElem, syscall.NLM_F_CREATE, "add elements to", set, elems)
}

// DeleteElements deletes the elements of set with these keys (their values
// and comments are not needed); one not there undoes the transaction.
func (x *NFTTransaction) DeleteElements(set NFTSet, elems []NFTElement) error {
	// A delete names keys only: encoded as those of a set.
	keysOf := set
	keysOf.Type, _, _ = strings.Cut(set.Type, " : ")
	keys := make([]NFTElement, len(elems))
	for i, e := range elems {
		keys[i] = NFTElement{Key: e.Key}
	}
	return x.elements(nftMsgDelSetElem, 0, "delete elements of", keysOf, keys)
}

// elemListMax bounds the elements attribute of one message: a netlink
// attribute's length is 16 bits, and an element takes at most about 600 bytes
// (a 64-byte key, a verdict naming a 256-byte chain, a 128-byte comment).
const elemListMax = 65535 - 1024

// elements appends the messages of typ for elems, as many as their size needs.
func (x *NFTTransaction) elements(typ int, flags uint16, op string, set NFTSet, elems []NFTElement) error {
	t, err := parseSetType(set.Type)
	if err != nil {
		return fmt.Errorf("set %s: %w", set.Name, err)
	}
	encoded := nlBuf{b: make([]byte, 0, 64*len(elems))}
	var ends []int // where each element's encoding ends in encoded
	for _, e := range elems {
		if err := t.encodeElement(&encoded, e); err != nil {
			return fmt.Errorf("set %s: element %s: %w", set.Name, strings.Join(e.Key, " . "), err)
		}
		ends = append(ends, len(encoded.b))
	}
	for from := 0; from < len(ends); {
		start, to := 0, from+1
		if from > 0 {
			start = ends[from-1]
		}
		for to < len(ends) && ends[to]-start <= elemListMax {
			to++
		}
		chunk := encoded.b[start:ends[to-1]]
		x.add(typ, flags, op, set.Name, nftaSetElemListTable, func(n *nlBuf) {
			n.str(nftaSetElemListSet, set.Name)
			at := n.begin(nftaSetElemListElements)
			n.b = append(n.b, chunk...)
			n.end(at)
		})
		from = to
	}
	return nil
}

// encodeElement appends one NFTA_LIST_ELEM: key, verdict, comment.
func (t setType) encodeElement(n *nlBuf, e NFTElement) error {
	key, err := t.key(e.Key)
	if err == nil {
		err = checkComment(e.Comment)
	}
	if err != nil {
		return err
	}
	code, chain, err := parseVerdict(e.Value)
	switch {
	case err != nil:
		return err
	case t.verdictMap && e.Value == "":
		return fmt.Errorf("no verdict in a verdict map")
	case !t.verdictMap && e.Value != "":
		return fmt.Errorf("a value %q in a set", e.Value)
	}
	at := n.begin(nftaListElem)
	k := n.begin(nftaSetElemKey)
	n.attr(nftaDataValue, key)
	n.end(k)
	if t.verdictMap {
		verdictData(n, nftaSetElemData, code, chain)
	}
	if e.Comment != "" {
		n.attr(nftaSetElemUserdata, udataString(nil, udataComment, e.Comment))
	}
	n.end(at)
	return nil
}

// parseVerdict reads a verdict as nft writes it; "" is none.
func parseVerdict(s string) (code int32, chain string, err error) {
	word, chain, _ := strings.Cut(s, " ")
	codes := map[string]int32{"drop": verdictDrop, "accept": verdictAccept, "return": verdictReturn, "jump": verdictJump, "goto": verdictGoto}
	code, known := codes[word]
	switch {
	case s == "":
		return 0, "", nil
	case !known:
		return 0, "", fmt.Errorf("verdict %q", s)
	case (code == verdictJump || code == verdictGoto) != (chain != ""):
		return 0, "", fmt.Errorf("verdict %q", s)
	}
	return code, chain, nil
}

// nftDatatype is one of nft's data types a key can have: its id (nft's
// enum datatypes, which `nft list` prints by name) and its length in bytes.
type nftDatatype struct {
	id    uint32
	len   int
	parse func(s string) ([]byte, error)
}

var nftDatatypes = map[string]nftDatatype{
	"ipv4_addr":    {id: 7, len: 4, parse: ipParser(netip.Addr.Is4)},
	"ipv6_addr":    {id: 8, len: 16, parse: ipParser(func(a netip.Addr) bool { return a.Is6() && !a.Is4In6() })},
	"inet_proto":   {id: 12, len: 1, parse: parseInetProto},
	"inet_service": {id: 13, len: 2, parse: parseInetService},
}

// concatTypeBits is nft's TYPE_BITS: a concatenation's type id is its
// fields' ids, each shifted in by this many bits.
const concatTypeBits = 6

func ipParser(ofFamily func(netip.Addr) bool) func(string) ([]byte, error) {
	return func(s string) ([]byte, error) {
		a, err := netip.ParseAddr(s)
		if err != nil || !ofFamily(a) || a.Zone() != "" {
			return nil, fmt.Errorf("address %q", s)
		}
		return a.AsSlice(), nil
	}
}

// parseInetProto reads a protocol as nft writes it: a name ("tcp") or a number.
func parseInetProto(s string) ([]byte, error) {
	p, err := ParseProto(s)
	return []byte{p}, err
}

func parseInetService(s string) ([]byte, error) {
	p, err := strconv.ParseUint(s, 10, 16)
	if err != nil {
		return nil, fmt.Errorf("port %q", s)
	}
	return binary.BigEndian.AppendUint16(nil, uint16(p)), nil
}

// setType is a set's Type, parsed.
type setType struct {
	fields     []nftDatatype
	verdictMap bool
}

func parseSetType(s string) (setType, error) {
	key, data, isMap := strings.Cut(s, " : ")
	var t setType
	if isMap {
		if data != "verdict" {
			return t, fmt.Errorf("map type %q: only verdict maps", s)
		}
		t.verdictMap = true
	}
	for name := range strings.SplitSeq(key, " . ") {
		dt, known := nftDatatypes[name]
		if !known {
			return t, fmt.Errorf("type %q in %q", name, s)
		}
		t.fields = append(t.fields, dt)
	}
	return t, nil
}

// id is the key's type id: a concatenation's packs its fields' ids.
func (t setType) id() uint32 {
	var id uint32
	for _, f := range t.fields {
		id = id<<concatTypeBits | f.id
	}
	return id
}

// fieldLen is the bytes a field takes in the key: in a concatenation each is
// padded to 32 bits (a register's size), as nft pads them.
func (t setType) fieldLen(f nftDatatype) int {
	if len(t.fields) == 1 {
		return f.len
	}
	return align4(f.len)
}

func (t setType) keyLen() int {
	n := 0
	for _, f := range t.fields {
		n += t.fieldLen(f)
	}
	return n
}

// key encodes an element's key.
func (t setType) key(values []string) ([]byte, error) {
	if len(values) != len(t.fields) {
		return nil, fmt.Errorf("%d values for a key of %d fields", len(values), len(t.fields))
	}
	out := make([]byte, 0, t.keyLen())
	for i, f := range t.fields {
		b, err := f.parse(values[i])
		if err != nil {
			return nil, err
		}
		out = append(out, b...)
		out = append(out, make([]byte, t.fieldLen(f)-len(b))...)
	}
	return out, nil
}

// userdata is what nft keeps in a set's userdata: the key's byte order (big
// endian for a single network field, nft's "invalid" for a concatenation), a
// verdict map's data byte order ("invalid"), and the comment.
func (t setType) userdata(comment string) []byte {
	order := uint32(byteorderBigEndian)
	if len(t.fields) > 1 {
		order = 0
	}
	b := udataU32(nil, udataSetKeyOrder, order)
	if t.verdictMap {
		b = udataU32(b, udataSetDataOrder, 0)
	}
	if comment != "" {
		b = udataString(b, udataSetComment, comment)
	}
	return b
}

// commentMax is the longest comment nft writes (NFT_USERDATA_MAXLEN is 256
// bytes, for all of an object's userdata).
const commentMax = 128

func checkComment(s string) error {
	if len(s) > commentMax {
		return fmt.Errorf("a comment of %d bytes (at most %d)", len(s), commentMax)
	}
	return nil
}

// udataString appends a libnftnl userdata string (NUL-terminated).
func udataString(b []byte, typ byte, s string) []byte {
	b = append(b, typ, byte(len(s)+1))
	b = append(b, s...)
	return append(b, 0)
}

// udataU32 appends a libnftnl userdata number (host byte order).
func udataU32(b []byte, typ byte, v uint32) []byte {
	b = append(b, typ, 4)
	return binary.NativeEndian.AppendUint32(b, v)
}
