package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// stopGrace is how long a stopped control-plane process gets to exit after
// SIGTERM before it is killed (kube-apiserver's graceful shutdown can take
// longer: a kill is an outage too).
const stopGrace = 5 * time.Second

// stop ends p: SIGTERM, SIGKILL after stopGrace. Either way it is gone.
func stop(p *Process) error {
	_ = p.Stop(stopGrace)
	if !p.Exited() {
		return fmt.Errorf("%s still running after SIGKILL", p.Name)
	}
	return nil
}

// StopAPIServer stops the kube-apiserver: every client's watch is closed and
// every request refused until StartAPIServer.
func (tb *Testbed) StopAPIServer() error { return stop(tb.apiserver) }

// StartAPIServer starts the kube-apiserver again, with the flags it first ran
// with, and waits until it is ready (etcd must be running).
func (tb *Testbed) StartAPIServer(ctx context.Context) error {
	p, err := startAgain(tb.apiserver, tb.apiserverArgv)
	if err != nil {
		return err
	}
	tb.apiserver = p
	tb.track(p)
	if err := tb.waitReady(ctx, 90*time.Second); err != nil {
		return fmt.Errorf("%w\n--- kube-apiserver log (%s):\n%s", err, p.LogPath, p.Tail(40))
	}
	return nil
}

// startAgain starts a stopped control-plane process again with argv, logging
// to the same file.
func startAgain(p *Process, argv []string) (*Process, error) {
	if !p.Exited() {
		return nil, fmt.Errorf("%s is already running", p.Name)
	}
	return startProcess(p.Name, p.LogPath, nil, argv...)
}

// APIServerRunning says whether the kube-apiserver process is alive.
func (tb *Testbed) APIServerRunning() bool { return !tb.apiserver.Exited() }

// EtcdRunning says whether the etcd process is alive.
func (tb *Testbed) EtcdRunning() bool { return !tb.etcd.Exited() }

// StopEtcd stops etcd (SIGTERM). Stop the apiserver first.
func (tb *Testbed) StopEtcd() error { return stop(tb.etcd) }

// StartEtcd starts etcd again on its data dir, with the flags it first ran with.
// The apiserver's StartAPIServer waits for both to serve.
func (tb *Testbed) StartEtcd() error {
	p, err := startAgain(tb.etcd, tb.etcdArgv)
	if err != nil {
		return err
	}
	tb.etcd = p
	tb.track(p)
	return nil
}

// SnapshotEtcd copies etcd's data dir, which is a consistent snapshot while
// etcd is stopped, and returns the copy's path for RestoreEtcd.
func (tb *Testbed) SnapshotEtcd(name string) (string, error) {
	if !tb.etcd.Exited() {
		return "", errors.New("snapshot of etcd's data dir: stop etcd first")
	}
	dst := tb.path("etcd-snapshot-" + name)
	if err := copyDir(tb.path("etcd-data"), dst); err != nil {
		return "", fmt.Errorf("snapshot etcd: %w", err)
	}
	return dst, nil
}

// RestoreEtcd wipes etcd's data dir and puts snapshot (from SnapshotEtcd) in
// its place: started again, etcd holds what it held then, at the revision it
// had then, so resourceVersions handed out since go back.
func (tb *Testbed) RestoreEtcd(snapshot string) error {
	if !tb.etcd.Exited() {
		return errors.New("restore etcd: stop etcd first")
	}
	data := tb.path("etcd-data")
	if err := os.RemoveAll(data); err != nil {
		return fmt.Errorf("wipe etcd data: %w", err)
	}
	if err := copyDir(snapshot, data); err != nil {
		return fmt.Errorf("restore etcd: %w", err)
	}
	return nil
}

// copyDir copies the tree src to dst (which must not exist), keeping modes.
func copyDir(src, dst string) error {
	if _, err := os.Stat(dst); err == nil {
		return fmt.Errorf("%s exists", dst)
	}
	if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("cp -a %s %s: %w: %s", src, dst, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// RulesetMonitor watches the node's nf_tables ruleset (`nft monitor`) and
// counts what is written to it: every transaction that any process commits
// (iptables-restore runs, iptables -N/-I, ...), and the rules added and
// deleted. It is the kernel's own account of writes, kpipe's metrics aside.
type RulesetMonitor struct {
	proc *Process
	mu   sync.Mutex
	// transactions are the "# new generation N by process P (name)" lines.
	transactions []string
	rulesAdded   int
	rulesDeleted int
	chains       int // chains created or deleted
	ready        chan struct{}
}

// MonitorRuleset starts counting the node namespace's ruleset writes.
func (tb *Testbed) MonitorRuleset() (*RulesetMonitor, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	m := &RulesetMonitor{ready: make(chan struct{})}
	logPath := tb.path(fmt.Sprintf("nft-monitor-%d.log", time.Now().UnixNano()))
	cmd := exec.Command("ip", "netns", "exec", tb.NodeNS, "nft", "monitor")
	cmd.Stdout = w
	cmd.Stderr = w
	if err := startCmd(cmd); err != nil {
		r.Close()
		w.Close()
		return nil, fmt.Errorf("start nft monitor: %w", err)
	}
	w.Close()
	m.proc = &Process{Name: "nft monitor", LogPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		m.proc.waitErr = cmd.Wait()
		close(m.proc.done)
	}()
	tb.track(m.proc)
	go m.read(r, logPath)
	// nft monitor prints nothing when it is listening; give it a moment to
	// subscribe, then prove it by a write of our own that it must see.
	if err := m.probe(tb); err != nil {
		m.Stop()
		return nil, err
	}
	return m, nil
}

func (m *RulesetMonitor) read(r *os.File, logPath string) {
	defer r.Close()
	log, _ := os.Create(logPath)
	if log != nil {
		defer log.Close()
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if log != nil {
			fmt.Fprintln(log, l)
		}
		m.mu.Lock()
		switch {
		case strings.HasPrefix(l, "# new generation"):
			m.transactions = append(m.transactions, l)
		case strings.HasPrefix(l, "add rule"), strings.HasPrefix(l, "insert rule"):
			m.rulesAdded++
		case strings.HasPrefix(l, "delete rule"):
			m.rulesDeleted++
		case strings.HasPrefix(l, "add chain"), strings.HasPrefix(l, "create chain"), strings.HasPrefix(l, "delete chain"):
			m.chains++
		case strings.Contains(l, probeTable):
			select {
			case <-m.ready:
			default:
				close(m.ready)
			}
		}
		m.mu.Unlock()
	}
}

// probeTable is a table the monitor's probe adds and deletes.
const probeTable = "kpe2e_monitor_probe"

// probe adds and deletes a table of its own until the monitor reports it, then
// forgets the counts so far.
func (m *RulesetMonitor) probe(tb *Testbed) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := tb.Exec(tb.NodeNS, "nft", "add table inet "+probeTable+"; delete table inet "+probeTable); err != nil {
			return fmt.Errorf("nft monitor probe: %w", err)
		}
		select {
		case <-m.ready:
			time.Sleep(200 * time.Millisecond) // let the probe's own lines through
			m.Reset()
			return nil
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return errors.New("nft monitor did not report a write within 10s")
		}
	}
}

// Writes is what the monitor counted since it started (or was Reset).
type Writes struct {
	Transactions             int
	RulesAdded, RulesDeleted int
	ChainsCreatedOrDeleted   int
	TransactionLines         []string
}

func (w Writes) String() string {
	return fmt.Sprintf("%d transactions, %d rules added, %d deleted, %d chains created or deleted",
		w.Transactions, w.RulesAdded, w.RulesDeleted, w.ChainsCreatedOrDeleted)
}

// Writes returns the counts so far.
func (m *RulesetMonitor) Writes() Writes {
	m.mu.Lock()
	defer m.mu.Unlock()
	return Writes{Transactions: len(m.transactions), RulesAdded: m.rulesAdded, RulesDeleted: m.rulesDeleted,
		ChainsCreatedOrDeleted: m.chains, TransactionLines: append([]string(nil), m.transactions...)}
}

// Reset sets the counts to zero.
func (m *RulesetMonitor) Reset() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.transactions, m.rulesAdded, m.rulesDeleted, m.chains = nil, 0, 0, 0
}

// Stop ends the monitor.
func (m *RulesetMonitor) Stop() { _ = m.proc.Stop(5 * time.Second) }

// xtablesLock is the lock iptables-legacy takes (and iptables-nft does not);
// `ip netns exec` shares /run, so the node's iptables sees the host's file.
const xtablesLock = "/run/xtables.lock"

// HoldXtablesLock has another process take the xtables lock, as another
// iptables writer would, for d at most; release ends it sooner. It returns once
// the lock is held.
func (tb *Testbed) HoldXtablesLock(d time.Duration) (release func(), err error) {
	p, err := startProcess("flock", tb.path("flock.log"), nil,
		"flock", "--exclusive", "--no-fork", xtablesLock, "sleep", fmt.Sprintf("%.3f", d.Seconds()))
	if err != nil {
		return nil, err
	}
	tb.track(p)
	release = func() { _ = p.Stop(time.Second) }
	if err := Poll(5*time.Second, 20*time.Millisecond, func() error {
		if p.Exited() {
			return fmt.Errorf("flock exited: %v: %s", p.ExitErr(), p.Tail(5))
		}
		if !XtablesLockHeld() {
			return errors.New("the xtables lock is not held yet")
		}
		return nil
	}); err != nil {
		release()
		return nil, err
	}
	return release, nil
}

// XtablesLockHeld says whether some process holds the xtables lock now.
func XtablesLockHeld() bool {
	_, err := Run("flock", "--nonblock", "--shared", xtablesLock, "true")
	return err != nil
}
