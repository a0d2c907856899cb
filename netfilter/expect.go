package netfilter

import (
	"context"
	"encoding/binary"
	"strings"
	"sync"

	"github.com/kpipe/kpipe/bus"
)

// ExpectedDigest is the digest Digests reads from the kernel once rules ("-A
// CHAIN ..." lines of one chain) are written into a chain of table, by either
// writer: a restarted kpipe compares the two to find the chains it need not
// write again. ok is false off the nf_tables backend (Digests hashes
// iptables-save's text there) and for rules the netlink writer cannot
// translate. With no rules it says whether digests are known at all.
func (t Tool) ExpectedDigest(ctx context.Context, table, rules string) (digest uint64, ok bool) {
	if nft, err := t.onNFTables(ctx); err != nil || !nft {
		return 0, false
	}
	return expectedDigest(t.Family, table, rules)
}

// expectedDigest computes the digest of rules from their translation: each
// rule encoded as the netlink writer encodes it, in the form the kernel lists
// it, hashed as Digests hashes the kernel's listing.
func expectedDigest(family bus.Family, table, rules string) (digest uint64, ok bool) {
	s := digestScratches.Get().(*digestScratch)
	if s.x.family != family {
		s.x = newRuleTranslator(family)
	}
	x, n, d := s.x, &s.n, newDigest()
	defer digestScratches.Put(s)
	for line := range strings.Lines(rules) {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if s.rule.parse(line) != nil {
			return 0, false
		}
		r, err := x.translate(&s.rule)
		if err != nil {
			return 0, false
		}
		n.msg.b = n.msg.b[:0]
		r.encode(&n.msg, table)
		dumped, err := decodeRule(n.msg.b)
		if err != nil {
			return 0, false
		}
		dumped.compat = nil // the kernel checks it, and keeps none
		if err := dumped.hashAs(d, n.asDumped); err != nil {
			return 0, false
		}
	}
	return uint64(*d), true
}

// digestScratch is what expectedDigest reuses from one chain to the next (a
// restarted kpipe works out 24,000 chains' digests at 10k services).
type digestScratch struct {
	x    ruleTranslator
	n    dumpForm
	rule Rule
}

var digestScratches = sync.Pool{New: func() any { return new(digestScratch) }}

// dumpForm turns the writer's encoding of a rule into the kernel's listing of
// it, which differs in two ways (seen on 6.18): nested attributes come back
// without NLA_F_NESTED, and bitwise lists its operation (NFTA_BITWISE_OP,
// boolean: 0) after its length.
type dumpForm struct {
	msg nlBuf
	out []byte
}

// asDumped returns data as the kernel lists it; valid until the next call.
func (f *dumpForm) asDumped(name, data []byte) []byte {
	f.out = f.out[:0]
	bitwise := string(name) == "bitwise"
	for len(data) >= nlaHdrLen {
		size := int(binary.NativeEndian.Uint16(data))
		if size < nlaHdrLen || size > len(data) {
			return append(f.out, data...) // not attributes: left as they are
		}
		f.out = appendUnflagged(f.out, data[:size])
		if bitwise && binary.NativeEndian.Uint16(data[2:])&attrTypeMask == nftaBitwiseLen {
			f.out = binary.NativeEndian.AppendUint16(f.out, nlaHdrLen+4)
			f.out = binary.NativeEndian.AppendUint16(f.out, nftaBitwiseOp)
			f.out = binary.BigEndian.AppendUint32(f.out, 0)
		}
		data = data[min(len(data), align4(size)):]
	}
	return f.out
}

// appendUnflagged appends one attribute, and those nested in it, without
// NLA_F_NESTED.
func appendUnflagged(out, attr []byte) []byte {
	typ := binary.NativeEndian.Uint16(attr[2:])
	if typ&nlaNested == 0 {
		out = append(out, attr...)
	} else {
		out = append(out, attr[:nlaHdrLen]...)
		binary.NativeEndian.PutUint16(out[len(out)-2:], typ&^nlaNested)
		inner := attr[nlaHdrLen:]
		for len(inner) >= nlaHdrLen {
			size := int(binary.NativeEndian.Uint16(inner))
			if size < nlaHdrLen || size > len(inner) {
				out = append(out, inner...)
				break
			}
			out = appendUnflagged(out, inner[:size])
			inner = inner[min(len(inner), align4(size)):]
		}
	}
	for len(out)%4 != 0 {
		out = append(out, 0)
	}
	return out
}
