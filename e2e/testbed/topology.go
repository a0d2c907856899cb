package testbed

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Addresses of the test bed's network. The product's own tests rely on them.
const (
	NodeName = "kpe2e-node"

	NodeIPv4   = "198.51.100.1"
	NodeIPv6   = "2001:db8:1::1"
	ClientIPv4 = "198.51.100.2"
	ClientIPv6 = "2001:db8:1::2"

	BridgeName  = "kpbr0"
	BridgeIPv4  = "10.244.0.1"
	BridgeIPv6  = "fd00:10:244::1"
	PodCIDRIPv4 = "10.244.0.0/24"
	PodCIDRIPv6 = "fd00:10:244::/64"
	ClusterCIDR = "10.244.0.0/16"

	ServiceCIDRs    = "10.96.0.0/16,fd00:10:96::/112"
	ServiceCIDRIPv4 = "10.96.0.0/16"
	ServiceCIDRIPv6 = "fd00:10:96::/112"

	// ExternalRangeIPv4 and ExternalRangeIPv6 are where tests take
	// load-balancer ingress IPs and externalIPs from. No interface has them:
	// the client routes them to the node, which DNATs what is addressed to a
	// service and sends the rest back to the client (which drops it).
	ExternalRangeIPv4 = "203.0.113.0/24"
	ExternalRangeIPv6 = "2001:db8:2::/64"

	// EchoPort is where every pod's echo server listens (TCP and UDP).
	EchoPort = 8080
)

// Pod is a network namespace on the node's bridge running an echo server.
type Pod struct {
	N    int    // 1-based
	NS   string // network namespace
	IPv4 string
	IPv6 string
	Veth string // node-side interface on the bridge

	echo *Process
}

// Addr4 is "ipv4:port".
func (p *Pod) Addr4(port int) string { return joinHostPort(p.IPv4, port) }

// Addr6 is "[ipv6]:port".
func (p *Pod) Addr6(port int) string { return joinHostPort(p.IPv6, port) }

func podIPv4(n int) string { return fmt.Sprintf("10.244.0.%d", 10+n) }
func podIPv6(n int) string { return fmt.Sprintf("fd00:10:244::%d", 10+n) }

func (tb *Testbed) nsName(role string) string { return NamePrefix + tb.ID + "-" + role }

// addNamespace creates a namespace, records it for cleanup and sets the
// sysctls every namespace of the test bed wants.
func (tb *Testbed) addNamespace(name string) error {
	if _, err := Run("ip", "netns", "add", name); err != nil {
		return err
	}
	tb.mu.Lock()
	tb.namespaces = append(tb.namespaces, name)
	tb.mu.Unlock()
	// tcp_timestamps=2: TCP timestamps without Linux's random offset per
	// destination address. A client's destination is a ClusterIP before DNAT,
	// and its loops reuse source ports across ClusterIPs that DNAT to the
	// same pod, which holds the 4-tuple in TIME_WAIT (the echo server closes
	// first): with a per-ClusterIP offset half the reused SYNs look older than
	// the last segment there, are refused (PAWS) and retried, and two in a row
	// overrun a test's 2 s. One clock per namespace keeps them newer.
	if _, err := tb.Exec(name, "sysctl", "-q", "-w",
		"net.ipv6.conf.all.accept_dad=0",
		"net.ipv6.conf.default.accept_dad=0",
		"net.ipv4.tcp_timestamps=2",
	); err != nil {
		return err
	}
	_, err := tb.Exec(name, "ip", "link", "set", "lo", "up")
	return err
}

// removeNamespace deletes a namespace made by addNamespace before the test
// bed ends (killing what still runs in it) and forgets it.
func (tb *Testbed) removeNamespace(name string) error {
	tb.handles.drop(name)
	err := deleteNamespace(name)
	tb.mu.Lock()
	tb.namespaces = slices.DeleteFunc(tb.namespaces, func(ns string) bool { return ns == name })
	tb.mu.Unlock()
	return err
}

func (tb *Testbed) ip(ns string, args ...string) error {
	_, err := Run(append([]string{"ip", "-n", ns}, args...)...)
	return err
}

func (tb *Testbed) buildTopology(pods int) error {
	tb.NodeNS = tb.nsName("node")
	tb.ClientNS = tb.nsName("client")
	for _, ns := range []string{tb.NodeNS, tb.ClientNS} {
		if err := tb.addNamespace(ns); err != nil {
			return err
		}
	}
	if _, err := tb.Exec(tb.NodeNS, "sysctl", "-q", "-w",
		"net.ipv4.ip_forward=1",
		"net.ipv6.conf.all.forwarding=1",
		"net.bridge.bridge-nf-call-iptables=1",
		"net.bridge.bridge-nf-call-ip6tables=1",
		// The kernel sends at most ~6 ICMP errors in a burst to one host, then
		// one a second: tests that hit a REJECT rule in quick succession would
		// see the kernel's throttling instead of kpipe's rules.
		"net.ipv4.icmp_ratelimit=0",
		"net.ipv6.icmp.ratelimit=0",
	); err != nil {
		return err
	}
	node, client := tb.NodeNS, tb.ClientNS
	steps := [][]string{
		// node <-> client
		{node, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", client},
		{node, "addr", "add", NodeIPv4 + "/24", "dev", "eth0"},
		{node, "addr", "add", NodeIPv6 + "/64", "dev", "eth0", "nodad"},
		{node, "link", "set", "eth0", "up"},
		{client, "addr", "add", ClientIPv4 + "/24", "dev", "eth0"},
		{client, "addr", "add", ClientIPv6 + "/64", "dev", "eth0", "nodad"},
		{client, "link", "set", "eth0", "up"},
		{client, "route", "add", "default", "via", NodeIPv4},
		{client, "-6", "route", "add", "default", "via", NodeIPv6},
		// The default routes already lead there; these say it outright (as a
		// router that knows the service range and the load balancers' VIPs would).
		{client, "route", "add", ServiceCIDRIPv4, "via", NodeIPv4},
		{client, "route", "add", ExternalRangeIPv4, "via", NodeIPv4},
		{client, "-6", "route", "add", ServiceCIDRIPv6, "via", NodeIPv6},
		{client, "-6", "route", "add", ExternalRangeIPv6, "via", NodeIPv6},
		// The node's default route leads to the client namespace, as a real
		// node's leads to its gateway: traffic to a ClusterIP that is not
		// translated goes there and is dropped (the client does not forward).
		{node, "route", "add", "default", "via", ClientIPv4},
		{node, "-6", "route", "add", "default", "via", ClientIPv6},
		// the pod bridge
		{node, "link", "add", BridgeName, "type", "bridge", "forward_delay", "0", "stp_state", "0", "mcast_snooping", "0"},
		{node, "addr", "add", BridgeIPv4 + "/24", "dev", BridgeName},
		{node, "addr", "add", BridgeIPv6 + "/64", "dev", BridgeName, "nodad"},
		{node, "link", "set", BridgeName, "up"},
	}
	for _, s := range steps {
		if err := tb.ip(s[0], s[1:]...); err != nil {
			return fmt.Errorf("build topology: %w", err)
		}
	}
	for n := 1; n <= pods; n++ {
		if err := tb.addPodNetwork(n); err != nil {
			return fmt.Errorf("build topology: pod %d: %w", n, err)
		}
	}
	return nil
}

func (tb *Testbed) addPodNetwork(n int) error {
	p := &Pod{
		N:    n,
		NS:   tb.nsName("pod" + strconv.Itoa(n)),
		IPv4: podIPv4(n),
		IPv6: podIPv6(n),
		Veth: "kpveth" + strconv.Itoa(n),
	}
	if err := tb.addNamespace(p.NS); err != nil {
		return err
	}
	node := tb.NodeNS
	steps := [][]string{
		{node, "link", "add", p.Veth, "type", "veth", "peer", "name", "eth0", "netns", p.NS},
		{node, "link", "set", p.Veth, "master", BridgeName},
		// hairpin: a pod reaching itself through a ClusterIP
		{node, "link", "set", p.Veth, "type", "bridge_slave", "hairpin", "on"},
		{node, "link", "set", p.Veth, "up"},
		{p.NS, "addr", "add", p.IPv4 + "/24", "dev", "eth0"},
		{p.NS, "addr", "add", p.IPv6 + "/64", "dev", "eth0", "nodad"},
		{p.NS, "link", "set", "eth0", "up"},
		{p.NS, "route", "add", "default", "via", BridgeIPv4},
		{p.NS, "-6", "route", "add", "default", "via", BridgeIPv6},
	}
	for _, s := range steps {
		if err := tb.ip(s[0], s[1:]...); err != nil {
			return err
		}
	}
	tb.Pods = append(tb.Pods, p)
	return nil
}

// startEchoServers starts the echo server in every pod and waits until each
// answers from the node namespace.
func (tb *Testbed) startEchoServers(bin string) error {
	for _, p := range tb.Pods {
		proc, err := startProcess("echoserver "+p.NS, tb.path(fmt.Sprintf("echo-pod%d.log", p.N)), nil,
			"ip", "netns", "exec", p.NS, bin, "-port", strconv.Itoa(EchoPort), "-addr", p.IPv4, "-addr", p.IPv6)
		if err != nil {
			return err
		}
		p.echo = proc
		tb.track(proc)
	}
	for _, p := range tb.Pods {
		deadline := time.Now().Add(20 * time.Second)
		for {
			_, err := tb.DialTCP(tb.NodeNS, p.Addr4(EchoPort), time.Second)
			if err == nil {
				break
			}
			if p.echo.Exited() || time.Now().After(deadline) {
				return fmt.Errorf("echo server of pod %d not answering: %w\n--- %s:\n%s", p.N, err, p.echo.LogPath, p.echo.Tail(20))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// Pod returns pod n (1-based).
func (tb *Testbed) Pod(n int) *Pod { return tb.Pods[n-1] }

// AddAddress adds address cidr (e.g. "198.51.100.3/24") to interface dev of
// namespace ns, without duplicate address detection for IPv6. The caller
// removes it (DelAddress).
func (tb *Testbed) AddAddress(ns, dev, cidr string) error {
	args := []string{"addr", "add", cidr, "dev", dev}
	if strings.Contains(cidr, ":") {
		args = append(args, "nodad")
	}
	if err := tb.ip(ns, args...); err != nil {
		return fmt.Errorf("add address %s to %s in %s: %w", cidr, dev, ns, err)
	}
	return nil
}

// DelAddress removes address cidr from interface dev of namespace ns.
func (tb *Testbed) DelAddress(ns, dev, cidr string) error {
	if err := tb.ip(ns, "addr", "del", cidr, "dev", dev); err != nil {
		return fmt.Errorf("remove address %s from %s in %s: %w", cidr, dev, ns, err)
	}
	return nil
}
