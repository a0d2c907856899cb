package testbed

import (
	"errors"
	"fmt"
)

// FreshNode is a network namespace holding nothing but loopback, where the
// apiserver answers at its usual address (through relayAPIServer): a node of
// its own for a proxy, with netfilter tables nobody else wrote, reached with
// the test bed's kubeconfig as it is.
type FreshNode struct {
	NS        string
	tb        *Testbed
	stopRelay func()
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

// Close stops the relay and deletes the namespace, killing what still runs
// there.
func (n *FreshNode) Close() error {
	n.stopRelay()
	return n.tb.removeNamespace(n.NS)
}
