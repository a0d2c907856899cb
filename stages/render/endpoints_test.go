package render

import (
	"net/netip"
	"slices"
	"testing"
)

func eps(specs ...endpoint) []endpoint { return specs }

func e(addr string, ready, serving, terminating, local bool, zones ...string) endpoint {
	return endpoint{addr: netip.MustParseAddrPort(addr), ready: ready, serving: serving, terminating: terminating, local: local, zones: zones}
}

func addrs(es []endpoint) []string {
	var out []string
	for _, x := range es {
		out = append(out, x.addr.String())
	}
	return out
}

// TestCategorize checks kube-proxy's endpoint selection rules case by case.
func TestCategorize(t *testing.T) {
	readyLocal := e("10.0.0.1:80", true, true, false, true)
	readyRemote := e("10.0.0.2:80", true, true, false, false)
	termLocal := e("10.0.0.3:80", false, true, true, true)
	termRemote := e("10.0.0.4:80", false, true, true, false)
	deadLocal := e("10.0.0.5:80", false, false, true, true)
	zoneA := e("10.0.0.6:80", true, true, false, false, "zone-a")
	zoneB := e("10.0.0.7:80", true, true, false, false, "zone-b")
	noHint := e("10.0.0.8:80", true, true, false, false)
	cases := []struct {
		name                      string
		eps                       []endpoint
		usesCluster, usesLocal    bool
		cluster, local, reachable []string
		hasAny                    bool
	}{
		{"cluster: ready only", eps(readyLocal, readyRemote, termLocal), true, false,
			[]string{"10.0.0.1:80", "10.0.0.2:80"}, nil, []string{"10.0.0.1:80", "10.0.0.2:80"}, true},
		{"cluster: terminating fallback, never not-serving", eps(termLocal, termRemote, deadLocal), true, false,
			[]string{"10.0.0.3:80", "10.0.0.4:80"}, nil, []string{"10.0.0.3:80", "10.0.0.4:80"}, true},
		{"cluster: nothing usable", eps(deadLocal), true, false, nil, nil, nil, false},
		{"local: ready local only", eps(readyLocal, readyRemote, termLocal), false, true,
			nil, []string{"10.0.0.1:80"}, []string{"10.0.0.1:80"}, true},
		{"local: terminating local fallback", eps(readyRemote, termLocal), false, true,
			nil, []string{"10.0.0.3:80"}, []string{"10.0.0.3:80"}, true},
		{"local: none local but some remote", eps(readyRemote), false, true, nil, nil, nil, true},
		{"both: union of cluster and terminating local", eps(readyRemote, termLocal), true, true,
			[]string{"10.0.0.2:80"}, []string{"10.0.0.3:80"}, []string{"10.0.0.2:80", "10.0.0.3:80"}, true},
		{"topology: zone hints narrow cluster endpoints", eps(zoneA, zoneB), true, false,
			[]string{"10.0.0.6:80"}, nil, []string{"10.0.0.6:80"}, true},
		{"topology: one endpoint without hints disables it", eps(zoneA, zoneB, noHint), true, false,
			[]string{"10.0.0.6:80", "10.0.0.7:80", "10.0.0.8:80"}, nil, []string{"10.0.0.6:80", "10.0.0.7:80", "10.0.0.8:80"}, true},
		{"topology: no endpoint for this zone disables it", eps(zoneB), true, false,
			[]string{"10.0.0.7:80"}, nil, []string{"10.0.0.7:80"}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := categorize(tc.eps, tc.usesCluster, tc.usesLocal, "node-a", "zone-a")
			if got := addrs(c.cluster); !slices.Equal(got, tc.cluster) {
				t.Errorf("cluster = %v, want %v", got, tc.cluster)
			}
			if got := addrs(c.local); !slices.Equal(got, tc.local) {
				t.Errorf("local = %v, want %v", got, tc.local)
			}
			if got := addrs(c.reachable); !slices.Equal(got, tc.reachable) {
				t.Errorf("reachable = %v, want %v", got, tc.reachable)
			}
			if c.hasAny != tc.hasAny {
				t.Errorf("hasAny = %v, want %v", c.hasAny, tc.hasAny)
			}
		})
	}
}

// TestTopologySameNode: node hints win over zone hints when every endpoint has them.
func TestTopologySameNode(t *testing.T) {
	a := e("10.0.0.1:80", true, true, false, true, "zone-a")
	b := e("10.0.0.2:80", true, true, false, false, "zone-a")
	a.nodes, b.nodes = []string{"node-a"}, []string{"node-b"}
	c := categorize([]endpoint{a, b}, true, false, "node-a", "zone-a")
	if got := addrs(c.cluster); !slices.Equal(got, []string{"10.0.0.1:80"}) {
		t.Errorf("cluster = %v, want only the endpoint hinted for node-a", got)
	}
}
