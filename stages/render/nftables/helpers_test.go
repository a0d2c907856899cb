package nftables

import (
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/render"
)

// upstreamConfig is kube-proxy's NewFakeProxier (proxier_test.go) for IPv4:
// node test-node at 192.168.0.2, detect-local by CIDR 10.0.0.0/8,
// nodePortAddresses 192.168.0.2/32 and 2001:db8::1/128, ServiceCIDR
// 172.30.0.0/16, and the mark written as 0x4000.
func upstreamConfig() Config {
	return Config{
		Config: render.Config{
			Family: bus.IPv4, NodeName: "test-node", MasqueradeBit: 14,
			DetectLocal: render.DetectClusterCIDR, ClusterCIDRs: prefixes("10.0.0.0/8"),
			NodePortAddresses: prefixes("192.168.0.2/32", "2001:db8::1/128"),
		},
		ServiceCIDRs: prefixes("172.30.0.0/16"),
		Mark:         "0x4000",
	}
}

// upstreamState is the fake proxier's node and the addresses of its fake interfaces.
func upstreamState() bus.State {
	return bus.State{
		Services: map[bus.ServiceKey]*bus.Service{},
		Slices:   map[bus.ServiceKey]map[string]*bus.EndpointSlice{},
		Node:     &bus.Node{Name: "test-node", Addrs: addrs("192.168.0.2")},
		LocalAddrs: addrs("127.0.0.1", "::1", "192.168.0.2", "192.168.1.2", "192.168.99.11",
			"2001:db8::1", "2001:db8:1::2"),
	}
}

func addrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// service adds ns/name with one TCP port p<port> (nodePort 0: none) and
// returns it for the test to shape further.
func service(st bus.State, ns, name, clusterIP string, port, nodePort int32) *bus.Service {
	svc := &bus.Service{
		ServiceKey: bus.ServiceKey{Namespace: ns, Name: name},
		ClusterIPs: addrs(clusterIP),
		Ports:      []bus.Port{{Name: portName(port), Protocol: bus.TCP, Port: port, NodePort: nodePort}},
	}
	st.Services[svc.ServiceKey] = svc
	return svc
}

func portName(port int32) string { return "p" + strconv.Itoa(int(port)) }

// endpoints adds one slice of ready endpoints of svc's first port, on the
// same port number; each endpoint is "ip" or "ip@node".
func endpoints(st bus.State, svc *bus.Service, eps ...string) {
	endpointsOn(st, svc, svc.Ports[0].Port, eps...)
}

// endpointsOn is endpoints on target port, "ip" or "ip@node" or "ip@node!"
// for an endpoint that is terminating and still serving.
func endpointsOn(st bus.State, svc *bus.Service, target int32, eps ...string) {
	port := svc.Ports[0]
	sl := &bus.EndpointSlice{Service: svc.ServiceKey, Name: svc.Name + "-1",
		Ports: []bus.EndpointPort{{Name: port.Name, Protocol: port.Protocol, Port: target}}}
	for _, e := range eps {
		addr, node, _ := strings.Cut(e, "@")
		node, terminating := strings.CutSuffix(node, "!")
		a := netip.MustParseAddr(addr)
		sl.Family = bus.FamilyOf(a)
		sl.Items = append(sl.Items, bus.Endpoint{Addr: a, NodeName: node, Ready: !terminating, Serving: true, Terminating: terminating})
	}
	st.Slices[svc.ServiceKey] = map[string]*bus.EndpointSlice{sl.Name: sl}
}

// requireGolden requires got to be testdata/name byte for byte, and shows the
// lines that differ when it is not.
func requireGolden(t *testing.T, name, got string) {
	t.Helper()
	want, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Errorf("Dump() differs from upstream's testdata/%s:\n%s", name, dumpDiff(string(want), got))
	}
}

// dumpDiff lists the lines only upstream has (-) and only we have (+); if
// both have the same lines, where their order first differs.
func dumpDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	inW, inG := map[string]bool{}, map[string]bool{}
	for _, l := range w {
		inW[l] = true
	}
	for _, l := range g {
		inG[l] = true
	}
	var b strings.Builder
	for _, l := range w {
		if !inG[l] {
			b.WriteString("- " + l + "\n")
		}
	}
	for _, l := range g {
		if !inW[l] {
			b.WriteString("+ " + l + "\n")
		}
	}
	if b.Len() > 0 {
		return b.String()
	}
	for i := range min(len(w), len(g)) {
		if w[i] != g[i] {
			return "same lines, in another order; line " + strconv.Itoa(i+1) + ":\n- " + w[i] + "\n+ " + g[i] + "\n"
		}
	}
	return "same lines, " + strconv.Itoa(len(w)) + " upstream, " + strconv.Itoa(len(g)) + " here\n"
}
