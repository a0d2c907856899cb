package main

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/mdlayher/netlink"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// nf_tables netlink: the multicast group of ruleset changes, the subsystem,
// and the message that ends every committed transaction.
const (
	nfnlGroupNFTables  = 7  // NFNLGRP_NFTABLES
	nfnlSubsysNFTables = 10 // NFNL_SUBSYS_NFTABLES
	nftMsgNewGen       = 15 // NFT_MSG_NEWGEN
	notifyBuffer       = 64 << 20
)

// writeCounter counts, from the kernel's nf_tables notifications in one
// namespace, the transactions committed there and the bytes of what they
// changed (each notification carries the rule, chain, set or element
// written, in the netlink encoding the writer sent it in). `nft monitor` does
// the same but cannot keep up: with a 1,000-service iptables ruleset it
// reports nothing for half a minute.
type writeCounter struct {
	conn    *netlink.Conn
	done    chan struct{}
	stopped sync.Once

	mu           sync.Mutex
	transactions int
	bytes        int
	lost         bool // the socket's buffer overflowed: counts are low
	err          error
}

func countWrites(tb *testbed.Testbed, ns string) (*writeCounter, error) {
	var conn *netlink.Conn
	err := tb.InNamespace(ns, func() error {
		var err error
		conn, err = netlink.Dial(syscall.NETLINK_NETFILTER, nil)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("nf_tables netlink in %s: %w", ns, err)
	}
	if err := conn.JoinGroup(nfnlGroupNFTables); err != nil {
		conn.Close()
		return nil, fmt.Errorf("join nf_tables notifications: %w", err)
	}
	raw, err := conn.SyscallConn()
	if err == nil {
		cerr := raw.Control(func(fd uintptr) {
			err = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUFFORCE, notifyBuffer)
		})
		err = errors.Join(err, cerr)
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("notification buffer: %w", err)
	}
	w := &writeCounter{conn: conn, done: make(chan struct{})}
	go w.read()
	return w, nil
}

func (w *writeCounter) read() {
	defer close(w.done)
	for {
		msgs, err := w.conn.Receive()
		w.mu.Lock()
		if errors.Is(err, syscall.ENOBUFS) {
			w.lost = true
			w.mu.Unlock()
			continue
		}
		if err != nil {
			w.err = err
			w.mu.Unlock()
			return
		}
		for _, m := range msgs {
			if uint16(m.Header.Type)>>8 != nfnlSubsysNFTables {
				continue
			}
			if uint16(m.Header.Type)&0xff == nftMsgNewGen {
				w.transactions++
			} else {
				w.bytes += int(m.Header.Length)
			}
		}
		w.mu.Unlock()
	}
}

// stop ends the counting and returns the counts; called again, it returns
// them again.
func (w *writeCounter) stop() (transactions, bytes int, lost bool) {
	w.stopped.Do(func() {
		time.Sleep(200 * time.Millisecond) // let the reader take what is queued
		w.conn.Close()
		<-w.done
	})
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.transactions, w.bytes, w.lost
}
