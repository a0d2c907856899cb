package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"github.com/mdlayher/netlink"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter"
)

// nf_tables netlink: a chain's query and its attributes (linux/netfilter/nf_tables.h).
const (
	nftMsgGetChain  = 4 // NFT_MSG_GETCHAIN
	nftaChainTable  = 1 // NFTA_CHAIN_TABLE
	nftaChainName   = 3 // NFTA_CHAIN_NAME
	nftaChainUse    = 6 // NFTA_CHAIN_USE: its rules and the rules and map elements jumping to it
	nfprotoIPv4     = 2 // NFPROTO_IPV4: iptables-nft's tables and kube-proxy's "ip kube-proxy"
	nfnetlinkV0     = 0
	nftIPTablesNAT  = "nat"
	nftKubeProxyNft = "kube-proxy"
)

// reached reports whether s's chain exists and something jumps to it: a
// packet can reach it. A deleted service's chain may outlive it unreached
// (kube-proxy's iptables mode deletes stale chains only now and then over
// 1,000 endpoints), and a new one could be written before the rule that
// leads to it: the dispatch is what makes a service exist for packets. The
// kernel counts in a chain's use its rules and the rules and map elements
// jumping to it, so the jumps are its use less its rules, read in that
// order: a rule written or deleted between the two reads can only make a
// deleted chain look reached, never the other way. Only a ClusterIP
// service's chain is reached from the dispatch alone (a NodePort's also from
// its KUBE-EXT- chain, which may outlive it too).
func (k kernel) reached(s *benchService) (bool, error) {
	table := nftIPTablesNAT
	if k.nft {
		table = nftKubeProxyNft
	}
	chain := k.chain(s)
	var (
		use   uint32
		found bool
		rules [][]string
	)
	err := k.tb.InNamespace(k.node.NS, func() (err error) {
		if use, found, err = chainUse(table, chain); err != nil || !found {
			return err
		}
		rules, err = netfilter.Tool{Family: bus.IPv4}.ChainExpressions(context.Background(), table, chain)
		return err
	})
	if err != nil {
		return false, fmt.Errorf("chain %s of table %s: %w", chain, table, err)
	}
	return found && int(use) > len(rules), nil
}

// chainUse is the kernel's use count of chain in the IPv4 table (false when
// there is no such chain), asked in the calling thread's network namespace.
func chainUse(table, chain string) (use uint32, found bool, err error) {
	conn, err := netlink.Dial(syscall.NETLINK_NETFILTER, nil)
	if err != nil {
		return 0, false, err
	}
	// Closing waits out an RCU grace period (~12 ms): not on a poll's time.
	defer func() { go conn.Close() }()
	ae := netlink.NewAttributeEncoder()
	ae.String(nftaChainTable, table)
	ae.String(nftaChainName, chain)
	attrs, err := ae.Encode()
	if err != nil {
		return 0, false, err
	}
	msgs, err := conn.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(nfnlSubsysNFTables<<8 | nftMsgGetChain), Flags: netlink.Request},
		Data:   append([]byte{nfprotoIPv4, nfnetlinkV0, 0, 0}, attrs...),
	})
	if errors.Is(err, syscall.ENOENT) {
		return 0, false, nil
	}
	if err != nil || len(msgs) != 1 || len(msgs[0].Data) < 4 {
		return 0, false, fmt.Errorf("%d messages, %v", len(msgs), err)
	}
	ad, err := netlink.NewAttributeDecoder(msgs[0].Data[4:]) // after the nfgenmsg header
	if err != nil {
		return 0, false, err
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		if ad.Type() == nftaChainUse {
			use = ad.Uint32()
		}
	}
	return use, true, ad.Err()
}
