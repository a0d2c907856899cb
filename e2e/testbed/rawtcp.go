package testbed

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"syscall"
)

// TCP header flags, for SendTCPSegment.
const (
	TCPFin = 0x01
	TCPSyn = 0x02
	TCPRst = 0x04
	TCPPsh = 0x08
	TCPAck = 0x10
)

// SendTCPSegment sends one hand-made TCP segment (no payload, the given
// flags, a correct checksum) from namespace ns, source src, to dst:dport,
// through a raw IPv4 socket: the kernel adds the IP header and routes it as
// usual. It is for packets no socket would send, such as SYN+FIN.
func (tb *Testbed) SendTCPSegment(ns, src, dst string, sport, dport uint16, flags byte) error {
	s, err := netip.ParseAddr(src)
	if err != nil || !s.Is4() {
		return fmt.Errorf("send raw TCP: source %q is not an IPv4 address", src)
	}
	d, err := netip.ParseAddr(dst)
	if err != nil || !d.Is4() {
		return fmt.Errorf("send raw TCP: destination %q is not an IPv4 address", dst)
	}
	seg := make([]byte, 20)
	binary.BigEndian.PutUint16(seg[0:], sport)
	binary.BigEndian.PutUint16(seg[2:], dport)
	binary.BigEndian.PutUint32(seg[4:], rand.Uint32())
	seg[12] = 5 << 4 // data offset: 5 words, no options
	seg[13] = flags
	binary.BigEndian.PutUint16(seg[14:], 64240) // window
	binary.BigEndian.PutUint16(seg[16:], tcpChecksum(s.As4(), d.As4(), seg))

	return tb.InNamespace(ns, func() error {
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_TCP)
		if err != nil {
			return fmt.Errorf("send raw TCP: socket: %w", err)
		}
		defer syscall.Close(fd)
		if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: s.As4()}); err != nil {
			return fmt.Errorf("send raw TCP: bind %s: %w", src, err)
		}
		if err := syscall.Sendto(fd, seg, 0, &syscall.SockaddrInet4{Addr: d.As4()}); err != nil {
			return fmt.Errorf("send raw TCP to %s: %w", dst, err)
		}
		return nil
	})
}

// tcpChecksum is the TCP checksum of seg (checksum field zero) over the IPv4
// pseudo-header.
func tcpChecksum(src, dst [4]byte, seg []byte) uint16 {
	var sum uint32
	add := func(b []byte) {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	add(src[:])
	add(dst[:])
	sum += uint32(syscall.IPPROTO_TCP)
	sum += uint32(len(seg))
	add(seg)
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
