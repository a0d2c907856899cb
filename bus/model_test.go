package bus_test

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

func TestAddrsOfKeepsOneFamilyInOrder(t *testing.T) {
	addrs := []netip.Addr{
		netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("fd00::1"), netip.MustParseAddr("::ffff:10.0.0.1"),
		netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("2001:db8::1"),
	}
	v4 := []netip.Addr{addrs[0], addrs[2], addrs[3]} // an IPv4-mapped address is IPv4 (FamilyOf)
	if got := bus.AddrsOf(bus.IPv4, addrs); !slices.Equal(got, v4) {
		t.Errorf("AddrsOf(IPv4) = %v; want %v", got, v4)
	}
	v6 := []netip.Addr{addrs[1], addrs[4]}
	if got := bus.AddrsOf(bus.IPv6, addrs); !slices.Equal(got, v6) {
		t.Errorf("AddrsOf(IPv6) = %v; want %v", got, v6)
	}
	if got := bus.AddrsOf(bus.IPv6, addrs[:1]); got != nil {
		t.Errorf("AddrsOf with none of the family = %v; want nil", got)
	}
}

func TestPrefixesOfKeepsOneFamilyInOrder(t *testing.T) {
	ps := []netip.Prefix{
		netip.MustParsePrefix("fd00:10:244::/48"), netip.MustParsePrefix("10.244.0.0/16"),
		netip.MustParsePrefix("::/0"), netip.MustParsePrefix("0.0.0.0/0"),
	}
	if got, want := bus.PrefixesOf(bus.IPv4, ps), []netip.Prefix{ps[1], ps[3]}; !slices.Equal(got, want) {
		t.Errorf("PrefixesOf(IPv4) = %v; want %v", got, want)
	}
	if got, want := bus.PrefixesOf(bus.IPv6, ps), []netip.Prefix{ps[0], ps[2]}; !slices.Equal(got, want) {
		t.Errorf("PrefixesOf(IPv6) = %v; want %v", got, want)
	}
	if got := bus.PrefixesOf(bus.IPv4, nil); got != nil {
		t.Errorf("PrefixesOf(nil) = %v; want nil", got)
	}
}
