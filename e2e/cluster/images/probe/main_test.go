package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// probeUntil runs target's loop until done(counts) holds (or fails the test
// after a minute), stops it, and returns its final counts as GET /counts
// serves them.
func probeUntil(t *testing.T, spec string, done func(TargetCounts) bool) TargetCounts {
	t.Helper()
	tgt, err := parseTarget(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := newProbe(slog.New(slog.DiscardHandler), []*target{tgt})
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { p.run(ctx); close(stopped) }()
	deadline := time.Now().Add(time.Minute)
	for !done(p.snapshot().Targets[tgt.name]) {
		if time.Now().After(deadline) {
			cancel()
			<-stopped
			t.Fatalf("%s: still %+v", spec, p.snapshot().Targets[tgt.name])
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-stopped
	return countsOverHTTP(t, p)[tgt.name]
}

func countsOverHTTP(t *testing.T, p *probe) map[string]TargetCounts {
	t.Helper()
	srv := httptest.NewServer(p.handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/counts")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var c Counts
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
		t.Fatal(err)
	}
	return c.Targets
}

func atLeast(n uint64) func(TargetCounts) bool {
	return func(c TargetCounts) bool { return c.OK+c.Failed >= n }
}

// listen gives a TCP listener on loopback whose connections serve gets.
func listen(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go serve(c)
		}
	}()
	return l.Addr().String()
}

// closedPort is a loopback address where nothing listens.
func closedPort(t *testing.T, network string) string {
	t.Helper()
	if network == "udp" {
		c, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		return c.LocalAddr().String()
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	return l.Addr().String()
}

func TestTCPAnswered(t *testing.T) {
	addr := listen(t, func(c net.Conn) {
		_, _ = io.WriteString(c, "10.244.0.7 "+c.RemoteAddr().String()+"\n")
		c.Close()
	})
	c := probeUntil(t, "svc=tcp:"+addr, atLeast(20))
	if c.OK < 20 || c.Failed != 0 || c.Endpoints["10.244.0.7"] != c.OK || len(c.Endpoints) != 1 {
		t.Errorf("counts %+v: want every attempt ok, answered by 10.244.0.7", c)
	}
}

func TestTCPClosedWithoutALine(t *testing.T) {
	addr := listen(t, func(c net.Conn) { c.Close() })
	c := probeUntil(t, "svc=tcp:"+addr, atLeast(5))
	if c.OK != 0 || c.Failed == 0 || c.Reasons.Answer != c.Failed {
		t.Errorf("counts %+v: want every attempt failed, for its answer", c)
	}
}

func TestTCPRefused(t *testing.T) {
	c := probeUntil(t, "svc=tcp:"+closedPort(t, "tcp"), atLeast(10))
	if c.OK != 0 || c.Failed < 10 || c.Reasons.Refused != c.Failed {
		t.Errorf("counts %+v: want every attempt refused", c)
	}
	if n := len(c.LastFailures); n != min(int(c.Failed), lastFailures) || c.LastFailures[n-1].Reason != "refused" ||
		!strings.Contains(c.LastFailures[n-1].Error, "connection refused") {
		t.Errorf("last failures %+v: want the last %d refusals", c.LastFailures, lastFailures)
	}
}

// silent is a listener that accepts and never writes; it tells the most
// connections it held open at once.
type silent struct {
	mu         sync.Mutex
	open, most int
}

func (s *silent) serve(c net.Conn) {
	s.mu.Lock()
	s.open++
	s.most = max(s.most, s.open)
	s.mu.Unlock()
	_, _ = io.Copy(io.Discard, c) // until the client gives up
	c.Close()
	s.mu.Lock()
	s.open--
	s.mu.Unlock()
}

func TestTCPTimeout(t *testing.T) {
	var s silent
	addr := listen(t, s.serve)
	c := probeUntil(t, "svc=tcp:"+addr+",timeout=50ms", func(c TargetCounts) bool { return c.Reasons.Timeout >= 5 })
	if c.OK != 0 || c.Reasons.Timeout < 5 || c.Reasons.Timeout+c.Reasons.Overrun != c.Failed {
		t.Errorf("counts %+v: want attempts timed out (or overrun), none ok", c)
	}
}

// A stalled endpoint holds at most inflight attempts; every other beat is an
// overrun, counted and not started.
func TestStalledEndpointBoundedInFlight(t *testing.T) {
	var s silent
	addr := listen(t, s.serve)
	c := probeUntil(t, "svc=tcp:"+addr+",timeout=1m,inflight=3", func(c TargetCounts) bool { return c.Reasons.Overrun >= 20 })
	s.mu.Lock()
	most := s.most
	s.mu.Unlock()
	if most > 3 {
		t.Errorf("the endpoint held %d connections at once; want at most inflight=3", most)
	}
	if c.OK != 0 || c.Reasons.Overrun != c.Failed {
		t.Errorf("counts %+v: want only overruns (attempts cut short by the stop are not counted)", c)
	}
}

func TestHTTP(t *testing.T) {
	ok := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "10.244.0.9 "+r.RemoteAddr+"\n")
	}))
	conns := map[string]bool{}
	var mu sync.Mutex
	ok.Config.ConnState = func(c net.Conn, s http.ConnState) {
		if s == http.StateNew {
			mu.Lock()
			conns[c.RemoteAddr().String()] = true
			mu.Unlock()
		}
	}
	ok.Start()
	defer ok.Close()
	c := probeUntil(t, "web=http:"+strings.TrimPrefix(ok.URL, "http://"), atLeast(10))
	mu.Lock()
	n := len(conns)
	mu.Unlock()
	if c.Failed != 0 || c.Endpoints["10.244.0.9"] != c.OK || uint64(n) < c.OK {
		t.Errorf("counts %+v over %d connections: want every attempt ok from 10.244.0.9, each on a new connection", c, n)
	}

	unavailable := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "terminating", http.StatusServiceUnavailable)
	}))
	defer unavailable.Close()
	c = probeUntil(t, "web=http:"+strings.TrimPrefix(unavailable.URL, "http://"), atLeast(5))
	if c.OK != 0 || c.Reasons.Answer != c.Failed || !strings.Contains(c.LastFailures[0].Error, "503") {
		t.Errorf("counts %+v: want every attempt failed for its 503", c)
	}
}

const clusterName = "kubernetes.default.svc.cluster.local."

// dnsServer answers A queries for clusterName with 10.96.0.1 and any other
// name with NXDOMAIN, over UDP and TCP on the same loopback port.
func dnsServer(t *testing.T) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	l, err := net.Listen("tcp", pc.LocalAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if answer := dnsAnswer(buf[:n]); answer != nil {
				_, _ = pc.WriteTo(answer, from)
			}
		}
	}()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go serveDNSOverTCP(c)
		}
	}()
	return pc.LocalAddr().String()
}

func serveDNSOverTCP(c net.Conn) {
	defer c.Close()
	for {
		var size [2]byte
		if _, err := io.ReadFull(c, size[:]); err != nil {
			return
		}
		query := make([]byte, binary.BigEndian.Uint16(size[:]))
		if _, err := io.ReadFull(c, query); err != nil {
			return
		}
		answer := dnsAnswer(query)
		if answer == nil {
			return
		}
		_, _ = c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(answer))), answer...))
	}
}

func dnsAnswer(query []byte) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil
	}
	q, err := p.Question()
	if err != nil {
		return nil
	}
	h.Response, h.RecursionAvailable = true, true
	b := dnsmessage.NewBuilder(nil, h)
	b.EnableCompression()
	found := q.Name.String() == clusterName
	if !found {
		h.RCode = dnsmessage.RCodeNameError
		b = dnsmessage.NewBuilder(nil, h)
	}
	_ = b.StartQuestions()
	_ = b.Question(q)
	_ = b.StartAnswers()
	if found && q.Type == dnsmessage.TypeA {
		_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 30},
			dnsmessage.AResource{A: [4]byte{10, 96, 0, 1}})
	}
	answer, err := b.Finish()
	if err != nil {
		return nil
	}
	return answer
}

// TestTLS: a completed handshake is a success; a server that accepts and
// never answers the ClientHello is a timeout.
func TestTLS(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer srv.Close()
	c := probeUntil(t, "api=tls:"+strings.TrimPrefix(srv.URL, "https://")+",timeout=500ms", atLeast(10))
	if c.Failed != 0 {
		t.Errorf("counts %+v: want every handshake to succeed", c)
	}
	mute, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	go func() {
		for {
			conn, err := mute.Accept()
			if err != nil {
				return
			}
			defer conn.Close()
		}
	}()
	c = probeUntil(t, "api=tls:"+mute.Addr().String()+",timeout=100ms", atLeast(3))
	if c.OK != 0 || c.Reasons.Timeout == 0 {
		t.Errorf("counts %+v: want handshakes with a mute server to time out", c)
	}
}

func TestDNS(t *testing.T) {
	server := dnsServer(t)
	for _, kind := range []string{"dns-udp", "dns-tcp"} {
		t.Run(kind, func(t *testing.T) {
			c := probeUntil(t, "dns="+kind+":"+server+",name=kubernetes.default.svc.cluster.local", atLeast(10))
			if c.OK < 10 || c.Failed != 0 {
				t.Errorf("counts %+v: want every lookup answered", c)
			}
			c = probeUntil(t, "dns="+kind+":"+server+",name=nowhere.svc.cluster.local", atLeast(5))
			if c.OK != 0 || c.Reasons.Answer != c.Failed {
				t.Errorf("counts %+v: want every lookup failed for its answer (NXDOMAIN)", c)
			}
		})
	}
}

func TestDNSRefused(t *testing.T) {
	for _, kind := range []string{"dns-udp", "dns-tcp"} {
		t.Run(kind, func(t *testing.T) {
			addr := closedPort(t, strings.TrimPrefix(kind, "dns-"))
			c := probeUntil(t, "dns="+kind+":"+addr+",name=kubernetes.default.svc.cluster.local", atLeast(5))
			if c.OK != 0 || c.Reasons.Refused != c.Failed {
				t.Errorf("counts %+v: want every lookup refused", c)
			}
		})
	}
}

func TestParseTarget(t *testing.T) {
	tgt, err := parseTarget("dns=dns-udp:10.96.0.10:53,every=5ms,timeout=2s,inflight=4,name=kubernetes.default")
	if err != nil {
		t.Fatal(err)
	}
	if tgt.name != "dns" || tgt.kind != "dns-udp" || tgt.address != "10.96.0.10:53" || tgt.every != 5*time.Millisecond ||
		tgt.timeout != 2*time.Second || tgt.inflight != 4 || tgt.dnsName != "kubernetes.default" {
		t.Errorf("parsed %+v", tgt)
	}
	for _, bad := range []string{
		"svc", "svc=tcp", "svc=udp:10.0.0.1:80", "svc=tcp:10.0.0.1", "svc=tcp:10.0.0.1:80,every=soon",
		"svc=tcp:10.0.0.1:80,every=0s", "svc=tcp:10.0.0.1:80,colour=red", "dns=dns-tcp:10.96.0.10:53",
	} {
		if _, err := parseTarget(bad); err == nil {
			t.Errorf("parseTarget(%q) accepted", bad)
		}
	}
}

func TestHealthz(t *testing.T) {
	srv := httptest.NewServer(newProbe(slog.New(slog.DiscardHandler), nil).handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/healthz: %s", resp.Status)
	}
}
