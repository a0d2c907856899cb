package testbed

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"
)

// kpipe's HTTP addresses inside the node namespace.
const (
	MetricsURL = "http://127.0.0.1:10249"
	HealthzURL = "http://127.0.0.1:10256"
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

	mu        sync.Mutex
	proc      *Process
	extra     []string // the extra flags of the current start
	starts    int
	logOffset int64 // where the current process's part of the log starts
}

// DefaultKpipeArgs are the flags the test bed runs kpipe with.
func (tb *Testbed) DefaultKpipeArgs() []string {
	return []string{
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
	if err := goBuild(tb.Root, false, bin, "./cmd/kpipe"); err != nil {
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
// the start) and every IP family has committed a full sync after the
// informer caches synced (see WaitSynced). On failure kpipe is left as it is
// (maybe running) and the error carries the tail of its log.
func (k *Kpipe) Start(extra ...string) error {
	k.mu.Lock()
	if k.proc != nil && !k.proc.Exited() {
		k.mu.Unlock()
		return errors.New("kpipe is already running")
	}
	argv := append([]string{"ip", "netns", "exec", k.netns(), k.Bin}, k.Args...)
	argv = append(argv, extra...)
	k.extra = append([]string(nil), extra...)
	if st, err := os.Stat(k.LogPath); err == nil {
		k.logOffset = st.Size()
	} else {
		k.logOffset = 0
	}
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
// extra flags given to Start.
func (k *Kpipe) CurrentArgs() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
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

// WaitSynced waits until the running kpipe has synced its rules: its log (JSON,
// debug level, as DefaultKpipeArgs asks) shows, after "informer caches
// synced", a full "committed" for every family named in "kpipe starting".
// /healthz is no help there: like kube-proxy's it answers 200 before the first
// sync.
func (k *Kpipe) WaitSynced(timeout time.Duration) error {
	k.mu.Lock()
	p, off := k.proc, k.logOffset
	k.mu.Unlock()
	if p == nil {
		return errors.New("kpipe was never started")
	}
	deadline := time.Now().Add(timeout)
	var state string
	for {
		if p.Exited() {
			return fmt.Errorf("kpipe exited during start-up: %v\n--- kpipe log (%s):\n%s", p.ExitErr(), k.LogPath, p.Tail(40))
		}
		ok, st, err := syncedInLog(k.LogPath, off)
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		state = st
		if time.Now().After(deadline) {
			return fmt.Errorf("kpipe has not synced (%s; the test bed reads this from kpipe's JSON debug log)\n--- kpipe log (%s):\n%s", state, k.LogPath, p.Tail(40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// syncedInLog reads kpipe's log from offset (one process's run) and says
// whether every family it programs has committed a full sync since its caches
// synced; otherwise, how far it got.
func syncedInLog(path string, offset int64) (bool, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, "", fmt.Errorf("read kpipe log: %w", err)
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return false, "", fmt.Errorf("read kpipe log: %w", err)
	}
	var families []int
	cachesSynced := false
	committed := map[int]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 || line[0] != '{' {
			continue
		}
		var rec struct {
			Msg      string `json:"msg"`
			Families string `json:"families"`
			Family   any    `json:"family"`
			Full     bool   `json:"full"`
		}
		if json.Unmarshal(line, &rec) != nil {
			continue
		}
		switch rec.Msg {
		case "kpipe starting":
			families = nil
			for _, name := range strings.Fields(strings.Trim(rec.Families, "[]")) {
				switch name {
				case "IPv4":
					families = append(families, 4)
				case "IPv6":
					families = append(families, 6)
				}
			}
		case "informer caches synced":
			cachesSynced = true
		case "committed":
			if cachesSynced && rec.Full {
				committed[familyNumber(rec.Family)] = true
			}
		}
	}
	if len(families) == 0 {
		return false, "not started yet", nil
	}
	if !cachesSynced {
		return false, "informer caches not synced yet", nil
	}
	var missing []string
	for _, f := range families {
		if !committed[f] {
			missing = append(missing, fmt.Sprintf("IPv%d", f))
		}
	}
	if len(missing) > 0 {
		return false, fmt.Sprintf("no full commit since the caches synced for %v", missing), nil
	}
	return true, "", nil
}

// familyNumber reads a log's family field: 4 or 6, or "IPv4"/"IPv6".
func familyNumber(v any) int {
	switch f := v.(type) {
	case float64:
		return int(f)
	case string:
		switch f {
		case "IPv4", "4":
			return 4
		case "IPv6", "6":
			return 6
		}
	}
	return 0
}
