package testbed

import (
	"errors"
	"fmt"
	"strings"
)

// FreshNode is a network namespace holding nothing but loopback, where the
// apiserver answers at its usual address (through relayAPIServer): a node of
// its own for a proxy, with netfilter tables nobody else wrote, reached with
// the test bed's kubeconfig as it is.
type FreshNode struct {
	NS        string
	tb        *Testbed
	stopRelay func()
	peers     []string // namespaces AddPeer linked to it
}

// NewFreshNode makes a fresh node namespace named after role (unique per
// test bed). Close removes it and whatever runs in it.
func (tb *Testbed) NewFreshNode(role string) (*FreshNode, error) {
	ns := tb.nsName(role)
	if err := tb.addNamespace(ns); err != nil {
		return nil, fmt.Errorf("fresh node %s: %w", ns, err)
	}
	stop, err := tb.relayAPIServer(ns)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("fresh node %s: %w", ns, err), tb.removeNamespace(ns))
	}
	return &FreshNode{NS: ns, tb: tb, stopRelay: stop}, nil
}

// Start runs argv in the namespace (through `ip netns exec`, which execs in
// place: the process is argv[0] itself), output appended to the run dir's
// file <name>.log. The process is stopped by Close at the latest.
func (n *FreshNode) Start(name string, argv ...string) (*Process, error) {
	p, err := startProcess(name, n.tb.path(name+".log"), nil, append([]string{"ip", "netns", "exec", n.NS}, argv...)...)
	if err != nil {
		return nil, err
	}
	n.tb.track(p)
	return p, nil
}

// Exec runs argv in the namespace and returns its standard output.
func (n *FreshNode) Exec(argv ...string) (string, error) { return n.tb.Exec(n.NS, argv...) }

// AddPeer makes a namespace (named after role, at most 13 characters) linked
// to the node by a veth pair: the node's end, "kp"+role, has nodeCIDR, the
// peer's, eth0, peerCIDR, and the peer's default route leads to the node.
// The node does not forward unless told to. Close removes the peer with the
// node.
func (n *FreshNode) AddPeer(role, nodeCIDR, peerCIDR string) (string, error) {
	ns := n.tb.nsName(role)
	if err := n.tb.addNamespace(ns); err != nil {
		return "", fmt.Errorf("peer %s: %w", ns, err)
	}
	n.peers = append(n.peers, ns)
	nodeAddr, _, _ := strings.Cut(nodeCIDR, "/")
	dev := "kp" + role
	steps := [][]string{
		{n.NS, "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", ns},
		{n.NS, "addr", "add", nodeCIDR, "dev", dev},
		{n.NS, "link", "set", dev, "up"},
		{ns, "addr", "add", peerCIDR, "dev", "eth0"},
		{ns, "link", "set", "eth0", "up"},
		{ns, "route", "add", "default", "via", nodeAddr},
	}
	for _, s := range steps {
		if err := n.tb.ip(s[0], s[1:]...); err != nil {
			return "", fmt.Errorf("peer %s: %w", ns, err)
		}
	}
	return ns, nil
}

// Close stops the relay and deletes the namespace and its peers, killing
// what still runs there.
func (n *FreshNode) Close() error {
	n.stopRelay()
	errs := []error{n.tb.removeNamespace(n.NS)}
	for _, ns := range n.peers {
		errs = append(errs, n.tb.removeNamespace(ns))
	}
	return errors.Join(errs...)
}
