package netfilter

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/mdlayher/netlink"

	"github.com/kpipe/kpipe/bus"
)

// The netlink writer: an iptables-restore --noflush payload of the form kpipe
// writes (Assemble: chains declared, rules appended, chains deleted) goes to
// the kernel as one nf_tables batch per table section, with the expressions
// iptables-nft would have written for each rule, without reading the table
// first (which is what makes iptables-restore cost 0.3 s at 10,000 services).
// The rules stay iptables rules: iptables-save prints them as if
// iptables-restore had written them.

// nftSection is one "*table ... COMMIT" section as nf_tables messages, ready
// to go between a batch's begin and end, numbered from firstSeq on.
type nftSection struct {
	table    string
	msgs     nlBuf
	whats    []nftWhat // what each message does, for errors
	firstSeq uint32
}

// nftWhat is what one message does, spelt out only for an error: a message
// each for 10^5 rules, a string built for each would be megabytes.
type nftWhat struct {
	op    string // "create chain", "add a rule to", …
	chain string // a slice of the payload
}

func (w nftWhat) String() string { return w.op + " " + w.chain }

// add appends one message; body writes its attributes.
func (s *nftSection) add(typ int, flags uint16, family uint8, what nftWhat, body func(n *nlBuf)) {
	at := s.msgs.msg(uint16(nfnlSubsysNFTables<<8|typ), syscall.NLM_F_REQUEST|flags, s.firstSeq+uint32(len(s.whats)), family, 0)
	body(&s.msgs)
	s.msgs.done(at)
	s.whats = append(s.whats, what)
}

// translatePayload turns a payload into batches, or errUntranslatable. The
// batches keep slices of payload (chain names, for errors): it must not change.
func translatePayload(family bus.Family, payload []byte) ([]nftSection, error) {
	x := newRuleTranslator(family)
	var rule Rule // parsed into again for each rule, to reuse its array
	proto := nfproto(family)
	var out []nftSection
	var cur *nftSection
	seq := uint32(1)

	text := unsafe.String(unsafe.SliceData(payload), len(payload)) // not copied: tens of MB at 10k services
	for n := 0; text != ""; n++ {
		var line string
		line, text, _ = strings.Cut(text, "\n")
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "*"):
			if cur != nil {
				return nil, untranslatable("line %d: a table inside a table", n+1)
			}
			table := line[1:]
			if table != TableNAT && table != TableFilter && table != "mangle" {
				return nil, untranslatable("table %q", table)
			}
			// A rule takes about four times its text in netlink (a comment
			// match alone is 256 bytes): sized once, the buffer is not copied
			// as it grows.
			size, _, _ := strings.Cut(text, "\nCOMMIT")
			cur = &nftSection{table: table, firstSeq: seq + 1, msgs: nlBuf{b: make([]byte, 0, 4*len(size)+64)}} // seq is the batch's begin
			at := cur.msgs.msg(nfnlMsgBatchBegin, syscall.NLM_F_REQUEST, seq, 0, nfnlSubsysNFTables)
			cur.msgs.done(at)
		case cur == nil:
			return nil, untranslatable("line %d outside a table", n+1)
		case line == "COMMIT":
			out = append(out, *cur)
			seq = cur.firstSeq + uint32(len(cur.whats)) + 1 // and the batch's end
			cur = nil
		case strings.HasPrefix(line, ":"):
			f := strings.Fields(line[1:])
			if len(f) != 3 || f[1] != "-" || f[2] != "[0:0]" || !isUserChain(f[0]) {
				return nil, untranslatable("line %d: %q", n+1, line)
			}
			chain, table := f[0], cur.table
			cur.add(nftMsgNewChain, syscall.NLM_F_CREATE, proto, nftWhat{"create chain", chain}, func(n *nlBuf) {
				n.str(nftaChainTable, table)
				n.str(nftaChainName, chain)
			})
			// DELRULE without a handle deletes every rule of the chain.
			cur.add(nftMsgDelRule, 0, proto, nftWhat{"flush chain", chain}, func(n *nlBuf) {
				n.str(nftaRuleTable, table)
				n.str(nftaRuleChain, chain)
			})
		case strings.HasPrefix(line, "-X "):
			chain, table := strings.TrimSpace(line[3:]), cur.table
			if !isUserChain(chain) {
				return nil, untranslatable("line %d: %q", n+1, line)
			}
			cur.add(nftMsgDelChain, 0, proto, nftWhat{"delete chain", chain}, func(n *nlBuf) {
				n.str(nftaChainTable, table)
				n.str(nftaChainName, chain)
			})
		case strings.HasPrefix(line, "-A "):
			if err := rule.parse(line); err != nil {
				return nil, fmt.Errorf("line %d: %w: %w", n+1, ErrUntranslatable, err)
			}
			r, err := x.translate(&rule)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", n+1, err)
			}
			table := cur.table
			cur.add(nftMsgNewRule, syscall.NLM_F_CREATE|syscall.NLM_F_APPEND, proto, nftWhat{"add a rule to", r.chain}, func(n *nlBuf) {
				r.encode(n, table)
			})
		default:
			return nil, untranslatable("line %d: %q", n+1, line)
		}
	}
	if cur != nil {
		return nil, untranslatable("no COMMIT after *%s", cur.table)
	}
	return out, nil
}

// encode appends the rule's NEWRULE attributes.
func (r nftRule) encode(n *nlBuf, table string) {
	n.str(nftaRuleTable, table)
	n.str(nftaRuleChain, r.chain)
	at := n.begin(nftaRuleExpressions)
	for _, e := range r.exprs {
		e(n)
	}
	n.end(at)
	at = n.begin(nftaRuleCompat)
	n.u32(nftaRuleCompatProto, uint32(r.proto))
	var flags uint32
	if r.invertProto {
		flags = nftRuleCompatInv
	}
	n.u32(nftaRuleCompatFlags, flags)
	n.end(at)
}

// nftBatchError is the kernel's refusal of one message of a batch (the whole
// batch is then undone).
type nftBatchError struct {
	table, what string
	err         syscall.Errno
}

func (e *nftBatchError) Error() string {
	return fmt.Sprintf("nf_tables %s: %s: %v", e.table, e.what, e.err)
}

func (e *nftBatchError) Unwrap() error { return e.err }

// writeBatches sends each section as one nf_tables transaction, in order.
func (t Tool) writeBatches(ctx context.Context, sections []nftSection) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Minute) // a batch never waits forever
		defer cancel()
	}
	w, done, err := t.openReader(ctx, "")
	if err != nil {
		return err
	}
	defer done()
	if err := w.conn.SetOption(netlink.CapAcknowledge, true); err != nil {
		return err
	}
	for _, s := range sections {
		if len(s.whats) == 0 {
			continue
		}
		if err := w.batch(&s); err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("nf_tables %s: %w (%v)", s.table, ctx.Err(), err)
			}
			return err
		}
	}
	return nil
}

// batch sends one section between BATCH_BEGIN and BATCH_END and waits for the
// kernel's answer: the kernel runs the whole batch while sendmsg runs, answers
// an error for each message it refused, and acknowledges the last message (the
// only one that asks for it), so reading stops at that answer.
func (w *nftReader) batch(s *nftSection) error {
	begin, last, end := s.firstSeq-1, s.firstSeq+uint32(len(s.whats))-1, s.firstSeq+uint32(len(s.whats))
	// Ask for an answer to the last message only, and end the batch (the
	// section's buffer starts with the batch's begin).
	buf := &s.msgs
	lastAt := lastMessage(buf.b)
	flags := binary.NativeEndian.Uint16(buf.b[lastAt+6:])
	binary.NativeEndian.PutUint16(buf.b[lastAt+6:], flags|syscall.NLM_F_ACK)
	at := buf.msg(nfnlMsgBatchEnd, syscall.NLM_F_REQUEST, end, 0, nfnlSubsysNFTables)
	buf.done(at)
	defer func() { buf.b = buf.b[:at]; binary.NativeEndian.PutUint16(buf.b[lastAt+6:], flags) }()
	if err := w.setSendBuffer(len(buf.b)); err != nil {
		return err
	}
	if err := w.send(buf.b); err != nil {
		return fmt.Errorf("nf_tables %s: send a batch of %d messages: %w", s.table, len(s.whats), err)
	}
	var refused error
	for {
		replies, err := w.receive()
		if errors.Is(err, syscall.ENOBUFS) {
			// Only refusals and one acknowledgement come back, so answers
			// that overflow the socket are refusals: the batch was undone.
			return &nftBatchError{table: s.table, what: "a batch of " + fmt.Sprint(len(s.whats)) + " messages (too many refusals to read)", err: syscall.ENOBUFS}
		}
		if err != nil {
			return fmt.Errorf("nf_tables %s: %w", s.table, err)
		}
		for _, r := range replies {
			if r.Header.Type != syscall.NLMSG_ERROR || r.Header.Seq < begin || r.Header.Seq > last {
				continue
			}
			if errno := replyErrno(r.Data); errno != nil && refused == nil {
				what := "begin a batch"
				if i := int(r.Header.Seq - s.firstSeq); r.Header.Seq >= s.firstSeq && i < len(s.whats) {
					what = s.whats[i].String()
				}
				refused = &nftBatchError{table: s.table, what: what, err: errno.(syscall.Errno)}
			}
			if r.Header.Seq == last || r.Header.Seq == begin {
				return refused
			}
		}
	}
}

// lastMessage is the offset of the last netlink message in b.
func lastMessage(b []byte) int {
	at := 0
	for {
		size := int(binary.NativeEndian.Uint32(b[at:]))
		next := at + align4(size)
		if next >= len(b) {
			return at
		}
		at = next
	}
}

// setSendBuffer makes the socket take a batch of size bytes in one sendmsg
// (the kernel refuses a message longer than the send buffer).
func (w *nftReader) setSendBuffer(size int) error {
	const floor = 1 << 20
	size = max(size+4096, floor)
	var serr error
	if err := w.raw.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUFFORCE, size)
	}); err != nil {
		return err
	}
	if serr != nil {
		return w.conn.SetWriteBuffer(size)
	}
	return nil
}
