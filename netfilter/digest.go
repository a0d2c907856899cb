package netfilter

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mdlayher/netlink"

	"github.com/kpipe/kpipe/bus"
)

// Digests returns, for each chain of table (all chains when names is nil; only
// those that exist when names is given), a digest of its rules as the kernel
// holds them: equal digests mean the same rules in the same order. Counters
// (which change with traffic) and rule handles are left out.
//
// On the nf_tables backend it reads the rules straight from the kernel over
// netlink: with names, one small dump per chain (0.2 ms for one chain, about
// 60 µs a chain for many, however large the table); without, one dump of the whole table, whose
// cost grows with the square of its size (0.3 s for 40,000 rules, 3.5 s for
// 120,000; iptables-save takes 1 s and 6.5 s). So ask by name. On the legacy backend
// it hashes what iptables -S (one name) or iptables-save print. The two kinds of
// digest are not comparable, so a process keeps to one kind per iptables binary:
// compare digests only with digests from the same process.
//
// Over netlink each chain's digest is of one state of that chain (not all
// chains of one state of the table). When another writer keeps changing the
// ruleset so that some chains cannot be read, the error is ErrBusy, with the
// digests of the others.
func (t Tool) Digests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	if names != nil && len(names) == 0 {
		return map[string]uint64{}, nil
	}
	nft, err := t.onNFTables(ctx)
	if err != nil {
		return nil, err
	}
	if nft {
		d, err := t.netlinkDigests(ctx, table, names)
		if !netlinkUnusable(err) {
			return d, err
		}
		// Netlink is closed to us (no permission, no nf_tables protocol):
		// iptables-save still works, and from now on this process uses it.
		backends.set(t.binary(""), false)
	}
	return t.savedDigests(ctx, table, names)
}

// Generation is the nf_tables ruleset generation, which every change of any
// table of any family bumps: a read made while it stood at one value still
// holds while it does. An error when the ruleset is not read over nf_tables
// netlink (the legacy backend, no permission).
func (t Tool) Generation(ctx context.Context) (uint32, error) {
	nft, err := t.onNFTables(ctx)
	if err != nil {
		return 0, err
	}
	if !nft {
		return 0, errors.New("not the nf_tables backend: no ruleset generation")
	}
	n, done, err := t.openReader(ctx, "")
	if err != nil {
		return 0, err
	}
	defer done()
	return n.generation()
}

// backendCache remembers, per iptables binary, whether it is the nf_tables backend.
// Only answers are remembered: a failed `iptables -V` is asked again next time.
type backendCache struct {
	mu  sync.Mutex
	nft map[string]bool
}

var backends = backendCache{nft: map[string]bool{}}

func (c *backendCache) get(binary string) (nft, known bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	nft, known = c.nft[binary]
	return nft, known
}

func (c *backendCache) set(binary string, nft bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.nft[binary] = nft
}

// onNFTables says whether t's iptables is the nf_tables backend: `iptables -V`
// prints "(nf_tables)" (iptables-legacy prints "(legacy)").
func (t Tool) onNFTables(ctx context.Context) (bool, error) {
	binary := t.binary("")
	if nft, known := backends.get(binary); known {
		return nft, nil
	}
	out, err := t.runTool(ctx, binary, nil, "-V")
	if err != nil {
		return false, fmt.Errorf("which iptables backend: %w", err)
	}
	nft := bytes.Contains(out, []byte("(nf_tables)"))
	backends.set(binary, nft)
	return nft, nil
}

// netlinkUnusable says whether err means that this process cannot use nf_tables
// netlink at all (rather than that one read failed).
func netlinkUnusable(err error) bool {
	for _, e := range []error{syscall.EPERM, syscall.EACCES, syscall.EPROTONOSUPPORT, syscall.EAFNOSUPPORT, syscall.EOPNOTSUPP} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// nfproto is the family's nf_tables protocol family.
func nfproto(f bus.Family) uint8 {
	if f == bus.IPv6 {
		return nfprotoIPv6
	}
	return nfprotoIPv4
}

// readTries bounds the reads in a row that settle no chain (another writer
// changed the ruleset during each), each after a longer wait than the last
// (readBackoff, doubled: 1.27 s in all), before a read gives up on the chains
// it has not settled.
const readTries = 8

// readBackoff is the wait after the first read that settled nothing.
const readBackoff = 10 * time.Millisecond

// errChanged says that the ruleset changed during a read, which is then unusable.
var errChanged = errors.New("nf_tables ruleset changed during the read")

// ErrBusy says that another writer kept changing the ruleset while Digests
// read it, so that some chains could not be read while it stood still. Digests
// returns it with the digests of the chains it could read: a caller can act on
// those and treat the others as unknown.
var ErrBusy = errors.New("the nf_tables ruleset kept changing during the read")

// recvSize is the receive buffer. The kernel fills at most 32 KiB per part of a
// dump, and only that much when the reader offers as much: with one page per
// part (mdlayher/netlink's Receive), a table of 40,000 rules takes 8,000 parts,
// and the kernel walks the table from its start again for each.
const recvSize = 64 << 10

// netlinkDigests reads the chains and rules of table from the kernel. The
// ruleset generation, which a change of any table of any family bumps, says
// whether a read stood still: chains by name are read one at a time, the
// generation after each, so a change costs a new read of only the chains from
// the one it came during; a whole table is read again whole.
func (t Tool) netlinkDigests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	n, done, err := t.openReader(ctx, table)
	if err != nil {
		return nil, err
	}
	defer done()
	d := make(map[string]uint64, len(names))
	todo, read := names, n.named
	if names == nil {
		todo, read = []string{""}, n.whole // "": the whole table
	}
	for tries := 1; len(todo) > 0; {
		left, err := read(todo, d)
		if ctx.Err() != nil {
			return nil, fmt.Errorf("read %s over netlink: %w", table, ctx.Err())
		}
		if err != nil {
			return nil, err
		}
		if len(left) < len(todo) {
			tries = 1 // settled some: go on at once
		} else if tries++; tries > readTries {
			break
		} else if err := sleep(ctx, readBackoff<<(tries-2)); err != nil {
			return nil, fmt.Errorf("read %s over netlink: %w", table, err)
		}
		todo = left
	}
	if len(todo) == 0 {
		return d, nil
	}
	if names == nil {
		return nil, fmt.Errorf("read %s over netlink: %w", table, ErrBusy)
	}
	return d, fmt.Errorf("read %s over netlink: %d of %d chains: %w", table, len(todo), len(names), ErrBusy)
}

// sleep waits for d or the end of ctx.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// openReader opens a netlink reader of table that ctx bounds; done closes it.
func (t Tool) openReader(ctx context.Context, table string) (n *nftReader, done func(), err error) {
	conn, err := netlink.Dial(syscall.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("nf_tables netlink: %w", err)
	}
	raw, err := conn.SyscallConn()
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	// A deadline in the past wakes a blocked read when ctx ends.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	if deadline, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(deadline); err != nil {
			stop()
			conn.Close()
			return nil, nil, err
		}
	}
	n = &nftReader{conn: conn, raw: raw, buf: make([]byte, recvSize), family: nfproto(t.Family), table: table, seq: 1 << 30}
	// Closing a netfilter netlink socket waits out an RCU grace period (about
	// 12 ms here, BenchmarkKernelOneChainWrite): not on the caller's time.
	return n, func() { stop(); go conn.Close() }, nil
}

// nftReader reads one nf_tables table of one family.
type nftReader struct {
	conn   *netlink.Conn
	raw    syscall.RawConn // conn's socket, read with buf
	buf    []byte
	family uint8
	table  string
	req    nlBuf  // the request being sent, its buffer reused
	seq    uint32 // of the last request; far from the writer's batches' numbers
}

// named reads the digests of the chains of names (those that exist) into d, in
// order, while the ruleset stands still: from the listing of the chains to the
// end of each chain's rules (the listing must still hold: a rule dump of a
// chain that went answers as an empty chain would). It returns the chains it
// did not settle: from the first one a change came during, to the end.
func (n *nftReader) named(names []string, d map[string]uint64) (left []string, err error) {
	start, err := n.generation()
	if err != nil {
		return nil, err
	}
	chains, err := n.chains(names)
	if err == nil {
		err = n.still(start)
	}
	if errors.Is(err, errChanged) {
		return names, nil
	}
	if err != nil {
		return nil, err
	}
	seen := map[uint64]struct{}{}
	for i, name := range names {
		h, ok := chains[name]
		if !ok {
			continue // not there when listed, and nothing changed since
		}
		err := n.hashRules(name, chains, seen)
		if err == nil {
			err = n.still(start)
		}
		if errors.Is(err, errChanged) {
			return names[i:], nil
		}
		if err != nil {
			return nil, err
		}
		d[name] = uint64(*h)
	}
	return nil, nil
}

// whole reads the digests of every chain of the table into d in one dump (the
// table's cost grows with the square of its size: see Digests), all or none:
// left is todo when the ruleset changed meanwhile.
func (n *nftReader) whole(todo []string, d map[string]uint64) (left []string, err error) {
	start, err := n.generation()
	if err != nil {
		return nil, err
	}
	chains, err := n.chains(nil)
	if err == nil && len(chains) > 0 {
		err = n.hashRules("", chains, map[uint64]struct{}{})
	}
	if err == nil {
		err = n.still(start)
	}
	if errors.Is(err, errChanged) {
		return todo, nil
	}
	if err != nil {
		return nil, err
	}
	for name, h := range chains {
		d[name] = uint64(*h)
	}
	return nil, nil
}

// still says errChanged unless the ruleset generation is still gen.
func (n *nftReader) still(gen uint32) error {
	now, err := n.generation()
	if err == nil && now != gen {
		err = errChanged
	}
	return err
}

// query sends one request (msgType with flags, its attributes written by
// attrs) and calls each with the attributes of every reply of type want, to
// the end of a dump or the single reply; the first error wins. A dump is
// always read to its end (the socket takes no new dump before), and one the
// kernel marks as interrupted is errChanged. Nothing is allocated per call:
// a restarted commit reads tens of thousands of chains one by one.
func (n *nftReader) query(msgType int, flags uint16, attrs func(*nlBuf), want int, each func(attrs []byte) error) error {
	n.req.b = n.req.b[:0]
	n.seq++
	at := n.req.msg(uint16(nfnlSubsysNFTables<<8|msgType), syscall.NLM_F_REQUEST|flags, n.seq, n.family, 0)
	if attrs != nil {
		attrs(&n.req)
	}
	n.req.done(at)
	if err := n.send(n.req.b); err != nil {
		return err
	}
	var first error
	keep := func(err error) {
		if first == nil {
			first = err
		}
	}
	for {
		b, err := n.receiveRaw()
		if err != nil {
			return err
		}
		for len(b) >= syscall.NLMSG_HDRLEN {
			size := int(binary.NativeEndian.Uint32(b))
			if size < syscall.NLMSG_HDRLEN || size > len(b) {
				return fmt.Errorf("nf_tables: a message of %d bytes in %d", size, len(b))
			}
			typ := binary.NativeEndian.Uint16(b[4:])
			msgFlags := binary.NativeEndian.Uint16(b[6:])
			seq := binary.NativeEndian.Uint32(b[8:])
			data := b[syscall.NLMSG_HDRLEN:size]
			b = b[min(len(b), align4(size)):]
			if seq != n.seq {
				continue // a late reply to an earlier request
			}
			if msgFlags&uint16(netlink.DumpInterrupted) != 0 {
				keep(errChanged)
			}
			switch typ {
			case syscall.NLMSG_ERROR, syscall.NLMSG_DONE:
				keep(replyErrno(data))
				return first
			case uint16(nfnlSubsysNFTables<<8 | want):
				if len(data) < nfgenmsgLen {
					keep(fmt.Errorf("nf_tables reply of %d bytes", len(data)))
				} else {
					keep(each(data[nfgenmsgLen:]))
				}
			}
			if msgFlags&syscall.NLM_F_MULTI == 0 {
				return first // a single reply, not a dump
			}
		}
	}
}

// send sends a buffer of messages.
func (n *nftReader) send(b []byte) error {
	var sendErr error
	if err := n.raw.Write(func(fd uintptr) bool {
		sendErr = syscall.Sendto(int(fd), b, 0, &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK})
		return sendErr != syscall.EAGAIN
	}); err != nil {
		return err
	}
	return sendErr
}

// receiveRaw reads the next datagram of messages into the reader's buffer.
func (n *nftReader) receiveRaw() ([]byte, error) {
	var size, flags int
	var recvErr error
	err := n.raw.Read(func(fd uintptr) bool {
		size, _, flags, _, recvErr = syscall.Recvmsg(int(fd), n.buf, nil, 0)
		return recvErr != syscall.EAGAIN
	})
	if err == nil {
		err = recvErr
	}
	if err != nil {
		return nil, fmt.Errorf("nf_tables netlink receive: %w", err)
	}
	if flags&syscall.MSG_TRUNC != 0 {
		return nil, fmt.Errorf("nf_tables netlink receive: a message longer than %d bytes", len(n.buf))
	}
	return n.buf[:size], nil
}

// receive reads the next batch of messages.
func (n *nftReader) receive() ([]syscall.NetlinkMessage, error) {
	b, err := n.receiveRaw()
	if err != nil {
		return nil, err
	}
	return syscall.ParseNetlinkMessage(b)
}

// replyErrno is the error an NLMSG_ERROR or NLMSG_DONE message carries (a negative
// errno first; 0 for none).
func replyErrno(data []byte) error {
	if len(data) < 4 {
		return nil
	}
	if code := int32(binary.NativeEndian.Uint32(data)); code < 0 {
		return syscall.Errno(-code)
	}
	return nil
}

// generation reads the ruleset generation, which every change of any table bumps.
func (n *nftReader) generation() (uint32, error) {
	var gen uint32
	err := n.query(nftMsgGetGen, 0, nil, nftMsgNewGen, func(attrs []byte) error {
		return forEachAttr(attrs, func(typ uint16, v []byte) error {
			if typ == nftaGenID && len(v) == 4 {
				gen = binary.BigEndian.Uint32(v)
			}
			return nil
		})
	})
	if err != nil {
		return 0, fmt.Errorf("nf_tables generation: %w", err)
	}
	return gen, nil
}

// chains returns an empty running hash for each chain of the table that is in
// names (every chain when names is nil; names is never empty).
func (n *nftReader) chains(names []string) (map[string]*digest, error) {
	chains := map[string]*digest{}
	var wanted map[string]bool
	if names != nil {
		wanted = make(map[string]bool, len(names))
		for _, name := range names {
			wanted[name] = true
		}
	}
	// Asked for one chain, the kernel says ENOENT when it is not there.
	var flags uint16 = syscall.NLM_F_DUMP
	if len(names) == 1 {
		flags = 0
	}
	err := n.query(nftMsgGetChain, flags, func(b *nlBuf) {
		b.str(nftaChainTable, n.table)
		if len(names) == 1 {
			b.str(nftaChainName, names[0])
		}
	}, nftMsgNewChain, func(attrs []byte) error {
		var table, name []byte
		err := forEachAttr(attrs, func(typ uint16, v []byte) error {
			switch typ {
			case nftaChainTable:
				table = cString(v)
			case nftaChainName:
				name = cString(v)
			}
			return nil
		})
		if err == nil && string(table) == n.table && (wanted == nil || wanted[string(name)]) {
			chains[string(name)] = newDigest()
		}
		return err
	})
	if errors.Is(err, syscall.ENOENT) { // the chain, or the whole table, is not there
		return map[string]*digest{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("nf_tables chains of %s: %w", n.table, err)
	}
	return chains, nil
}

// hashRules folds the rules of chain (of the whole table when chain is "")
// into the hashes of chains, in the kernel's order. A table's dump costs the
// square of its size (the kernel resumes each part of a dump by walking the
// table from its start), a chain's only that chain. The chains' dumps cannot
// share one send: a dump ends only when its reader asks for the part after its
// last, and until then the socket refuses the next dump (EBUSY; 64 requests a
// send measured 10× slower). So each chain takes a send and two receives,
// neither of which waits.
//
// Rules a dump part repeats are dropped (see eachRule).
func (n *nftReader) hashRules(chain string, chains map[string]*digest, seen map[uint64]struct{}) error {
	err := n.eachRule(chain, seen, func(r rule) error {
		if d, ok := chains[string(r.chain)]; ok && string(r.table) == n.table {
			return r.hashInto(d)
		}
		return nil
	})
	if errors.Is(err, syscall.ENOENT) { // the table went after the chains were listed
		return errChanged
	}
	if err != nil && !errors.Is(err, errChanged) {
		return fmt.Errorf("nf_tables rules of %s %s: %w", n.table, chain, err)
	}
	return err
}

// eachRule calls each with every rule of chain (of the whole table when chain
// is ""), once, in the kernel's order. The kernel resumes each part of a dump
// at a count of the rules it went through, counting the not yet committed
// rules of a writer's transaction too: when such rules come or go between two
// parts, the next part repeats rules (seen on 6.18), and the generation does
// not change. A rule's handle is unique in its table, so a repeat (a handle in
// seen, which eachRule fills) is dropped.
func (n *nftReader) eachRule(chain string, seen map[uint64]struct{}, each func(r rule) error) error {
	return n.dumpRules(chain, func(attrs []byte) error {
		r, err := decodeRule(attrs)
		if err != nil {
			return err
		}
		if _, repeat := seen[r.handle]; repeat {
			return nil
		}
		seen[r.handle] = struct{}{}
		return each(r)
	})
}

// dumpRules calls each with every rule of chain (of the whole table when chain
// is ""), in the kernel's order.
func (n *nftReader) dumpRules(chain string, each func(attrs []byte) error) error {
	return n.query(nftMsgGetRule, syscall.NLM_F_DUMP, func(b *nlBuf) {
		b.str(nftaRuleTable, n.table)
		if chain != "" {
			b.str(nftaRuleChain, chain)
		}
	}, nftMsgNewRule, each)
}

// forEachAttr calls f with the type and payload of each netlink attribute in b.
func forEachAttr(b []byte, f func(typ uint16, payload []byte) error) error {
	for len(b) > 0 {
		if len(b) < 4 {
			return errors.New("nf_tables: a truncated attribute")
		}
		size := int(binary.NativeEndian.Uint16(b))
		typ := binary.NativeEndian.Uint16(b[2:]) & attrTypeMask
		if size < 4 || size > len(b) {
			return fmt.Errorf("nf_tables: an attribute of %d bytes in %d", size, len(b))
		}
		if err := f(typ, b[4:size]); err != nil {
			return err
		}
		b = b[min(len(b), (size+3)&^3):] // attributes are 4-byte aligned
	}
	return nil
}

// attrTypeMask clears the nested and byte-order flags of an attribute's type.
const attrTypeMask = 0x3fff

// cString is a NUL-terminated string attribute, without the NUL (not copied).
func cString(b []byte) []byte {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		return b[:i]
	}
	return b
}

// rule is what of one nf_tables rule goes into a digest; its slices point into
// the receive buffer.
type rule struct {
	table, chain []byte
	handle       uint64 // not hashed: a rewrite gives a rule a new one
	exprs        []byte // NFTA_RULE_EXPRESSIONS: a list of expressions
	compat       []byte // NFTA_RULE_COMPAT: the protocol an xt match was checked for
	userdata     []byte // NFTA_RULE_USERDATA: nft's comments (iptables-nft 1.8.9 writes an xt comment match instead)
}

func decodeRule(attrs []byte) (rule, error) {
	var r rule
	err := forEachAttr(attrs, func(typ uint16, v []byte) error {
		switch typ {
		case nftaRuleTable:
			r.table = cString(v)
		case nftaRuleChain:
			r.chain = cString(v)
		case nftaRuleHandle:
			if len(v) != 8 {
				return fmt.Errorf("nf_tables: a rule handle of %d bytes", len(v))
			}
			r.handle = binary.BigEndian.Uint64(v)
		case nftaRuleExpressions:
			r.exprs = v
		case nftaRuleCompat:
			r.compat = v
		case nftaRuleUserdata:
			r.userdata = v
		}
		return nil
	})
	return r, err
}

// hashInto folds r into d: each expression's name and data, but a counter's
// (counters change with traffic, not with the rule), then compat and userdata.
// Every part goes in tagged and length-prefixed, so no two different rule lists
// hash the same bytes.
func (r rule) hashInto(d *digest) error { return r.hashAs(d, nil) }

// hashAs is hashInto with each expression's data first rewritten by asDumped
// (when not nil): to hash a rule as the kernel would list it.
func (r rule) hashAs(d *digest, asDumped func(name, data []byte) []byte) error {
	var h fieldHash
	h.SetSeed(digestSeed)
	err := forEachAttr(r.exprs, func(typ uint16, elem []byte) error {
		if typ != nftaListElem {
			return nil
		}
		var name, data []byte
		err := forEachAttr(elem, func(typ uint16, v []byte) error {
			switch typ {
			case nftaExprName:
				name = cString(v)
			case nftaExprData:
				data = v
			}
			return nil
		})
		if err != nil || string(name) == "counter" {
			return err
		}
		if asDumped != nil {
			data = asDumped(name, data)
		}
		h.writeField('E', name)
		h.writeField('D', data)
		return nil
	})
	h.writeField('C', r.compat)
	h.writeField('U', r.userdata)
	d.fold(h.Sum64())
	return err
}

// digest is a chain's hash: its rules' hashes folded in, in order.
type digest uint64

// digestSeed seeds every rule's hash: digests compare within one process.
var digestSeed = maphash.MakeSeed()

func newDigest() *digest {
	d := digest(14695981039346656037) // FNV-64's offset basis
	return &d
}

// fold adds the next rule's hash, the way FNV-64a adds a byte.
func (d *digest) fold(h uint64) {
	*d = (*d ^ digest(h)) * 1099511628211
}

// fieldHash hashes a rule's parts.
type fieldHash struct{ maphash.Hash }

// writeField writes a tag, the length of b, then b.
func (h *fieldHash) writeField(tag byte, b []byte) {
	var head [5]byte
	head[0] = tag
	binary.BigEndian.PutUint32(head[1:], uint32(len(b)))
	h.Write(head[:])
	h.Write(b)
}

// savedDigests hashes the "-A" lines iptables prints (never with counters): of
// one chain with iptables -S CHAIN, else of the table with iptables-save, which
// reads the table at once (chain by chain, a writer could come between).
func (t Tool) savedDigests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	d := map[string]uint64{}
	if len(names) == 1 {
		rules, err := t.ListChain(ctx, table, names[0])
		if errors.Is(err, ErrNoChain) {
			return d, nil
		}
		if err != nil {
			return nil, err
		}
		d[names[0]] = hashLines(rules)
		return d, nil
	}
	saved, err := t.Save(ctx, table)
	if err != nil {
		return nil, err
	}
	if names == nil {
		for name, rules := range saved {
			d[name] = hashLines(rules)
		}
		return d, nil
	}
	for _, name := range names {
		if rules, ok := saved[name]; ok {
			d[name] = hashLines(rules)
		}
	}
	return d, nil
}

func hashLines(lines []string) uint64 {
	d := newDigest()
	for _, l := range lines {
		d.fold(maphash.String(digestSeed, strings.TrimSpace(l)))
	}
	return uint64(*d)
}

// ChainNames lists the chains of table: over netlink on the nf_tables backend
// (one chain dump, no rules: milliseconds however large the table), else from
// iptables-save.
func (t Tool) ChainNames(ctx context.Context, table string) ([]string, error) {
	nft, err := t.onNFTables(ctx)
	if err != nil {
		return nil, err
	}
	if nft {
		names, err := t.netlinkChainNames(ctx, table)
		if !netlinkUnusable(err) {
			return names, err
		}
		backends.set(t.binary(""), false)
	}
	return t.Chains(ctx, table)
}

func (t Tool) netlinkChainNames(ctx context.Context, table string) ([]string, error) {
	n, done, err := t.openReader(ctx, table)
	if err != nil {
		return nil, err
	}
	defer done()
	chains, err := n.chains(nil)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(chains))
	for name := range chains {
		names = append(names, name)
	}
	slices.Sort(names)
	return names, nil
}

// OnNFTables says whether family's iptables is the nf_tables backend (false
// when iptables does not answer).
func OnNFTables(family bus.Family) bool {
	ctx, cancel := context.WithTimeout(context.Background(), versionWait)
	defer cancel()
	nft, err := Tool{Family: family}.onNFTables(ctx)
	return err == nil && nft
}
