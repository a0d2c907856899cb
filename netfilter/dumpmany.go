package netfilter

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"github.com/mdlayher/netlink"
)

// dumpChains calls each with every rule of each named chain of the table, a
// chain's rules in the kernel's order; a chain that is not there is left out.
//
// One dump per chain: a dump of the whole table costs the square of its size
// (the kernel resumes each part by walking the table from its start), a
// chain's dump only that chain. Requests cannot share a send: a dump ends only
// when the reader asks for its second part, and until then the socket refuses
// the next dump (EBUSY). So each chain takes one send and two receives, none
// of which waits (the kernel answers while the call runs), on a socket of its
// own, with nothing allocated per chain.
func (n *nftReader) dumpChains(names []string, each func(attrs []byte) error) error {
	var req nlBuf
	for _, chain := range names {
		req.b = req.b[:0]
		n.seq++
		at := req.msg(nfnlSubsysNFTables<<8|nftMsgGetRule, syscall.NLM_F_REQUEST|syscall.NLM_F_DUMP, n.seq, n.family, 0)
		req.str(nftaRuleTable, n.table)
		req.str(nftaRuleChain, chain)
		req.done(at)
		if err := n.send(req.b); err != nil {
			return fmt.Errorf("nf_tables rules of %s %s: %w", n.table, chain, err)
		}
		if err := n.readDump(n.seq, each); err != nil && !errors.Is(err, syscall.ENOENT) {
			return fmt.Errorf("nf_tables rules of %s %s: %w", n.table, chain, err)
		}
	}
	return nil
}

// send sends one buffer of requests.
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

// readDump reads the answers to the dump request seq to its end, calling each
// with every rule; the first error wins. Answers to other requests are skipped.
func (n *nftReader) readDump(seq uint32, each func(attrs []byte) error) error {
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
			flags := binary.NativeEndian.Uint16(b[6:])
			msgSeq := binary.NativeEndian.Uint32(b[8:])
			data := b[syscall.NLMSG_HDRLEN:size]
			b = b[min(len(b), align4(size)):]
			if msgSeq != seq {
				continue // a late answer to an earlier request
			}
			if flags&uint16(netlink.DumpInterrupted) != 0 {
				keep(errChanged)
			}
			switch typ {
			case syscall.NLMSG_DONE, syscall.NLMSG_ERROR:
				keep(replyErrno(data))
				return first
			case nfnlSubsysNFTables<<8 | nftMsgNewRule:
				if len(data) < nfgenmsgLen {
					keep(fmt.Errorf("nf_tables reply of %d bytes", len(data)))
				} else {
					keep(each(data[nfgenmsgLen:]))
				}
			}
		}
	}
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
