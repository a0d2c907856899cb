package netfilter

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	tnf "github.com/ti-mo/netfilter"

	"github.com/kpipe/kpipe/bus"
)

// Conntrack deletes conntrack flows through netlink.
type Conntrack struct {
	conn *conntrack.Conn
	dump *tnf.Conn // for dumps of one family, which conntrack.Conn cannot ask for
}

// DialConntrack opens a netlink connection to conntrack in this network namespace.
func DialConntrack() (*Conntrack, error) {
	c, err := conntrack.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("open conntrack netlink: %w", err)
	}
	d, err := tnf.Dial(nil)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("open conntrack netlink: %w", err)
	}
	return &Conntrack{conn: c, dump: d}, nil
}

// Close closes the netlink connections.
func (c *Conntrack) Close() error { return errors.Join(c.conn.Close(), c.dump.Close()) }

// ctMsgGet is IPCTNL_MSG_CT_GET (linux/netfilter/nfnetlink_conntrack.h).
const ctMsgGet = 1

// flows dumps the conntrack flows of family f: the kernel filters by the family
// of the request (conntrack.Conn.Dump asks for both, so each family's pass would
// read the whole table).
func (c *Conntrack) flows(f bus.Family) ([]conntrack.Flow, error) {
	family := tnf.ProtoIPv4
	if f == bus.IPv6 {
		family = tnf.ProtoIPv6
	}
	req, err := tnf.MarshalNetlink(tnf.Header{SubsystemID: tnf.NFSubsysCTNetlink, MessageType: ctMsgGet,
		Family: family, Flags: netlink.Request | netlink.Dump}, nil)
	if err != nil {
		return nil, err
	}
	msgs, err := c.dump.Query(req)
	if err != nil {
		return nil, err
	}
	flows := make([]conntrack.Flow, 0, len(msgs))
	for _, m := range msgs {
		var ev conntrack.Event // the kernel sends each dumped flow as a NEW message
		if err := ev.Unmarshal(m); err != nil {
			return nil, fmt.Errorf("decode conntrack flow: %w", err)
		}
		flows = append(flows, *ev.Flow)
	}
	return flows, nil
}

// StaleUDP decides whether a UDP flow must go: it was sent to a front-end (a service
// IP:port, or any local address on a node port) that now load-balances to other
// endpoints, or to a front-end that no longer exists.
type StaleUDP struct {
	Family bus.Family
	// Now maps each UDP front-end to its endpoints; NodePorts use the unspecified address.
	Now map[netip.AddrPort][]netip.AddrPort
	// Gone are front-ends that were programmed before and are not now.
	Gone map[netip.AddrPort]bool
	// IsLocal says whether an address is on this host (node ports match only those).
	IsLocal func(netip.Addr) bool
}

// ClearStaleUDP deletes the UDP flows of family that StaleUDP marks and returns how
// many it deleted.
func (c *Conntrack) ClearStaleUDP(s StaleUDP) (int, error) {
	flows, err := c.flows(s.Family)
	if err != nil {
		return 0, fmt.Errorf("dump conntrack flows: %w", err)
	}
	deleted := 0
	for _, f := range flows {
		if f.TupleOrig.Proto.Protocol != syscall.IPPROTO_UDP {
			continue
		}
		if !s.stale(f) {
			continue
		}
		if err := c.conn.Delete(f); err != nil {
			continue // gone already (it timed out or another delete won): nothing to do
		}
		deleted++
	}
	return deleted, nil
}

func (s StaleUDP) stale(f conntrack.Flow) bool {
	dst := netip.AddrPortFrom(f.TupleOrig.IP.DestinationAddress.Unmap(), f.TupleOrig.Proto.DestinationPort)
	// Who actually answers: the reply tuple's source (the endpoint after DNAT, or the
	// front-end itself when nothing translated it).
	answerer := netip.AddrPortFrom(f.TupleReply.IP.SourceAddress.Unmap(), f.TupleReply.Proto.SourcePort)
	// Node ports are front-ends only on this host's addresses, whether they exist
	// now or went away: a flow to a remote address on the same port is not ours.
	local := s.IsLocal != nil && s.IsLocal(dst.Addr())
	nodePort := netip.AddrPortFrom(unspecified(s.Family), dst.Port())
	endpoints, ok := s.Now[dst]
	if !ok && local {
		endpoints, ok = s.Now[nodePort]
	}
	if !ok {
		return s.Gone[dst] || (local && s.Gone[nodePort])
	}
	for _, ep := range endpoints {
		if ep == answerer {
			return false
		}
	}
	return true
}

func unspecified(f bus.Family) netip.Addr {
	if f == bus.IPv6 {
		return netip.IPv6Unspecified()
	}
	return netip.IPv4Unspecified()
}
