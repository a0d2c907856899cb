package testbed

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// kpipe's HTTP addresses inside the node namespace. The debug handlers (pprof,
// /debug/stages and the kill endpoint) are on their own listener, kpipe's default
// --debug-bind-address.
const (
	MetricsURL = "http://127.0.0.1:10249"
	HealthzURL = "http://127.0.0.1:10256"
	DebugURL   = "http://127.0.0.1:10247"
)

// Kpipe is the kpipe process under test, running inside the node namespace.
type Kpipe struct {
	tb      *Testbed
	Bin     string
	LogPath string
	// Args are the flags every start gets (see DefaultKpipeArgs); extra flags
	// given to Start come after them.
	Args []string
	// ns is the network namespace kpipe runs in; "" is the node's.
	ns string

	mu     sync.Mutex
	proc   *Process
	extra  []string // the extra flags of the current start
	whole  bool     // the current start had only extra (StartWith), not Args
	starts int
}

// WriterEnv picks the rule writer every test runs kpipe with
// (--iptables-writer): netlink, kpipe's default, when unset.
const WriterEnv = "KPIPE_E2E_WRITER"

// DefaultKpipeArgs are the flags the test bed runs kpipe with.
func (tb *Testbed) DefaultKpipeArgs() []string {
	args := []string{
		"--kubeconfig", tb.Kubeconfig,
		"--hostname-override", NodeName,
		"--cluster-cidr", ClusterCIDR,
		"--iptables-min-sync-period", "100ms",
		"--iptables-sync-period", "5s",
		"--canary-interval", "1s",
		"--healthz-bind-address", "0.0.0.0:10256",
		"--metrics-bind-address", "127.0.0.1:10249",
		"--enable-debug-handlers",
		"--log-format", "json",
		"--log-level", "debug",
	}
	if w := os.Getenv(WriterEnv); w != "" {
		args = append(args, "--iptables-writer", w)
	}
	return args
}

// BuildKpipe builds ./cmd/kpipe into the run dir and returns a Kpipe ready to
// Start. The binary is built once per test bed.
func (tb *Testbed) BuildKpipe() (*Kpipe, error) {
	tb.mu.Lock()
	k := tb.kpipe
	tb.mu.Unlock()
	if k != nil {
		return k, nil
	}
	bin := tb.path("kpipe")
	if err := GoBuild(tb.Root, false, nil, bin, "./cmd/kpipe"); err != nil {
		return nil, err
	}
	k = &Kpipe{tb: tb, Bin: bin, LogPath: tb.path("kpipe.log"), Args: tb.DefaultKpipeArgs()}
	tb.mu.Lock()
	tb.kpipe = k
	tb.mu.Unlock()
	return k, nil
}

// Kpipe is the kpipe of this test bed, nil before BuildKpipe succeeded.
func (tb *Testbed) Kpipe() *Kpipe {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return tb.kpipe
}

// Start starts kpipe (extra flags after the default ones) and waits until it
// has synced: /healthz answers 200 (which, as with kube-proxy, it does from
// the start) and GET /sync shows a full sync of every IP family (see
// WaitSynced). On failure kpipe is left as it is
// (maybe running) and the error carries the tail of its log.
func (k *Kpipe) Start(extra ...string) error { return k.start(false, extra) }

// StartWith is Start with the complete argument list: none of Args, only args
// (as a kube-proxy manifest would run it). Restart and Start go back to Args.
func (k *Kpipe) StartWith(args ...string) error { return k.start(true, args) }

func (k *Kpipe) start(whole bool, extra []string) error {
	k.mu.Lock()
	if k.proc != nil && !k.proc.Exited() {
		k.mu.Unlock()
		return errors.New("kpipe is already running")
	}
	argv := []string{"ip", "netns", "exec", k.netns(), k.Bin}
	if !whole {
		argv = append(argv, k.Args...)
	}
	argv = append(argv, extra...)
	k.extra = append([]string(nil), extra...)
	k.whole = whole
	p, err := startProcess("kpipe", k.LogPath, nil, argv...)
	if err != nil {
		k.mu.Unlock()
		return err
	}
	k.proc = p
	k.starts++
	k.mu.Unlock()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for {
		if p.Exited() {
			return fmt.Errorf("kpipe exited during start-up: %v\n--- kpipe log (%s):\n%s", p.ExitErr(), k.LogPath, p.Tail(40))
		}
		code, body, err := k.tb.HTTPGet(k.netns(), HealthzURL+"/healthz")
		if err == nil && code == 200 {
			return k.WaitSynced(time.Until(deadline))
		}
		if err != nil {
			last = err.Error()
		} else {
			last = fmt.Sprintf("HTTP %d: %s", code, body)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kpipe not healthy 30s after start (last /healthz: %s)\n--- kpipe log (%s):\n%s", last, k.LogPath, p.Tail(40))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// netns is the network namespace kpipe runs in.
func (k *Kpipe) netns() string {
	if k.ns == "" {
		return k.tb.NodeNS
	}
	return k.ns
}

// CurrentArgs are the flags of the current (or last) start: Args, then the
// extra flags given to Start (only the latter after StartWith).
func (k *Kpipe) CurrentArgs() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.whole {
		return append([]string(nil), k.extra...)
	}
	return append(append([]string(nil), k.Args...), k.extra...)
}

// Stop sends SIGTERM and waits for kpipe to exit (SIGKILL after 15 s). It
// returns kpipe's exit error: nil when it exited 0.
func (k *Kpipe) Stop() error {
	p := k.current()
	if p == nil {
		return nil
	}
	return p.Stop(15 * time.Second)
}

// Pause freezes kpipe with SIGSTOP: it keeps its state, and its rules stay in
// the kernel, but it reacts to nothing (nf_tables notifications queue in its
// socket) until resume sends SIGCONT.
func (k *Kpipe) Pause() (resume func() error, err error) {
	p := k.current()
	if p == nil || p.Exited() {
		return nil, fmt.Errorf("pause kpipe: not running")
	}
	if err := syscall.Kill(p.PID(), syscall.SIGSTOP); err != nil {
		return nil, fmt.Errorf("pause kpipe: %w", err)
	}
	return func() error { return syscall.Kill(p.PID(), syscall.SIGCONT) }, nil
}

func (k *Kpipe) current() *Process {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.proc
}

func (k *Kpipe) stopQuiet() error {
	p := k.current()
	if p == nil || p.Exited() {
		return nil
	}
	if err := p.Stop(15 * time.Second); err != nil {
		return fmt.Errorf("stop kpipe: %w", err)
	}
	return nil
}

// Restart stops kpipe (if running) and starts it again.
func (k *Kpipe) Restart(extra ...string) error {
	if err := k.Stop(); err != nil {
		return fmt.Errorf("stop kpipe: %w", err)
	}
	return k.Start(extra...)
}

// Running reports whether the kpipe process is alive.
func (k *Kpipe) Running() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.proc != nil && !k.proc.Exited()
}

// PID is the pid of the current kpipe process (0 when none was started).
func (k *Kpipe) PID() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.proc == nil {
		return 0
	}
	return k.proc.PID()
}

// Starts is how many times kpipe was started.
func (k *Kpipe) Starts() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.starts
}

// LogTail is the end of kpipe's log (all starts, appended).
func (k *Kpipe) LogTail(n int) string { return tailFile(k.LogPath, n) }

// WaitSynced waits until the running kpipe has synced its rules: its GET
// /sync (on the metrics listener) answers and every IP family listed there
// has made a full sync since kpipe started (see syncedFrom). /healthz is no
// help there: like kube-proxy's it answers 200 before the first sync.
func (k *Kpipe) WaitSynced(timeout time.Duration) error {
	p := k.current()
	if p == nil {
		return errors.New("kpipe was never started")
	}
	exited := func() error {
		if p.Exited() {
			return fmt.Errorf("kpipe exited during start-up: %v", p.ExitErr())
		}
		return nil
	}
	if err := waitSynced(k.getSync, exited, timeout, 50*time.Millisecond); err != nil {
		return fmt.Errorf("%w\n--- kpipe log (%s):\n%s", err, k.LogPath, p.Tail(40))
	}
	return nil
}

// SyncURL is kpipe's sync-state endpoint, on its metrics listener.
const SyncURL = MetricsURL + "/sync"

// SyncState is kpipe's answer to GET /sync: one entry per IP family it runs,
// keyed by family name ("IPv4", "IPv6").
type SyncState map[string]FamilySync

// FamilySync is one IP family's sync state.
type FamilySync struct {
	Generation int64     `json:"generation"`
	LastSync   time.Time `json:"lastSync"`
	// LastFullSync is zero (absent in the JSON) until the family's first full
	// sync since kpipe started.
	LastFullSync time.Time `json:"lastFullSync"`
}

// Sync reads the running kpipe's GET /sync.
func (k *Kpipe) Sync() (SyncState, error) {
	code, body, err := k.getSync()
	if err != nil {
		return nil, err
	}
	return parseSync(code, body)
}

func (k *Kpipe) getSync() (int, []byte, error) { return k.tb.HTTPGet(k.netns(), SyncURL) }

// parseSync reads a GET /sync answer.
func parseSync(code int, body []byte) (SyncState, error) {
	if code != 200 {
		return nil, fmt.Errorf("GET /sync: HTTP %d: %s", code, strings.TrimSpace(string(body)))
	}
	var st SyncState
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("GET /sync: unreadable answer %q: %w", body, err)
	}
	return st, nil
}

// syncedFrom decides from a GET /sync answer whether kpipe has synced: it
// answered, and every family it lists has made a full sync since it started
// (kpipe's first commit is always full, and it commits only after its
// informer caches synced and the state was replayed). Otherwise it says what
// is missing.
func syncedFrom(code int, body []byte, err error) (bool, string) {
	if err != nil {
		return false, err.Error()
	}
	st, err := parseSync(code, body)
	if err != nil {
		return false, err.Error()
	}
	if len(st) == 0 {
		return false, "GET /sync lists no IP family"
	}
	var missing []string
	for family, f := range st {
		if f.LastFullSync.IsZero() {
			missing = append(missing, family)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return false, fmt.Sprintf("no full sync yet for %v", missing)
	}
	return true, ""
}

// waitSynced polls get (a GET /sync) every interval until syncedFrom says
// kpipe has synced, exited returns an error, or timeout passes.
func waitSynced(get func() (int, []byte, error), exited func() error, timeout, interval time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if err := exited(); err != nil {
			return err
		}
		ok, state := syncedFrom(get())
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kpipe has not synced in %v (%s)", timeout, state)
		}
		time.Sleep(interval)
	}
}
