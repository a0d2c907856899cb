package netfilter

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/mdlayher/netlink"
)

// ChangeKind is what one nf_tables notification says happened.
type ChangeKind uint8

const (
	RuleAdded ChangeKind = iota + 1
	RuleDeleted
	ChainAdded
	ChainDeleted
	TableAdded
	TableDeleted
)

func (k ChangeKind) String() string {
	return [...]string{"?", "rule added", "rule deleted", "chain added", "chain deleted", "table added", "table deleted"}[min(int(k), 6)]
}

// Change is one change made to a table of the watched family (Chain is empty
// for a table), by anyone, kpipe included.
type Change struct {
	Kind         ChangeKind
	Table, Chain string
}

// ErrLost says that notifications were lost (the socket's buffer overflowed):
// anything may have changed.
var ErrLost = errors.New("nf_tables notifications lost")

// ErrNotNFTables says that the family's iptables is the legacy backend, whose
// tables send no nf_tables notifications.
var ErrNotNFTables = errors.New("iptables is not the nf_tables backend")

// Subscription receives the nf_tables changes made to one family's tables by
// anyone, kpipe included. Who wrote a change is not told: the kernel stamps each
// notification with the writer's netlink port id, which is a pid for a process's
// first socket, but pids (and ports, which any socket may bind) are reused by
// other containers in the host network namespace, each numbering its own pids,
// and a foreign change taken for kpipe's own would go unrepaired. Commit tells
// the two apart by comparing the chains named with what it wrote.
type Subscription struct {
	r      *nftReader
	family uint8
}

// nfnlGroupNFTables is NFNLGRP_NFTABLES, the multicast group of nf_tables changes.
const nfnlGroupNFTables = 7

// notifyBuffer is the socket's receive buffer: a flush of a 10k-service nat table
// sends one notification per rule (tens of megabytes); what does not fit is lost
// and reported as ErrLost.
const notifyBuffer = 32 << 20

// Subscribe starts receiving the changes made to t's family's tables. It fails
// with ErrNotNFTables on the legacy backend.
func (t Tool) Subscribe(ctx context.Context) (*Subscription, error) {
	nft, err := t.onNFTables(ctx)
	if err != nil {
		return nil, err
	}
	if !nft {
		return nil, ErrNotNFTables
	}
	conn, err := netlink.Dial(syscall.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("nf_tables netlink: %w", err)
	}
	raw, err := conn.SyscallConn()
	if err == nil {
		err = conn.JoinGroup(nfnlGroupNFTables)
	}
	if err == nil {
		err = setReadBuffer(conn, raw, notifyBuffer)
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("subscribe to nf_tables changes: %w", err)
	}
	return &Subscription{r: &nftReader{conn: conn, raw: raw, buf: make([]byte, recvSize)}, family: nfproto(t.Family)}, nil
}

// setReadBuffer asks for size bytes, beyond net.core.rmem_max when the process
// may (SO_RCVBUFFORCE), else as much as rmem_max allows.
func setReadBuffer(conn *netlink.Conn, raw syscall.RawConn, size int) error {
	var forceErr error
	if err := raw.Control(func(fd uintptr) {
		forceErr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUFFORCE, size)
	}); err != nil {
		return err
	}
	if forceErr == nil {
		return nil
	}
	return conn.SetReadBuffer(size)
}

// Close stops the subscription.
func (s *Subscription) Close() error { return s.r.conn.Close() }

// Next waits until ctx ends or the family's tables changed, and returns those
// changes (kpipe's own among them). ErrLost says that some changes were lost;
// the subscription goes on.
func (s *Subscription) Next(ctx context.Context) ([]Change, error) {
	stop := context.AfterFunc(ctx, func() { s.r.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := s.r.conn.SetReadDeadline(time.Time{}); err != nil {
		return nil, err
	}
	for {
		msgs, err := s.r.receive()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if errors.Is(err, syscall.ENOBUFS) {
			return nil, ErrLost
		}
		if err != nil {
			return nil, err
		}
		var out []Change
		for _, m := range msgs {
			if c, ok := s.decode(m); ok {
				out = append(out, c)
			}
		}
		if len(out) > 0 {
			return out, nil
		}
	}
}

// decode reads one notification: what changed in which table and chain of the
// subscription's family.
func (s *Subscription) decode(m syscall.NetlinkMessage) (Change, bool) {
	if m.Header.Type>>8 != nfnlSubsysNFTables || len(m.Data) < nfgenmsgLen || m.Data[0] != s.family {
		return Change{}, false
	}
	var c Change
	tableAttr, chainAttr := uint16(nftaRuleTable), uint16(nftaRuleChain)
	switch m.Header.Type & 0xff {
	case nftMsgNewRule:
		c.Kind = RuleAdded
	case nftMsgDelRule:
		c.Kind = RuleDeleted
	case nftMsgNewChain:
		c.Kind, tableAttr, chainAttr = ChainAdded, nftaChainTable, nftaChainName
	case nftMsgDelChain:
		c.Kind, tableAttr, chainAttr = ChainDeleted, nftaChainTable, nftaChainName
	case nftMsgNewTable:
		c.Kind, tableAttr, chainAttr = TableAdded, nftaTableName, 0
	case nftMsgDelTable:
		c.Kind, tableAttr, chainAttr = TableDeleted, nftaTableName, 0
	default:
		return Change{}, false
	}
	err := forEachAttr(m.Data[nfgenmsgLen:], func(typ uint16, v []byte) error {
		switch typ {
		case tableAttr:
			c.Table = string(cString(v))
		case chainAttr:
			c.Chain = string(cString(v))
		}
		return nil
	})
	return c, err == nil && c.Table != ""
}
