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

// ReadSysctl reads a sysctl such as "net/netfilter/nf_conntrack_tcp_be_liberal".
func ReadSysctl(name string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/proc/sys", name))
	if err != nil {
		return "", fmt.Errorf("read sysctl %s: %w", name, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// WriteSysctl sets a sysctl if it does not have the value already.
func WriteSysctl(name, value string) error {
	if cur, err := ReadSysctl(name); err == nil && cur == value {
		return nil
	}
	if err := os.WriteFile(filepath.Join("/proc/sys", name), []byte(value), 0o644); err != nil {
		return fmt.Errorf("set sysctl %s=%s: %w", name, value, err)
	}
	return nil
}
