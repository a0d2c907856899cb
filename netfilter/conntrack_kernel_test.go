package netfilter

import (
	"fmt"
	"os/exec"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// Each family's pass reads only that family's flows from the kernel: an IPv4 pass
// does not carry the IPv6 table (and the other way round).
func TestConntrackDumpsOnlyItsFamily(t *testing.T) {
	if _, err := exec.LookPath("conntrack"); err != nil {
		netnstest.Unavailable(t, "conntrack not installed (go tool task setup)")
	}
	netnstest.New(t).Run(t, func() error {
		for _, args := range [][]string{
			{"-I", "-p", "udp", "-s", "10.0.0.1", "-d", "10.96.0.10", "--sport", "40001", "--dport", "53", "-t", "120"},
			{"-I", "-p", "udp", "-s", "fd00::1", "-d", "fd00:10:96::10", "--sport", "40002", "--dport", "53", "-t", "120"},
		} {
			if out, err := exec.Command("conntrack", args...).CombinedOutput(); err != nil {
				netnstest.Unavailable(t, fmt.Sprintf("conntrack %v: %v %s", args, err, out))
			}
		}
		c, err := DialConntrack()
		if err != nil {
			return err
		}
		defer c.Close()
		for _, family := range []bus.Family{bus.IPv4, bus.IPv6} {
			flows, err := c.flows(family)
			if err != nil {
				return err
			}
			seen := map[bus.Family]int{}
			for _, f := range flows {
				seen[bus.FamilyOf(f.TupleOrig.IP.DestinationAddress)]++
			}
			if seen[family] != 1 || len(flows) != 1 {
				return fmt.Errorf("the %v dump holds %v flows by family; want only the one %v flow", family, seen, family)
			}
		}
		return nil
	})
}
