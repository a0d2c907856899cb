package netfilter

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/vishvananda/netlink"
)

// LocalAddrs lists the addresses on this host's interfaces.
func LocalAddrs() ([]netip.Addr, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list local addresses: %w", err)
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// SubscribeAddrs signals on the returned channel whenever an address is added or
// removed, until done is closed.
func SubscribeAddrs(done <-chan struct{}) (<-chan netlink.AddrUpdate, error) {
	ch := make(chan netlink.AddrUpdate, 16)
	if err := netlink.AddrSubscribe(ch, done); err != nil {
		return nil, fmt.Errorf("subscribe to address changes: %w", err)
	}
	return ch, nil
}

// Sysctls reads and writes sysctls under Root: /proc/sys on a host (HostSysctls),
// a directory of files in tests, which must not change the host's.
type Sysctls struct{ Root string }

// HostSysctls are this host's (and network namespace's) sysctls.
var HostSysctls = Sysctls{Root: "/proc/sys"}

// Read reads a sysctl such as "net/netfilter/nf_conntrack_tcp_be_liberal".
func (s Sysctls) Read(name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(s.Root, name))
	if err != nil {
		return "", fmt.Errorf("read sysctl %s: %w", name, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// Write sets a sysctl if it does not have the value already (a sysctl that is
// read-only here, but set, is then no error).
func (s Sysctls) Write(name, value string) error {
	if cur, err := s.Read(name); err == nil && cur == value {
		return nil
	}
	if err := os.WriteFile(filepath.Join(s.Root, name), []byte(value), 0o644); err != nil {
		return fmt.Errorf("set sysctl %s=%s: %w", name, value, err)
	}
	return nil
}

// ReadSysctl reads one of this host's sysctls.
func ReadSysctl(name string) (string, error) { return HostSysctls.Read(name) }

// WriteSysctl sets one of this host's sysctls if it does not have the value already.
func WriteSysctl(name, value string) error { return HostSysctls.Write(name, value) }

// RouteTo is how this host reaches dst: the interface it leaves on and the
// source address the host would give it (invalid when the route names none).
func RouteTo(dst netip.Addr) (iface string, src netip.Addr, err error) {
	routes, err := netlink.RouteGet(dst.AsSlice())
	if err != nil || len(routes) == 0 {
		return "", netip.Addr{}, fmt.Errorf("no route to %s: %v", dst, err)
	}
	src, _ = netip.AddrFromSlice(routes[0].Src)
	link, err := netlink.LinkByIndex(routes[0].LinkIndex)
	if err != nil {
		return "", src.Unmap(), fmt.Errorf("the interface of the route to %s: %w", dst, err)
	}
	return link.Attrs().Name, src.Unmap(), nil
}
