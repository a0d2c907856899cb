// Command echoserver is the "pod" of the e2e test bed. It listens on TCP and UDP
// on one port for each address it is given and tells every client who answered
// and whom it saw:
//
//	<local IP> <remote IP>:<remote port>\n
//
// (the remote part is written with net.JoinHostPort, so an IPv6 remote reads
// "[fd00:10:244::11]:40000"). A TCP connection gets that line as soon as it is
// accepted and is then closed; every UDP datagram is answered with that line.
//
// With -http-port, it also answers every HTTP request on that port with 200
// and the same line as its body (kube probes; HTTP clients).
//
// SCTP is not served: the kernel the tests run on has no SCTP sockets.
//
// In a Kubernetes pod, give it the pod's IPs from the downward API (env POD_IP
// from status.podIP; args "-addr", "$(POD_IP)"), which the kubelet expands.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

type addrList []netip.Addr

func (a *addrList) String() string {
	parts := make([]string, len(*a))
	for i, ip := range *a {
		parts[i] = ip.String()
	}
	return strings.Join(parts, ",")
}

func (a *addrList) Set(s string) error {
	ip, err := netip.ParseAddr(s)
	if err != nil {
		return fmt.Errorf("parse address %q: %w", s, err)
	}
	*a = append(*a, ip)
	return nil
}

func main() {
	var addrs addrList
	port := flag.Int("port", 8080, "port to listen on (TCP and UDP)")
	httpPort := flag.Int("http-port", 0, "also answer HTTP on this port, with the line as the body (0: no HTTP)")
	flag.Var(&addrs, "addr", "address to listen on (repeat for several)")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if len(addrs) == 0 {
		log.Error("no -addr given")
		os.Exit(2)
	}
	for _, ip := range addrs {
		ap := netip.AddrPortFrom(ip, uint16(*port))
		tl, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(ap))
		if err != nil {
			log.Error("listen tcp", "addr", ap, "err", err)
			os.Exit(1)
		}
		ul, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(ap))
		if err != nil {
			log.Error("listen udp", "addr", ap, "err", err)
			os.Exit(1)
		}
		go serveTCP(log, ip, tl)
		go serveUDP(log, ip, ul)
		log.Info("listening", "addr", ap)
		if *httpPort != 0 {
			hp := netip.AddrPortFrom(ip, uint16(*httpPort))
			hl, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(hp))
			if err != nil {
				log.Error("listen http", "addr", hp, "err", err)
				os.Exit(1)
			}
			go serveHTTP(log, ip, hl)
			log.Info("listening for http", "addr", hp)
		}
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
}

func line(local netip.Addr, remote netip.AddrPort) []byte {
	return []byte(local.String() + " " + net.JoinHostPort(remote.Addr().Unmap().String(), strconv.Itoa(int(remote.Port()))) + "\n")
}

func serveTCP(log *slog.Logger, local netip.Addr, l *net.TCPListener) {
	for {
		c, err := l.AcceptTCP()
		if err != nil {
			log.Error("accept", "addr", l.Addr(), "err", err)
			os.Exit(1)
		}
		remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
		_, _ = c.Write(line(local, remote))
		_ = c.Close()
	}
}

func serveUDP(log *slog.Logger, local netip.Addr, c *net.UDPConn) {
	buf := make([]byte, 2048)
	for {
		_, remote, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			log.Error("read udp", "addr", c.LocalAddr(), "err", err)
			os.Exit(1)
		}
		if _, err := c.WriteToUDPAddrPort(line(local, remote), remote); err != nil {
			log.Warn("write udp", "to", remote, "err", err)
		}
	}
}

func serveHTTP(log *slog.Logger, local netip.Addr, l net.Listener) {
	srv := &http.Server{Handler: answerHTTP(local), ReadHeaderTimeout: 5 * time.Second}
	log.Error("serve http", "addr", l.Addr(), "err", srv.Serve(l))
	os.Exit(1)
}

// answerHTTP answers every request with 200 and the line.
func answerHTTP(local netip.Addr) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		remote, err := netip.ParseAddrPort(r.RemoteAddr)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_, _ = w.Write(line(local, remote))
	})
}
