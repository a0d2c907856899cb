package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// freshRuns numbers the fresh kpipes of a run (their namespaces and logs).
var freshRuns atomic.Int64

// CompareWithFresh answers "does the node's kernel hold exactly what a fresh
// kpipe would write for the current API state?". It runs a second kpipe (see
// FreshRules), then dumps the node's rules, and returns Diff of the two: ""
// when they are equal. The API state must not change meanwhile.
func (tb *Testbed) CompareWithFresh() (string, error) {
	want, err := tb.FreshRules()
	if err != nil {
		return "", err
	}
	got, err := tb.NodeRules()
	if err != nil {
		return "", err
	}
	return Diff(want, got, "fresh kpipe", "node"), nil
}

// NodeRules is kpipe's part of the node namespace's nat and filter tables.
func (tb *Testbed) NodeRules() (RuleDump, error) { return tb.dumpRules(tb.NodeNS) }

// FreshRules starts a second kpipe, the same binary with the same flags as the
// test bed's (its defaults plus the extra flags of its current start), in a new
// network namespace holding nothing but loopback, where it has netfilter tables
// of its own. It reaches the apiserver through a relay (see relayAPIServer),
// renders for the same Node (--hostname-override), and once it has synced (see
// Kpipe.WaitSynced) its rules are dumped, normalized, and it and its namespace
// are removed.
//
// What could legitimately differ between the two namespaces is made the same
// or refused: nf_conntrack_tcp_be_liberal (it decides the INVALID drop rule)
// is copied from the node; --nodeport-addresses with CIDRs is refused, as the
// rules then depend on the node's local addresses, which the fresh namespace
// does not have.
func (tb *Testbed) FreshRules() (_ RuleDump, err error) {
	k := tb.Kpipe()
	if k == nil {
		return RuleDump{}, errors.New("fresh kpipe: the test bed's kpipe was never built")
	}
	args := k.CurrentArgs()
	if cidrs := nodePortAddresses(args); cidrs != "" && cidrs != "primary" {
		return RuleDump{}, fmt.Errorf("fresh kpipe: kpipe runs with --nodeport-addresses=%s: its rules depend on the node's local addresses, which a fresh namespace does not have", cidrs)
	}
	n := freshRuns.Add(1)
	node, err := tb.NewFreshNode(fmt.Sprintf("fresh%d", n))
	if err != nil {
		return RuleDump{}, fmt.Errorf("fresh kpipe: %w", err)
	}
	ns := node.NS
	defer func() {
		if rerr := node.Close(); rerr != nil && err == nil {
			err = fmt.Errorf("fresh kpipe: remove its namespace: %w", rerr)
		}
	}()
	if err := tb.copyLiberalSysctl(ns); err != nil {
		return RuleDump{}, fmt.Errorf("fresh kpipe: %w", err)
	}

	fresh := &Kpipe{tb: tb, Bin: k.Bin, LogPath: tb.path(fmt.Sprintf("kpipe-fresh%d.log", n)), Args: args, ns: ns}
	if err := fresh.Start(); err != nil {
		_ = fresh.Stop()
		return RuleDump{}, fmt.Errorf("fresh kpipe in %s: %w", ns, err)
	}
	dump, err := tb.dumpRules(ns)
	if stopErr := fresh.Stop(); stopErr != nil && err == nil {
		err = fmt.Errorf("fresh kpipe in %s: stop: %w\n--- log (%s):\n%s", ns, stopErr, fresh.LogPath, fresh.LogTail(20))
	}
	return dump, err
}

// nodePortAddresses is the value of --nodeport-addresses in args ("" if absent).
func nodePortAddresses(args []string) string {
	v := ""
	for i, a := range args {
		switch {
		case strings.HasPrefix(a, "--nodeport-addresses="):
			v = strings.TrimPrefix(a, "--nodeport-addresses=")
		case a == "--nodeport-addresses" && i+1 < len(args):
			v = args[i+1]
		}
	}
	return v
}

// copyLiberalSysctl gives namespace ns the node's nf_conntrack_tcp_be_liberal.
func (tb *Testbed) copyLiberalSysctl(ns string) error {
	const name = "net.netfilter.nf_conntrack_tcp_be_liberal"
	v, err := tb.Exec(tb.NodeNS, "sysctl", "-n", name)
	if err != nil {
		return err
	}
	_, err = tb.Exec(ns, "sysctl", "-q", "-w", name+"="+strings.TrimSpace(v))
	return err
}

// relayAPIServer listens on 127.0.0.1:6443 in namespace ns and relays every
// connection, bytes unchanged (TLS passes through), to the apiserver on
// 127.0.0.1:6443 in the node namespace: the kubeconfig kpipe uses works as it
// is, and nothing is added to the node namespace. It returns a function that
// closes the listener and every relayed connection.
func (tb *Testbed) relayAPIServer(ns string) (stop func(), err error) {
	addr := joinHostPort("127.0.0.1", APIServerPort)
	var ln net.Listener
	if err := tb.InNamespace(ns, func() error {
		var err error
		ln, err = net.Listen("tcp", addr)
		return err
	}); err != nil {
		return nil, fmt.Errorf("relay to the apiserver: listen in %s: %w", ns, err)
	}
	var (
		mu     sync.Mutex
		conns  []net.Conn
		closed bool
		wg     sync.WaitGroup
	)
	keep := func(c net.Conn) bool {
		mu.Lock()
		defer mu.Unlock()
		if closed {
			c.Close()
			return false
		}
		conns = append(conns, c)
		return true
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			if !keep(in) {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				out, err := tb.DialContext(ctx, tb.NodeNS, "tcp", addr)
				cancel()
				if err != nil {
					in.Close()
					return
				}
				if !keep(out) {
					in.Close()
					return
				}
				pipe(in, out)
			}()
		}
	}()
	return func() {
		ln.Close()
		mu.Lock()
		closed = true
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}, nil
}

// pipe copies both ways until either side ends, then closes both.
func pipe(a, b net.Conn) {
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		done <- struct{}{}
	}
	go cp(a, b)
	go cp(b, a)
	<-done
	a.Close()
	b.Close()
	<-done
}

// dumpRules is kpipe's part of the nat and filter tables of namespace ns, both
// families.
func (tb *Testbed) dumpRules(ns string) (RuleDump, error) {
	var d RuleDump
	for _, f := range []struct{ family, save string }{{"ipv4", "iptables-save"}, {"ipv6", "ip6tables-save"}} {
		for _, table := range []string{"nat", "filter"} {
			out, err := tb.Exec(ns, f.save, "-t", table)
			if err != nil {
				return RuleDump{}, err
			}
			if err := d.NormalizeSave(f.family, out); err != nil {
				return RuleDump{}, fmt.Errorf("%s -t %s in %s: %w", f.save, table, ns, err)
			}
		}
	}
	return d, nil
}
