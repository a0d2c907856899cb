package bus

import (
	"net/netip"
	"time"
)

// Change is one event from watch to coalesce (through a ChangeQueue). Exactly one
// field group is set: Service (Key, Service: nil means deleted), Slice (Key,
// SliceName, Slice: nil means deleted; EarlierTrigger), Node, Addrs, or Replay (the
// full current state, which replaces what coalesce holds).
type Change struct {
	Kind      ChangeKind
	Key       ServiceKey
	Service   *Service
	SliceName string
	Slice     *EndpointSlice
	Node      *Node
	Replay    *State
	Addrs     []netip.Addr // LocalAddrsChanged: every address on this host's interfaces
	// EarlierTrigger is the earliest EndpointSlice trigger time of the changes to
	// this slice this one replaced in the queue (zero: none).
	EarlierTrigger time.Time
}

// ChangeKind says what a Change carries.
type ChangeKind int

const (
	ServiceChanged ChangeKind = iota
	SliceChanged
	NodeChanged
	Replayed
	LocalAddrsChanged
)

// State is the whole desired state: what watch replays and what a snapshot holds.
type State struct {
	Services map[ServiceKey]*Service
	Slices   map[ServiceKey]map[string]*EndpointSlice // by slice name
	Node     *Node                                    // nil until the Node is seen
	// LocalAddrs are the addresses on this host's interfaces (from netlink), for
	// --nodeport-addresses.
	LocalAddrs []netip.Addr
}
