package netfilter

import (
	"errors"
	"fmt"
	"net"
	"os/exec"
	"testing"

	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// In a fresh network namespace: an object that is not there reads as
// ErrNoNFAcct; Ensure creates it; an iptables rule counts packets in it, read
// back exactly; Ensure again keeps the object and its counters.
func TestNFAcctEnsureAndRead(t *testing.T) {
	if _, err := exec.LookPath("iptables"); err != nil {
		netnstest.Unavailable(t, "iptables not installed (go tool task setup)")
	}
	netnstest.New(t).Run(t, func() error {
		var a NFAcct
		if _, err := a.Packets(NFAcctInvalidDropped); !errors.Is(err, ErrNoNFAcct) {
			return fmt.Errorf("before Ensure: Packets = %v; want ErrNoNFAcct", err)
		}
		for _, name := range NFAcctNames {
			if err := a.Ensure(name); err != nil {
				return err
			}
		}
		if n, err := a.Packets(NFAcctInvalidDropped); err != nil || n != 0 {
			return fmt.Errorf("new object: Packets = %d, %v; want 0", n, err)
		}
		for _, args := range [][]string{
			{"ip", "link", "set", "lo", "up"},
			{"iptables", "-w", "-A", "OUTPUT", "-o", "lo", "-p", "udp", "--dport", "9", "-m", "nfacct", "--nfacct-name", NFAcctInvalidDropped},
		} {
			if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
				return fmt.Errorf("%v: %v\n%s", args, err, out)
			}
		}
		const sent = 7
		// Unconnected, so that no port-unreachable answer fails a later send.
		conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			return err
		}
		defer conn.Close()
		for i := 0; i < sent; i++ {
			if _, err := conn.WriteTo([]byte("x"), &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}); err != nil {
				return err
			}
		}
		if n, err := a.Packets(NFAcctInvalidDropped); err != nil || n != sent {
			return fmt.Errorf("after %d datagrams: Packets = %d, %v; want %d", sent, n, err, sent)
		}
		if err := a.Ensure(NFAcctInvalidDropped); err != nil {
			return fmt.Errorf("Ensure of an existing object: %w", err)
		}
		if n, err := a.Packets(NFAcctInvalidDropped); err != nil || n != sent {
			return fmt.Errorf("after Ensure again: Packets = %d, %v; want %d kept", n, err, sent)
		}
		if n, err := a.Packets(NFAcctLocalhostNodePorts); err != nil || n != 0 {
			return fmt.Errorf("the other object: Packets = %d, %v; want 0", n, err)
		}
		return nil
	})
}

func TestNFAcctRejectsBadNames(t *testing.T) {
	for _, name := range []string{"", "a-name-longer-than-thirty-one-bytes"} {
		if err := (NFAcct{}).Ensure(name); err == nil {
			t.Errorf("Ensure(%q) = nil; want an error", name)
		}
	}
}
