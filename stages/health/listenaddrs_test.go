package health

import (
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
)

func addrList(ss ...string) []netip.Addr {
	out := []netip.Addr{}
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

// answersOn says whether the healthCheckNodePort answers on host.
func answersOn(host string, port int32) bool {
	_, err := tryGet("http://" + net.JoinHostPort(host, strconv.Itoa(int(port))) + "/")
	return err == nil
}

// waitAnswersOn polls until the port answers on host.
func waitAnswersOn(t *testing.T, host string, port int32) {
	t.Helper()
	bustest.Eventually(t, func() bool { return answersOn(host, port) }, "port %d to answer on %s", port, host)
}

// neverAnswersOn checks, again and again, that nothing answers the port on host.
func neverAnswersOn(t *testing.T, host string, port int32) {
	t.Helper()
	for range 10 {
		if answersOn(host, port) {
			t.Fatalf("port %d answers on %s; it must not listen there", port, host)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func hasIPv6Loopback() bool {
	ln, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

// TestServiceHealthListensOnPlanAddrs: healthCheckNodePort servers listen only on
// the addresses the plan gives (--nodeport-addresses), and move when they change.
func TestServiceHealthListensOnPlanAddrs(t *testing.T) {
	hs := newHarness(t, Config{Families: []bus.Family{bus.IPv4, bus.IPv6}}, nil)
	hs.run(t)
	key := bus.ServiceKey{Namespace: "ns", Name: "svc"}
	port := freePort(t)
	svcs := map[bus.ServiceKey]bus.HealthCheck{key: {NodePort: port, LocalEndpoints: 1}}
	put := func(v4, v6 []netip.Addr) {
		hs.checks.Put(bus.HealthCheckUpdates{
			bus.IPv4: {Family: bus.IPv4, Services: svcs, Addrs: v4},
			bus.IPv6: {Family: bus.IPv6, Services: svcs, Addrs: v6},
		})
	}

	// One listed address per family.
	put(addrList("127.0.0.2"), addrList("::1"))
	waitAnswersOn(t, "127.0.0.2", port)
	neverAnswersOn(t, "127.0.0.1", port)
	neverAnswersOn(t, "127.0.0.3", port)

	// The set changes: the servers move.
	put(addrList("127.0.0.1", "127.0.0.3"), addrList("::1"))
	waitAnswersOn(t, "127.0.0.1", port)
	waitAnswersOn(t, "127.0.0.3", port)
	neverAnswersOn(t, "127.0.0.2", port)

	// A family that lists no address has no listener of that family.
	// (127.0.0.3 answered before too: wait for the move, then check it holds.)
	put(addrList("127.0.0.3"), addrList())
	bustest.Eventually(t, func() bool { return !answersOn("127.0.0.1", port) }, "port %d to leave 127.0.0.1", port)
	waitAnswersOn(t, "127.0.0.3", port)
	neverAnswersOn(t, "127.0.0.1", port)

	// nil for every family: every address.
	put(nil, nil)
	waitAnswersOn(t, "127.0.0.2", port)
	waitAnswersOn(t, "127.0.0.9", port)

	if !hasIPv6Loopback() {
		t.Log("no IPv6 loopback: the mixed-family cases are not checked")
		return
	}
	waitAnswersOn(t, "::1", port)

	// IPv4 limited, IPv6 every address: IPv6 answers, IPv4 only where listed.
	put(addrList("127.0.0.2"), nil)
	bustest.Eventually(t, func() bool { return !answersOn("127.0.0.9", port) }, "port %d to leave 127.0.0.9", port)
	waitAnswersOn(t, "127.0.0.2", port)
	waitAnswersOn(t, "::1", port)
	neverAnswersOn(t, "127.0.0.9", port)

	// IPv4 every address, IPv6 limited.
	put(nil, addrList("::1"))
	waitAnswersOn(t, "127.0.0.9", port)
	waitAnswersOn(t, "::1", port)
}
