package main

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

const (
	firstPackets   = 500 // connections a first-packet series makes
	connectTimeout = 2 * time.Second
)

// Addresses of the path a first packet takes: a client pod on the node
// (inside the cluster CIDR, so no proxy masquerades it), and a namespace
// standing for every other node, which holds the remote pods' addresses
// (see otherPods) and is routed to over a link of its own.
const (
	clientNodeSide = "10.244.0.1/24"
	clientPod      = "10.244.0.2/24"
	remoteNodeSide = "192.0.2.1/30"
	remoteSide     = "192.0.2.2/30"
)

// otherPods cover the remote pods' addresses, 10.244.1.0-10.244.255.255
// (randomIPs): the remote namespace holds them as local routes (AnyIP), so
// one listener answers for every endpoint, and 10.244.0.0/24, the client's,
// stays routed back to the node.
var otherPods = []string{
	"10.244.1.0/24", "10.244.2.0/23", "10.244.4.0/22", "10.244.8.0/21",
	"10.244.16.0/20", "10.244.32.0/19", "10.244.64.0/18", "10.244.128.0/17",
}

// packetPath is a client pod and the other nodes' pods around a fresh node:
// a connection from the client to a ClusterIP is DNATed by the proxy's rules
// in the node's PREROUTING, as a pod's is, and answered by whichever remote
// endpoint the rules chose.
type packetPath struct {
	tb     *testbed.Testbed
	client string // the client pod's namespace
	ln     net.Listener
}

// newPacketPath builds the path around node; role names its namespaces.
func newPacketPath(tb *testbed.Testbed, node *testbed.FreshNode, role string) (*packetPath, error) {
	if _, err := node.Exec("sysctl", "-q", "-w", "net.ipv4.ip_forward=1"); err != nil {
		return nil, err
	}
	client, err := node.AddPeer("cl"+role, clientNodeSide, clientPod)
	if err != nil {
		return nil, err
	}
	remote, err := node.AddPeer("rm"+role, remoteNodeSide, remoteSide)
	if err != nil {
		return nil, err
	}
	remoteAddr, _, _ := net.ParseCIDR(remoteSide)
	if _, err := node.Exec("ip", "route", "add", testbed.ClusterCIDR, "via", remoteAddr.String()); err != nil {
		return nil, err
	}
	for _, prefix := range otherPods {
		if _, err := tb.Exec(remote, "ip", "route", "add", "local", prefix, "dev", "lo"); err != nil {
			return nil, err
		}
	}
	p := &packetPath{tb: tb, client: client}
	err = tb.InNamespace(remote, func() (err error) {
		p.ln, err = net.Listen("tcp4", ":"+strconv.Itoa(testbed.EchoPort))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen for the remote pods: %w", err)
	}
	go p.accept()
	return p, nil
}

// accept takes every connection and closes it: a connect only needs the
// handshake, which the kernel completes.
func (p *packetPath) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		c.Close()
	}
}

func (p *packetPath) close() { p.ln.Close() }

// connectTimes connects from the client pod to each of targets in turn
// (cycled through to firstPackets connections), each a new connection, so
// its first packet walks the rules to its DNAT, and returns how long each
// connect took, sorted.
func (p *packetPath) connectTimes(targets []netip.AddrPort) ([]time.Duration, error) {
	out := make([]time.Duration, 0, firstPackets)
	for i := range firstPackets {
		t := targets[i%len(targets)]
		d, err := p.connect(t)
		if err != nil {
			return nil, fmt.Errorf("connect from the client pod to %s: %w", t, err)
		}
		out = append(out, d)
	}
	slices.Sort(out)
	return out, nil
}

// connect is one blocking connect(2) from the client pod to addr, timed
// around the system call alone; the socket is closed with a reset, leaving
// no TIME_WAIT behind.
func (p *packetPath) connect(addr netip.AddrPort) (took time.Duration, err error) {
	err = p.tb.InNamespace(p.client, func() error {
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer syscall.Close(fd)
		if err := syscall.SetsockoptLinger(fd, syscall.SOL_SOCKET, syscall.SO_LINGER, &syscall.Linger{Onoff: 1}); err != nil {
			return err
		}
		tv := syscall.NsecToTimeval(connectTimeout.Nanoseconds())
		if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv); err != nil {
			return err
		}
		start := time.Now()
		err = syscall.Connect(fd, &syscall.SockaddrInet4{Port: int(addr.Port()), Addr: addr.Addr().As4()})
		took = time.Since(start)
		return err
	})
	return took, err
}

// clusterTargets are the services' ClusterIPs and ports, shuffled: each
// connection goes to another service, as far as there are services.
func clusterTargets(svcs []*benchService) []netip.AddrPort {
	out := make([]netip.AddrPort, 0, len(svcs))
	for _, s := range svcs {
		out = append(out, netip.AddrPortFrom(netip.MustParseAddr(s.clusterIP()), servicePort))
	}
	rand.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// endpointTargets are one endpoint of each service, shuffled: the same
// path without a ClusterIP, for the floor measured before any proxy runs.
func endpointTargets(svcs []*benchService) []netip.AddrPort {
	out := make([]netip.AddrPort, 0, len(svcs))
	for _, s := range svcs {
		out = append(out, netip.AddrPortFrom(netip.MustParseAddr(s.want()[0]), testbed.EchoPort))
	}
	rand.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}
