package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"
)

var (
	// ErrRefused: the connection or datagram was actively rejected
	// (ECONNREFUSED, or an ICMP unreachable: EHOSTUNREACH, ENETUNREACH).
	ErrRefused = errors.New("refused")
	// ErrTimeout: nothing came back before the deadline.
	ErrTimeout = errors.New("timeout")
)

// Answer is what an echo server said: which endpoint answered and what source
// address it saw.
type Answer struct {
	// Endpoint is the IP the echo server was reached on, e.g. "10.244.0.11".
	Endpoint string
	// SeenSource is the peer address the echo server saw, "ip:port" (IPv6 in
	// brackets).
	SeenSource string
}

// SourceIP is the IP part of SeenSource.
func (a Answer) SourceIP() string {
	host, _, err := net.SplitHostPort(a.SeenSource)
	if err != nil {
		return a.SeenSource
	}
	return host
}

func parseAnswer(s string) (Answer, error) {
	f := strings.Fields(s)
	if len(f) != 2 {
		return Answer{}, fmt.Errorf("unexpected answer %q", s)
	}
	return Answer{Endpoint: f[0], SeenSource: f[1]}, nil
}

// classify turns a network error into one wrapping ErrRefused or ErrTimeout
// when it is one of those.
func classify(what string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return fmt.Errorf("%s: %w (%w)", what, ErrRefused, err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%s: %w (%w)", what, ErrTimeout, err)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("%s: %w (%w)", what, ErrTimeout, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// DialTCP connects from namespace ns to addr ("ip:port"), reads the echo
// server's line and returns it. The whole exchange must fit in timeout.
func (tb *Testbed) DialTCP(ns, addr string, timeout time.Duration) (Answer, error) {
	return tb.DialTCPFrom(ns, "", addr, timeout)
}

// DialTCPFrom is DialTCP with the connection's source address bound to src
// (an address of ns; "" lets the kernel choose).
func (tb *Testbed) DialTCPFrom(ns, src, addr string, timeout time.Duration) (Answer, error) {
	return tb.dialTCP(ns, src, 0, addr, timeout)
}

// DialTCPFromPort is DialTCP from source port port (SO_REUSEADDR: the same
// port can be dialled from again at once).
func (tb *Testbed) DialTCPFromPort(ns string, port int, addr string, timeout time.Duration) (Answer, error) {
	return tb.dialTCP(ns, "", port, addr, timeout)
}

func (tb *Testbed) dialTCP(ns, src string, port int, addr string, timeout time.Duration) (Answer, error) {
	what := fmt.Sprintf("tcp %s from %s", addr, ns)
	if src != "" {
		what += " (source " + src + ")"
	}
	if port != 0 {
		what += fmt.Sprintf(" (source port %d)", port)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var conn net.Conn
	err := tb.InNamespace(ns, func() error {
		d := net.Dialer{}
		var ip net.IP
		if src != "" {
			if ip = net.ParseIP(src); ip == nil {
				return fmt.Errorf("bad source address %q", src)
			}
		}
		if ip != nil || port != 0 {
			d.LocalAddr = &net.TCPAddr{IP: ip, Port: port}
		}
		if port != 0 {
			d.Control = reuseAddr
		}
		c, err := d.DialContext(ctx, "tcp", addr)
		conn = c
		return err
	})
	if err != nil {
		err = classify(what, err)
		if errors.Is(err, ErrTimeout) {
			if gone := tb.forgetUnanswered(addr); gone != "" {
				err = fmt.Errorf("%w; untranslated conntrack entries to it deleted: %s", err, gone)
			}
		}
		return Answer{}, err
	}
	defer conn.Close()
	dl, _ := ctx.Deadline()
	_ = conn.SetDeadline(dl)
	b, err := io.ReadAll(io.LimitReader(conn, 512))
	if err != nil {
		return Answer{}, classify(what+": read", err)
	}
	a, err := parseAnswer(string(b))
	if err != nil {
		return Answer{}, fmt.Errorf("%s: %w", what, err)
	}
	return a, nil
}

// forgetUnanswered deletes the node's conntrack entries of TCP connections
// to addr that were neither answered nor translated (SYN_SENT, the reply
// coming from addr itself): what a SYN sent before the proxy programmed addr
// leaves. Such an entry lives 120 s, and the client's kernel, which knows
// nothing of it, gives a later connection to addr the same source port as
// readily as any: that connection then rides the entry, is never DNATed and
// goes unanswered, as under kube-proxy. A test's probe before convergence
// must not fail its later connections. It returns the entries deleted (their
// source ports tell which connections rode them). Best effort.
func (tb *Testbed) forgetUnanswered(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return ""
	}
	family := "ipv4"
	if strings.Contains(host, ":") {
		family = "ipv6"
	}
	// Exits 1 when there was nothing to delete.
	out, _ := tb.Exec(tb.NodeNS, "conntrack", "-D", "-f", family, "-p", "tcp", "--state", "SYN_SENT",
		"--orig-dst", host, "--orig-port-dst", port, "--reply-src", host)
	var gone []string
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "SYN_SENT") {
			gone = append(gone, strings.Join(strings.Fields(l), " "))
		}
	}
	return strings.Join(gone, "; ")
}

// DialUDP sends one datagram from namespace ns to addr and waits for the echo
// server's answer. localPort 0 picks an ephemeral source port; a fixed one makes
// repeated calls the same flow as far as conntrack is concerned.
func (tb *Testbed) DialUDP(ns, addr string, timeout time.Duration, localPort int) (Answer, error) {
	return tb.DialUDPFrom(ns, "", addr, timeout, localPort)
}

// DialUDPFrom is DialUDP with the socket bound to source address src (an
// address of ns; "" lets the kernel choose).
func (tb *Testbed) DialUDPFrom(ns, src, addr string, timeout time.Duration, localPort int) (Answer, error) {
	what := fmt.Sprintf("udp %s from %s", addr, ns)
	if src != "" {
		what += " (source " + src + ")"
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var conn net.Conn
	err := tb.InNamespace(ns, func() error {
		d := net.Dialer{}
		var srcIP net.IP
		if src != "" {
			if srcIP = net.ParseIP(src); srcIP == nil {
				return fmt.Errorf("bad source address %q", src)
			}
		}
		if localPort != 0 || srcIP != nil {
			d.LocalAddr = &net.UDPAddr{IP: srcIP, Port: localPort}
		}
		if localPort != 0 {
			d.Control = reuseAddr
		}
		c, err := d.DialContext(ctx, "udp", addr)
		conn = c
		return err
	})
	if err != nil {
		return Answer{}, classify(what, err)
	}
	defer conn.Close()
	dl, _ := ctx.Deadline()
	_ = conn.SetDeadline(dl)
	if _, err := conn.Write([]byte("hello\n")); err != nil {
		return Answer{}, classify(what+": write", err)
	}
	buf := make([]byte, 512)
	n, err := conn.Read(buf)
	if err != nil {
		return Answer{}, classify(what+": read", err)
	}
	a, err := parseAnswer(string(buf[:n]))
	if err != nil {
		return Answer{}, fmt.Errorf("%s: %w", what, err)
	}
	return a, nil
}

// reuseAddr sets SO_REUSEADDR on a socket about to be bound (a net.Dialer's
// Control): a fixed source port can be bound again at once.
func reuseAddr(network, address string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1)
	})
	if err != nil {
		return err
	}
	return serr
}

// HTTPClient returns an HTTP client whose connections are made from inside
// namespace ns; every request uses a new connection.
func (tb *Testbed) HTTPClient(ns string, timeout time.Duration) *http.Client {
	return &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{
			DialContext:       tb.Dialer(ns),
			DisableKeepAlives: true,
		},
	}
}

// httpTimeout bounds an HTTPGet or HTTPPost.
const httpTimeout = 5 * time.Second

// HTTPGet GETs url from inside namespace ns and returns the status code and body.
func (tb *Testbed) HTTPGet(ns, url string) (int, []byte, error) {
	return tb.httpDo(ns, http.MethodGet, url, httpTimeout)
}

// HTTPGetWithin is HTTPGet for an answer that takes longer than HTTPGet
// waits (a CPU profile over some seconds).
func (tb *Testbed) HTTPGetWithin(ns, url string, timeout time.Duration) (int, []byte, error) {
	return tb.httpDo(ns, http.MethodGet, url, timeout)
}

// HTTPPost POSTs an empty body to url from inside namespace ns.
func (tb *Testbed) HTTPPost(ns, url string) (int, []byte, error) {
	return tb.httpDo(ns, http.MethodPost, url, httpTimeout)
}

func (tb *Testbed) httpDo(ns, method, url string, timeout time.Duration) (int, []byte, error) {
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := tb.HTTPClient(ns, timeout).Do(req)
	if err != nil {
		return 0, nil, fmt.Errorf("%s %s from %s: %w", method, url, ns, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, body, fmt.Errorf("%s %s from %s: read body: %w", method, url, ns, err)
	}
	return resp.StatusCode, body, nil
}
