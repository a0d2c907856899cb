package nftables

import (
	"net/netip"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

const (
	longNS   = "very-long-namespace-name-abcdefghijklmnopqrstuvwxyz0123456789xx"
	longName = "very-long-service-name-why-would-you-even-do-this-i-mean-really"
	longPort = "port-443-providing-the-hypertext-transmission-protocol-with-tls"
	longPath = longNS + "/" + longName + "/sctp/" + longPort
)

// The cases and their expected names are upstream's Test_servicePortChainNameBase
// and Test_servicePortEndpointChainNameBase (proxier_test.go, v1.34.4).

func TestPortBaseIsKubeProxys(t *testing.T) {
	for _, tc := range []struct {
		ns, name, port string
		proto          bus.Protocol
		want           string
	}{
		{"testing", "service", "http", bus.TCP, "P4ZYZVCF-testing/service/tcp/http"},
		{"testing", "service", "https", bus.TCP, "LZBRENCP-testing/service/tcp/https"},
		{longNS, longName, longPort, bus.SCTP, "KR6NACJP-" + longPath},
	} {
		p := bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: tc.ns, Name: tc.name}, Port: tc.port, Protocol: tc.proto}
		if got := portBase(p); got != tc.want {
			t.Errorf("portBase(%v) = %q, want %q", p, got, tc.want)
		}
	}
}

func TestEndpointBaseIsKubeProxys(t *testing.T) {
	http := bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: "testing", Name: "service"}, Port: "http", Protocol: bus.TCP}
	long := bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: longNS, Name: longName}, Port: longPort, Protocol: bus.SCTP}
	for _, tc := range []struct {
		port     bus.ServicePortName
		endpoint string
		want     string
	}{
		{http, "10.180.0.1:80", "JO2XBXZR-testing/service/tcp/http__10.180.0.1/80"},
		{http, "10.180.0.2:80", "5S6H3H22-testing/service/tcp/http__10.180.0.2/80"},
		{long, "[1234:5678:9abc:def0::abc:1234]:443", "5YS7AFEA-" + longPath + "__1234.5678.9abc.def0..abc.1234/443"},
	} {
		if got := endpointBase(tc.port, netip.MustParseAddrPort(tc.endpoint)); got != tc.want {
			t.Errorf("endpointBase(%v, %s) = %q, want %q", tc.port, tc.endpoint, got, tc.want)
		}
	}
}

// TestNameBaseHashesAndCuts: upstream's other endpoint cases write a single
// zero group as "::", which kube-proxy never hashes (it prints slice
// addresses with net.IP, RFC 5952: fd80:abcd:12:0:a1b2:…), so they are
// checked on the hashed text itself: the hash, and the cut of names too long.
func TestNameBaseHashesAndCuts(t *testing.T) {
	for s, want := range map[string]string{
		"testing/service/tcp/http__fd80.abcd.12..a1b2.c3d4.e5f6.9999/80": "U7E2ET36-testing/service/tcp/http__fd80.abcd.12..a1b2.c3d4.e5f6.9999/80",
		longPath + "__1234.5678.9abc.def0..abcd.1234.5678/443":           "CI6C53Q3-" + longPath + "__1234.5678.9abc.def0..abcd.1234...",
		longPath + "__1234.5678.9abc.def0..abcd.1234.8765/443":           "2FLXFK6X-" + longPath + "__1234.5678.9abc.def0..abcd.1234...",
	} {
		if got := nameBase(s); got != want {
			t.Errorf("nameBase(%q) = %q, want %q", s, got, want)
		}
	}
}

// TestMarkFromMasqueradeBit: kube-proxy writes the mark as %#08x of the bit,
// which Go prints with 8 digits (the fact sheet's "0x004000" is not what Go
// prints; nft lists 0x00004000 either way).
func TestMarkFromMasqueradeBit(t *testing.T) {
	for bit, want := range map[int]string{14: "0x00004000", 0: "0x00000001", 31: "0x80000000"} {
		cfg := Config{}
		cfg.MasqueradeBit = bit
		if got := cfg.mark(); got != want {
			t.Errorf("bit %d: mark %q, want %q", bit, got, want)
		}
	}
}
