package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"syscall"
)

// Failure reasons: Reasons' JSON field names.
const (
	reasonTimeout = "timeout"
	reasonRefused = "refused"
	reasonReset   = "reset"
	reasonAnswer  = "answer"
	reasonOverrun = "overrun"
	reasonOther   = "other"
)

var (
	errOverrun = errors.New("overrun")
	// errAnswer wraps a wrong answer: the server was reached.
	errAnswer = errors.New("wrong answer")
)

// classify names err's reason. The cause is checked before the timeout: a DNS
// lookup whose every try was refused ends in the resolver's timeout.
func classify(err error) string {
	var netErr net.Error
	switch {
	case errors.Is(err, errOverrun):
		return reasonOverrun
	case errors.Is(err, syscall.ECONNREFUSED):
		return reasonRefused
	case errors.Is(err, syscall.ECONNRESET):
		return reasonReset
	case errors.Is(err, errAnswer):
		return reasonAnswer
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return reasonTimeout
	}
	return reasonOther
}

// tryTCP connects, reads one line and returns its first word: the echoserver's
// local IP, i.e. the endpoint that answered.
func tryTCP(ctx context.Context, address string) (endpoint string, err error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", address)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() }) // the read ends with ctx
	defer stop()
	line, err := bufio.NewReader(conn).ReadString('\n')
	if strings.TrimSpace(line) == "" {
		switch {
		case ctx.Err() != nil:
			return "", fmt.Errorf("%w: no line read (%v)", ctx.Err(), err)
		case err == nil || err == io.EOF:
			return "", fmt.Errorf("%w: closed without a line (%v)", errAnswer, err)
		}
		return "", err
	}
	return firstWordIfIP(line), nil
}

// tryTLS opens a connection and completes a TLS handshake: the apiserver
// reached through the kubernetes Service (its certificate is not checked: the
// question is whether the Service reaches it). The endpoint is the
// server's address as the client saw it, which is the Service's.
func tryTLS(ctx context.Context, address string) (endpoint string, err error) {
	var d tls.Dialer
	d.Config = &tls.Config{InsecureSkipVerify: true}
	conn, err := d.DialContext(ctx, "tcp", address)
	if err != nil {
		return "", err
	}
	conn.Close()
	return "", nil
}

// newHTTPClient makes a client whose every request opens a new connection,
// straight to the address (no proxy from the environment).
func newHTTPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
}

// tryHTTP GETs http://address/; a 2xx is success, and the body's first word
// the endpoint when it is an IP (the echoserver's line).
func tryHTTP(ctx context.Context, client *http.Client, address string) (endpoint string, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+address+"/", nil)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return "", err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return "", fmt.Errorf("%w: %s", errAnswer, resp.Status)
	}
	return firstWordIfIP(string(body)), nil
}

func firstWordIfIP(s string) string {
	word, _, _ := strings.Cut(strings.TrimSpace(s), " ")
	if _, err := netip.ParseAddr(word); err != nil {
		return ""
	}
	return word
}

// tryDNS asks server, over network ("udp" or "tcp") only, for name's A
// records; at least one is success. The name is made absolute, so a pod's
// search domains (ndots:5) add no queries.
func tryDNS(ctx context.Context, network, server, name string) (endpoint string, err error) {
	var cause transportCause
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, network, server)
		if err != nil {
			cause.note(0, err)
			return nil, err
		}
		return cause.wrap(conn), nil
	}}
	ips, err := r.LookupIP(ctx, "ip4", strings.TrimSuffix(name, ".")+".")
	if err != nil {
		// (The error names the server of /etc/resolv.conf: say which was asked.)
		err = fmt.Errorf("ask %s over %s: %w", server, network, err)
		var dnsErr *net.DNSError
		transport := cause.get()
		switch {
		case transport != nil:
			// The resolver reports a socket's error only as text.
			return "", fmt.Errorf("%w (%w)", err, transport)
		case errors.As(err, &dnsErr) && !dnsErr.IsTimeout:
			return "", fmt.Errorf("%w: %w", errAnswer, err) // NXDOMAIN, SERVFAIL, ...
		}
		return "", err
	}
	if len(ips) == 0 {
		return "", fmt.Errorf("%w: no A record for %s", errAnswer, name)
	}
	return "", nil
}

// transportCause remembers the first error of a lookup's sockets (a refused
// or reset connection), which the resolver reports only as text. Errors of a
// read that timed out are not causes: the timeout is.
type transportCause struct {
	mu  sync.Mutex
	err error
}

func (c *transportCause) note(n int, err error) (int, error) {
	var netErr net.Error
	if err != nil && !(errors.As(err, &netErr) && netErr.Timeout()) && err != io.EOF {
		c.mu.Lock()
		if c.err == nil {
			c.err = err
		}
		c.mu.Unlock()
	}
	return n, err
}

func (c *transportCause) get() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// wrap returns conn noting its read and write errors. A UDP conn stays a
// net.PacketConn: the resolver frames its messages by that.
func (c *transportCause) wrap(conn net.Conn) net.Conn {
	if u, ok := conn.(*net.UDPConn); ok {
		return packetConn{u, c}
	}
	return streamConn{conn, c}
}

type streamConn struct {
	net.Conn
	cause *transportCause
}

func (s streamConn) Read(b []byte) (int, error)  { return s.cause.note(s.Conn.Read(b)) }
func (s streamConn) Write(b []byte) (int, error) { return s.cause.note(s.Conn.Write(b)) }

type packetConn struct {
	*net.UDPConn
	cause *transportCause
}

func (p packetConn) Read(b []byte) (int, error)  { return p.cause.note(p.UDPConn.Read(b)) }
func (p packetConn) Write(b []byte) (int, error) { return p.cause.note(p.UDPConn.Write(b)) }
