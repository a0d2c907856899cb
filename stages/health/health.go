// Package health is the health stage: it serves kube-proxy's HTTP surface — /healthz
// and /livez on the healthz listener; /metrics, /proxyMode, /configz, /healthz (and
// pprof with kube-proxy's --profiling) and kpipe's /sync and /status on the
// metrics listener — kpipe's debug
// handlers (pprof, /debug/stages) on their own listener, and one HTTP server per
// healthCheckNodePort, from what the other stages publish on the board and in the
// health-check mailbox.
package health

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	k8sevents "k8s.io/client-go/tools/events"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/supervise"
)

// Config says where and what the health stage serves.
type Config struct {
	HealthzAddr string // e.g. "0.0.0.0:10256"; "" disables
	MetricsAddr string // e.g. "127.0.0.1:10249"; "" disables
	// Profiling serves pprof (/debug/pprof/...) on the metrics listener, as
	// kube-proxy's --profiling does. Never the Stages handler.
	Profiling bool
	// DebugAddr is the debug listener (pprof and the Stages handler, which can
	// kill stages), e.g. "127.0.0.1:10247"; "" disables it. The only listener
	// that serves Stages.
	DebugAddr  string
	SyncPeriod time.Duration // health timeout is 2 × SyncPeriod (≤ 0: kube-proxy's default, 30s)
	NodeName   string
	// Families are the families whose commit stages must report (e.g. [IPv4] or
	// [IPv4, IPv6]); empty means [IPv4].
	Families []bus.Family
	// SideStages name stages (e.g. "conntrack-ipv4", "canary") whose failures never
	// decide /healthz or /livez but are listed in their bodies, under "degraded",
	// while their last error is younger than the health timeout.
	SideStages []bus.StageName
	// Configz is served as JSON at /configz, under kube-proxy's configz key
	// ("kubeproxy.config.k8s.io"), as kube-proxy serves its configuration: kpipe
	// gives it in the shape of kube-proxy's internal configuration.
	Configz any
	// BindHardFail (kube-proxy's bindAddressHardFail) makes a healthz or metrics
	// port that cannot be bound stop kpipe (Params.Fatal); without it the stage
	// tries again every bindRetry, as kube-proxy does, while everything else keeps
	// running. kpipe's debug listener is always retried.
	BindHardFail bool
}

const (
	defaultSyncPeriod = 30 * time.Second
	// shutdownGrace bounds how long Run waits for in-flight requests when ctx ends.
	shutdownGrace = 5 * time.Second
	// readHeaderTimeout guards every server against slow-header clients.
	readHeaderTimeout = 30 * time.Second
	// bindRetry is the wait between attempts to bind a listener whose port is
	// taken: kube-proxy restarts its healthz and metrics servers every 5 s.
	bindRetry = 5 * time.Second
)

// Health is the health stage. Make it with New; Run may be called again after it
// returns (the supervisor's restart): it re-binds its ports and reopens the
// healthCheckNodePort servers from the last health checks it took.
type Health struct {
	cfg      Config
	families []bus.Family
	timeout  time.Duration
	board    *bus.Board
	gatherer prometheus.Gatherer
	metrics  *metrics.Metrics
	checks   *bus.Mailbox[bus.HealthCheckUpdates]
	stages   http.Handler
	// stageStatus lists the supervised stages for /status; nil: none.
	stageStatus func() []supervise.Status
	reloads     *Reloads                     // nil: no reload yet
	setV        func(string) (string, error) // /debug/flags/v's PUT (with Profiling); nil: not served
	log         *slog.Logger
	recorder    k8sevents.EventRecorder // nil: no events
	fatal       func(error)

	// started stands for kube-proxy's "Updated() at the start of SyncLoop": a family
	// that has never committed counts as updated at this time.
	started time.Time
	now     func() time.Time
	grace   time.Duration
	// after waits before binding a taken port again (time.After; tests fake it).
	after func(time.Duration) <-chan time.Time

	// latest holds the last HealthChecks taken per family; it outlives a Run so a
	// restarted Run reopens the servers the mailbox no longer holds. Only Run touches it.
	latest map[bus.Family]bus.HealthChecks

	mu    sync.Mutex // guards bound
	bound map[string]net.Addr
}

// Params wire the health stage.
type Params struct {
	Config Config
	// Board carries the other stages' reports (required).
	Board *bus.Board
	// Gatherer is what /metrics serves.
	Gatherer prometheus.Gatherer
	// Checks are the healthCheckNodePort answers (one HealthChecks per family).
	Checks *bus.Mailbox[bus.HealthCheckUpdates]
	// Stages is the supervisor's /debug/stages handler (mounted only on the
	// debug listener; may be nil).
	Stages http.Handler
	// StageStatus lists the supervised stages, read-only, for /status on the
	// metrics listener (the supervisor's Status); nil: none listed.
	StageStatus func() []supervise.Status
	// Reloads is the config file's last reload, for /status; nil: none.
	Reloads *Reloads
	// SetVerbosity sets the log verbosity from a PUT to /debug/flags/v,
	// served with Profiling as kube-proxy does, and says what it did; nil:
	// not served.
	SetVerbosity func(string) (string, error)
	// Env's metrics count the /healthz and /livez answers.
	Env bus.Env
	// Recorder records a Warning on a Service whose healthCheckNodePort cannot be
	// bound, as kube-proxy does; nil records nothing.
	Recorder k8sevents.EventRecorder
	// Fatal, with BindHardFail, is told the *BindError of a healthz or metrics
	// port that cannot be bound: it stops kpipe at once, where Run's error
	// would only restart the stage. Nil: Run returns the error.
	Fatal func(error)
}

// BindError is a healthz or metrics listener that could not be bound. Its text
// is the note of kube-proxy's event for it.
type BindError struct {
	Metrics bool // the metrics listener; else healthz
	Addr    string
	Err     error
}

func (e *BindError) Error() string {
	if e.Metrics {
		return fmt.Sprintf("starting metrics server failed: %v", e.Err)
	}
	return fmt.Sprintf("healthz server failed: failed to start proxy healthz on %s: %v", e.Addr, e.Err)
}

func (e *BindError) Unwrap() error { return e.Err }

// NewStage makes the health stage.
func NewStage(p Params) *Health {
	cfg, board, log := p.Config, p.Board, p.Env.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	bus.MustBoard(board, "the health stage")
	period := cfg.SyncPeriod
	if period <= 0 {
		period = defaultSyncPeriod
	}
	var families []bus.Family
	seen := map[bus.Family]bool{}
	for _, f := range cfg.Families {
		if !seen[f] {
			seen[f] = true
			families = append(families, f)
		}
	}
	if len(families) == 0 {
		families = []bus.Family{bus.IPv4}
	}
	return &Health{
		cfg:         cfg,
		families:    families,
		timeout:     2 * period,
		board:       board,
		gatherer:    p.Gatherer,
		metrics:     p.Env.Metrics,
		checks:      p.Checks,
		stages:      p.Stages,
		stageStatus: p.StageStatus,
		reloads:     p.Reloads,
		setV:        p.SetVerbosity,
		log:         log,
		recorder:    p.Recorder,
		fatal:       p.Fatal,
		started:     time.Now(),
		now:         time.Now,
		grace:       shutdownGrace,
		after:       time.After,
		latest:      map[bus.Family]bus.HealthChecks{},
		bound:       map[string]net.Addr{},
	}
}

// listenerNames for boundAddr.
const (
	healthzListener = "healthz"
	metricsListener = "metrics"
	debugListener   = "debug"
)

// boundAddr is the address a listener of the running Run is bound to (nil when not
// listening); tests pass ":0"-style addresses and ask for the real one here.
func (h *Health) boundAddr(name string) net.Addr {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.bound[name]
}

func (h *Health) setBound(name string, a net.Addr) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if a == nil {
		delete(h.bound, name)
	} else {
		h.bound[name] = a
	}
}

// Run serves until ctx ends (then shuts the servers down gracefully, closes every
// healthCheckNodePort listener and returns nil) or a serving healthz, metrics or
// debug listener fails (then returns the error). A healthz or metrics port that
// cannot be bound goes to Fatal with BindHardFail (see hardFail); otherwise it is
// retried in the background. Every port is released when Run returns.
func (h *Health) Run(ctx context.Context) error {
	if ctx.Err() != nil {
		return nil
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errc := make(chan error, 3)
	hc := newServiceServers(h, &wg)
	defer func() {
		cancel() // stops the listeners, which shut their servers down gracefully
		hc.closeAll()
		wg.Wait()
	}()

	listeners := []struct {
		name, addr string
		handler    func() http.Handler
	}{
		{healthzListener, h.cfg.HealthzAddr, h.healthzMux},
		{metricsListener, h.cfg.MetricsAddr, h.metricsMux},
		{debugListener, h.cfg.DebugAddr, h.debugMux},
	}
	for _, l := range listeners {
		if l.addr == "" {
			continue
		}
		ln, err := listen(ctx, l.addr)
		if err != nil {
			if h.cfg.BindHardFail && l.name != debugListener {
				return h.hardFail(ctx, &BindError{Metrics: l.name == metricsListener, Addr: l.addr, Err: err})
			}
			h.log.Warn("cannot bind; retrying in the background", "listener", l.name, "err", err, "retryIn", bindRetry)
		}
		handler := l.handler()
		wg.Go(func() { h.serveListener(ctx, l.name, l.addr, ln, handler, errc) })
	}

	// Reopen what a previous Run served, then follow the mailbox.
	var ready <-chan struct{}
	if h.checks != nil {
		ready = h.checks.Ready()
		if v, ok := h.checks.TryTake(); ok {
			maps.Copy(h.latest, v)
		}
	}
	hc.sync(h.latest)
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			h.log.Error("listener failed", "err", err)
			return err
		case <-ready:
			if v, ok := h.checks.TryTake(); ok {
				maps.Copy(h.latest, v)
				hc.sync(h.latest)
			}
		}
	}
}

// hardFail hands err to Fatal and waits for ctx to end: like kube-proxy's
// server, it never retries, and a supervisor restart would only delay the stop.
// Without Fatal it returns err.
func (h *Health) hardFail(ctx context.Context, err error) error {
	if h.fatal == nil {
		return err
	}
	h.log.Error("cannot bind with bindAddressHardFail; stopping kpipe", "err", err)
	h.fatal(err)
	<-ctx.Done()
	return nil
}

// listen binds addr; its error names the address (a *net.OpError).
func listen(ctx context.Context, addr string) (net.Listener, error) {
	return (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
}

// serveListener serves handler on ln until ctx ends, then shuts the server down
// gracefully. A nil ln is bound first, tried every bindRetry until it succeeds or
// ctx ends. A serve error goes to errc.
func (h *Health) serveListener(ctx context.Context, name, addr string, ln net.Listener, handler http.Handler, errc chan<- error) {
	for ln == nil {
		select {
		case <-ctx.Done():
			return
		case <-h.after(bindRetry):
		}
		var err error
		if ln, err = listen(ctx, addr); err != nil {
			h.log.Warn("cannot bind; retrying", "listener", name, "err", err, "retryIn", bindRetry)
		}
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: readHeaderTimeout,
		ErrorLog: slog.NewLogLogger(h.log.Handler(), slog.LevelWarn)}
	h.setBound(name, ln.Addr())
	defer h.setBound(name, nil)
	h.log.Info("serving", "listener", name, "addr", ln.Addr().String())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		_ = ln.Close()
		errc <- fmt.Errorf("serve %s on %s: %w", name, addr, err)
	case <-ctx.Done():
		// Graceful first; whatever is still running after the grace period is cut.
		sctx, cancelShutdown := context.WithTimeout(context.Background(), h.grace)
		defer cancelShutdown()
		if err := srv.Shutdown(sctx); err != nil {
			h.log.Warn("graceful shutdown cut short", "listener", name, "err", err)
			_ = srv.Close()
		}
		<-served
	}
}
