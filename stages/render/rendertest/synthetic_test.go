package rendertest

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

// The synthetic cluster has the size asked for, distinct ClusterIPs inside the
// family's service CIDR (never its first or last address), endpoints of the
// same family, and is the same on every call (benchmarks compare runs).
func TestSyntheticStateShape(t *testing.T) {
	for _, tc := range []struct {
		family bus.Family
		cidr   netip.Prefix
	}{{bus.IPv4, syntheticServiceCIDR4}, {bus.IPv6, syntheticServiceCIDR6}} {
		st := SyntheticStateOf(tc.family, 500, 3)
		if len(st.Services) != 500 || len(st.Slices) != 500 {
			t.Fatalf("%v: %d services, %d slice sets; want 500", tc.family, len(st.Services), len(st.Slices))
		}
		last := addOffset(tc.cidr.Addr(), 1<<(tc.cidr.Addr().BitLen()-tc.cidr.Bits())-1)
		seen := map[netip.Addr]bool{}
		for key, svc := range st.Services {
			ip := svc.ClusterIPs[0]
			if !tc.cidr.Contains(ip) || ip == tc.cidr.Addr() || ip == last || seen[ip] {
				t.Fatalf("%v: ClusterIP %v outside %v, its first or last address, or repeated", tc.family, ip, tc.cidr)
			}
			seen[ip] = true
			for _, sl := range st.Slices[key] {
				if len(sl.Items) != 3 || sl.Family != tc.family || sl.Items[0].Addr.Is4() != (tc.family == bus.IPv4) {
					t.Fatalf("%v: slice %s has %d endpoints of family %v (%v)", tc.family, sl.Name, len(sl.Items), sl.Family, sl.Items[0].Addr)
				}
			}
		}
		if again := SyntheticStateOf(tc.family, 500, 3); !reflect.DeepEqual(st, again) {
			t.Errorf("%v: a second call made another cluster", tc.family)
		}
	}
	if !reflect.DeepEqual(SyntheticState(20, 2), SyntheticStateOf(bus.IPv4, 20, 2)) {
		t.Error("SyntheticState is not SyntheticStateOf(IPv4)")
	}
}

// addOffset carries across bytes.
func TestAddOffsetCarries(t *testing.T) {
	for _, tc := range []struct {
		a    string
		off  uint64
		want string
	}{
		{"10.128.0.0", 1, "10.128.0.1"},
		{"10.128.0.255", 1, "10.128.1.0"},
		{"10.128.255.255", 0x10001, "10.130.0.0"},
		{"fd00:10:244::ffff", 1, "fd00:10:244::1:0"},
	} {
		if got := addOffset(netip.MustParseAddr(tc.a), tc.off); got != netip.MustParseAddr(tc.want) {
			t.Errorf("addOffset(%s, %#x) = %v; want %s", tc.a, tc.off, got, tc.want)
		}
	}
}
