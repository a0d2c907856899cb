package netfilter

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"github.com/mdlayher/netlink"
)

// The nfacct objects (named packet and byte counters in the kernel, one set per
// network namespace) that kube-proxy's iptables mode counts packets in with
// `-m nfacct --nfacct-name`. kpipe uses the same names, so a node swapped from
// one to the other keeps counting in the same objects.
const (
	// NFAcctInvalidDropped counts the packets KUBE-FORWARD drops as conntrack INVALID.
	NFAcctInvalidDropped = "ct_state_invalid_dropped_pkts"
	// NFAcctLocalhostNodePorts counts the packets accepted for NodePorts on 127.0.0.0/8.
	NFAcctLocalhostNodePorts = "localhost_nps_accepted_pkts"
)

// NFAcctNames are the nfacct objects kpipe ensures, as kube-proxy does.
var NFAcctNames = []string{NFAcctInvalidDropped, NFAcctLocalhostNodePorts}

// nfnetlink_acct, from the kernel's uapi linux/netfilter/nfnetlink_acct.h and nfnetlink.h.
const (
	nfnlSubsysAcct = 7 // NFNL_SUBSYS_ACCT
	nfnlMsgAcctNew = 0 // NFNL_MSG_ACCT_NEW
	nfnlMsgAcctGet = 1 // NFNL_MSG_ACCT_GET
	nfacctAttrName = 1 // NFACCT_NAME: NUL-terminated string
	nfacctAttrPkts = 2 // NFACCT_PKTS: big-endian u64
	nfacctMaxName  = 31
)

// ErrNoNFAcct says that no nfacct object has the name asked for.
var ErrNoNFAcct = errors.New("no such nfacct object")

// NFAcct reads and creates nfacct objects in one network namespace over
// nfnetlink. Each call opens its own socket, so the zero value is ready and safe
// for concurrent use.
type NFAcct struct {
	// NetNS is a file descriptor of the network namespace; 0 is the calling
	// thread's.
	NetNS int
}

// Ensure creates the object name unless it exists. It never resets the counters
// of one that exists.
func (a NFAcct) Ensure(name string) error {
	_, err := a.execute(nfnlMsgAcctNew, netlink.Acknowledge|netlink.Create|netlink.Excl, name)
	if errors.Is(err, syscall.EEXIST) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("create nfacct object %s: %w", name, err)
	}
	return nil
}

// Packets is the packet counter of the object name (ErrNoNFAcct if there is none).
func (a NFAcct) Packets(name string) (uint64, error) {
	// The kernel marks its answer multipart but ends it with nothing: the
	// acknowledgement asked for is what ends it.
	msgs, err := a.execute(nfnlMsgAcctGet, netlink.Acknowledge, name)
	if errors.Is(err, syscall.ENOENT) {
		return 0, fmt.Errorf("nfacct object %s: %w", name, ErrNoNFAcct)
	}
	if err != nil {
		return 0, fmt.Errorf("read nfacct object %s: %w", name, err)
	}
	for _, m := range msgs {
		if m.Header.Type != netlink.HeaderType(nfnlSubsysAcct<<8|nfnlMsgAcctNew) || len(m.Data) < nfgenmsgLen {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[nfgenmsgLen:])
		if err != nil {
			return 0, fmt.Errorf("read nfacct object %s: %w", name, err)
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == nfacctAttrPkts {
				return ad.Uint64(), nil
			}
		}
		if err := ad.Err(); err != nil {
			return 0, fmt.Errorf("read nfacct object %s: %w", name, err)
		}
	}
	return 0, fmt.Errorf("read nfacct object %s: the kernel's answer has no packet counter", name)
}

// execute sends one nfnetlink_acct request about name and returns the answers.
func (a NFAcct) execute(msgType int, flags netlink.HeaderFlags, name string) ([]netlink.Message, error) {
	if name == "" || len(name) > nfacctMaxName {
		return nil, fmt.Errorf("nfacct object name %q: want 1 to %d bytes", name, nfacctMaxName)
	}
	ae := netlink.NewAttributeEncoder()
	ae.String(nfacctAttrName, name)
	attrs, err := ae.Encode()
	if err != nil {
		return nil, err
	}
	conn, err := netlink.Dial(syscall.NETLINK_NETFILTER, &netlink.Config{NetNS: a.NetNS})
	if err != nil {
		return nil, fmt.Errorf("nfnetlink: %w", err)
	}
	defer conn.Close()
	return conn.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(nfnlSubsysAcct<<8 | msgType), Flags: netlink.Request | flags},
		Data:   append([]byte{syscall.AF_UNSPEC, 0, 0, 0}, attrs...), // nfgenmsg: NFNETLINK_V0, res_id 0
	})
}
