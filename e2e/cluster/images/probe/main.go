// Command probe is the traffic client pod of the real-cluster e2e tests: it
// makes new connections to each of its targets on a fixed beat and counts
// what happened; the tests read the counts over HTTP (GET /counts).
//
//	probe -listen :8080 \
//	  -target svc=tcp:10.96.0.20:80 \
//	  -target web=http:10.96.0.21:80,every=5ms,timeout=1s \
//	  -target dns=dns-udp:10.96.0.10:53,name=kubernetes.default.svc.cluster.local
//
// Kinds: tcp dials and reads one line (the e2e echoserver's "<local IP>
// <remote>\n"); http GETs http://ADDRESS/ on a new connection; dns-udp and
// dns-tcp ask ADDRESS for NAME's A records over that network only. Each target
// has its own loop: an attempt every `every` (10ms), each bounded by `timeout`
// (1s), at most `inflight` (16) at once; a beat with none free is a failure,
// "overrun", so a stalled endpoint costs counted failures, not goroutines.
// Every failure is also logged, one JSON line on stdout.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

func main() {
	listen := flag.String("listen", ":8080", "address of the HTTP server for /counts and /healthz")
	var targets []*target
	flag.Func("target", "NAME=KIND:ADDRESS[,every=10ms][,timeout=1s][,inflight=16][,name=DNS-NAME] (repeat)", func(s string) error {
		t, err := parseTarget(s)
		if err == nil {
			targets = append(targets, t)
		}
		return err
	})
	flag.Parse()
	log := slog.New(slog.NewJSONHandler(os.Stdout, nil))
	if len(targets) == 0 {
		log.Error("no -target given")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	p := newProbe(log, targets)
	srv := &http.Server{Addr: *listen, Handler: p.handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.ListenAndServe(); err != http.ErrServerClosed {
			log.Error("serve", "err", err)
			os.Exit(1)
		}
	}()
	log.Info("probing", "targets", len(targets), "listen", *listen)
	p.run(ctx)
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdown)
}

// target is one -target: what to try, how often, and its counts.
type target struct {
	name, kind, address string
	dnsName             string // the name to resolve (dns kinds)
	every, timeout      time.Duration
	inflight            int
	attempt             func(ctx context.Context) (endpoint string, err error)

	mu     sync.Mutex
	counts TargetCounts
}

// parseTarget parses NAME=KIND:ADDRESS[,OPTION=VALUE...].
func parseTarget(s string) (*target, error) {
	head, opts, _ := strings.Cut(s, ",")
	name, rest, ok := strings.Cut(head, "=")
	kind, address, ok2 := strings.Cut(rest, ":")
	if !ok || !ok2 || name == "" || address == "" {
		return nil, fmt.Errorf("target %q: want NAME=KIND:ADDRESS[,options]", s)
	}
	t := &target{name: name, kind: kind, address: address, every: 10 * time.Millisecond, timeout: time.Second, inflight: 16}
	if opts != "" {
		for _, opt := range strings.Split(opts, ",") {
			if err := t.setOption(opt); err != nil {
				return nil, fmt.Errorf("target %q: %w", s, err)
			}
		}
	}
	if err := t.setAttempt(); err != nil {
		return nil, fmt.Errorf("target %q: %w", s, err)
	}
	if t.every <= 0 || t.timeout <= 0 || t.inflight <= 0 {
		return nil, fmt.Errorf("target %q: every, timeout and inflight must be positive", s)
	}
	t.counts = TargetCounts{Kind: kind, Address: address, Every: t.every.String(), Timeout: t.timeout.String(),
		Endpoints: map[string]uint64{}, LastFailures: []Failure{}}
	return t, nil
}

func (t *target) setOption(opt string) error {
	key, value, _ := strings.Cut(opt, "=")
	var err error
	switch key {
	case "every":
		t.every, err = time.ParseDuration(value)
	case "timeout":
		t.timeout, err = time.ParseDuration(value)
	case "inflight":
		t.inflight, err = strconv.Atoi(value)
	case "name":
		t.dnsName = value
	default:
		return fmt.Errorf("unknown option %q", key)
	}
	if err != nil {
		return fmt.Errorf("option %s: %w", key, err)
	}
	return nil
}

func (t *target) setAttempt() error {
	if _, _, err := net.SplitHostPort(t.address); err != nil {
		return fmt.Errorf("address: %w", err)
	}
	switch t.kind {
	case "tcp":
		t.attempt = func(ctx context.Context) (string, error) { return tryTCP(ctx, t.address) }
	case "tls":
		t.attempt = func(ctx context.Context) (string, error) { return tryTLS(ctx, t.address) }
	case "http":
		client := newHTTPClient()
		t.attempt = func(ctx context.Context) (string, error) { return tryHTTP(ctx, client, t.address) }
	case "dns-udp", "dns-tcp":
		if t.dnsName == "" {
			return fmt.Errorf("kind %s needs name=DNS-NAME", t.kind)
		}
		network := strings.TrimPrefix(t.kind, "dns-")
		t.attempt = func(ctx context.Context) (string, error) { return tryDNS(ctx, network, t.address, t.dnsName) }
	default:
		return fmt.Errorf("unknown kind %q (tcp, tls, http, dns-udp, dns-tcp)", t.kind)
	}
	return nil
}

// probe runs every target's loop and serves their counts.
type probe struct {
	log     *slog.Logger
	started time.Time
	targets []*target
}

func newProbe(log *slog.Logger, targets []*target) *probe {
	return &probe{log: log, started: time.Now(), targets: targets}
}

// run runs the loops until ctx ends, then waits for the attempts in flight.
func (p *probe) run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, t := range p.targets {
		wg.Go(func() { p.loop(ctx, t) })
	}
	wg.Wait()
}

// loop starts one attempt each beat, when fewer than inflight are running.
func (p *probe) loop(ctx context.Context, t *target) {
	var attempts sync.WaitGroup
	defer attempts.Wait()
	slots := make(chan struct{}, t.inflight)
	tick := time.NewTicker(t.every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		select {
		case slots <- struct{}{}:
			attempts.Go(func() {
				defer func() { <-slots }()
				actx, cancel := context.WithTimeout(ctx, t.timeout)
				defer cancel()
				endpoint, err := t.attempt(actx)
				if ctx.Err() != nil {
					return // stopping: an attempt cut short is nobody's failure
				}
				p.record(t, endpoint, err)
			})
		default:
			p.record(t, "", fmt.Errorf("%w: %d attempts in flight", errOverrun, t.inflight))
		}
	}
}

// record counts one attempt's outcome, and logs a failure.
func (p *probe) record(t *target, endpoint string, err error) {
	now := time.Now()
	var reason string
	if err != nil {
		reason = classify(err)
	}
	t.mu.Lock()
	c := &t.counts
	if err == nil {
		c.OK++
		if endpoint != "" {
			c.Endpoints[endpoint]++
		}
	} else {
		c.Failed++
		c.Reasons.add(reason)
		c.LastFailures = append(c.LastFailures, Failure{Time: now, Reason: reason, Error: err.Error()})
		if len(c.LastFailures) > lastFailures {
			c.LastFailures = c.LastFailures[1:]
		}
	}
	t.mu.Unlock()
	if err != nil {
		p.log.Warn("failed", "target", t.name, "reason", reason, "err", err.Error())
	}
}

// lastFailures is how many recent failures each target keeps.
const lastFailures = 20

// Counts is what GET /counts returns.
type Counts struct {
	Started time.Time               `json:"started"` // when the probe started
	Now     time.Time               `json:"now"`     // when these counts were read
	Targets map[string]TargetCounts `json:"targets"` // by -target NAME
}

// TargetCounts are one target's counts since the probe started.
type TargetCounts struct {
	Kind    string  `json:"kind"`    // tcp, tls, http, dns-udp, dns-tcp
	Address string  `json:"address"` // host:port tried
	Every   string  `json:"every"`   // the beat, e.g. "10ms"
	Timeout string  `json:"timeout"` // each attempt's bound, e.g. "1s"
	OK      uint64  `json:"ok"`      // attempts that succeeded
	Failed  uint64  `json:"failed"`  // attempts that failed, overruns included
	Reasons Reasons `json:"reasons"`
	// Endpoints counts successes by the answering endpoint's IP: the first
	// word of the echoserver's line (tcp) or body (http). Empty for dns.
	Endpoints map[string]uint64 `json:"endpoints"`
	// LastFailures are the most recent failures (at most 20), oldest first.
	LastFailures []Failure `json:"last_failures"`
}

// Reasons counts failures by cause; they add up to Failed.
type Reasons struct {
	Timeout uint64 `json:"timeout"` // no answer within the timeout
	Refused uint64 `json:"refused"` // ECONNREFUSED (a TCP RST to the SYN, an ICMP port unreachable)
	Reset   uint64 `json:"reset"`   // ECONNRESET: the connection was reset once made
	Answer  uint64 `json:"answer"`  // answered, but wrongly: no line, a non-2xx, NXDOMAIN or no A record
	Overrun uint64 `json:"overrun"` // a beat found every in-flight slot taken
	Other   uint64 `json:"other"`   // anything else (e.g. no route)
}

// Failure is one failed attempt.
type Failure struct {
	Time   time.Time `json:"time"`
	Reason string    `json:"reason"` // a Reasons field's JSON name
	Error  string    `json:"error"`
}

func (r *Reasons) add(reason string) {
	switch reason {
	case reasonTimeout:
		r.Timeout++
	case reasonRefused:
		r.Refused++
	case reasonReset:
		r.Reset++
	case reasonAnswer:
		r.Answer++
	case reasonOverrun:
		r.Overrun++
	default:
		r.Other++
	}
}

// snapshot copies every target's counts.
func (p *probe) snapshot() Counts {
	c := Counts{Started: p.started, Now: time.Now(), Targets: map[string]TargetCounts{}}
	for _, t := range p.targets {
		t.mu.Lock()
		tc := t.counts
		tc.Endpoints = make(map[string]uint64, len(t.counts.Endpoints))
		for ip, n := range t.counts.Endpoints {
			tc.Endpoints[ip] = n
		}
		tc.LastFailures = append([]Failure{}, t.counts.LastFailures...)
		t.mu.Unlock()
		c.Targets[t.name] = tc
	}
	return c
}

func (p *probe) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /counts", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(p.snapshot())
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}
