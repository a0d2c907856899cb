// Package testbed runs kpipe for real: a kube-apiserver and etcd, a "node"
// network namespace with a pod bridge, pods as network namespaces running echo
// servers, an external client namespace, and the kpipe process itself inside
// the node namespace. The e2e tests and the demo are built on it.
//
// Layout (ID is random per run):
//
//	kpe2e-ID-client  eth0 198.51.100.2/24 2001:db8:1::2/64, default via the node;
//	                 also explicit routes via the node to the service range
//	                 (10.96.0.0/16, fd00:10:96::/112) and to the range tests take
//	                 LB ingress IPs and externalIPs from (203.0.113.0/24,
//	                 2001:db8:2::/64)
//	      | veth
//	kpe2e-ID-node    eth0 198.51.100.1/24 2001:db8:1::1/64; etcd, kube-apiserver
//	                 (127.0.0.1:6443) and kpipe run here; bridge kpbr0
//	                 10.244.0.1/24 fd00:10:244::1/64
//	      | kpvethN (bridge port)
//	kpe2e-ID-podN    eth0 10.244.0.(10+N)/24 fd00:10:244::(10+N)/64, echo server :8080
//
// The node forwards (IPv4 and IPv6), passes bridged traffic through iptables
// (bridge-nf-call-ip(6)tables), does not rate-limit the ICMP errors it sends
// (so quick successions of rejected connections are all refused at once), and
// its default routes lead to the client namespace, which does not forward:
// traffic to an address nobody translates is dropped there (a timeout).
// IPv6 duplicate address detection is off everywhere. Addresses in the
// external range are on no interface: the node DNATs what is addressed to a
// service's externalIP or LB IP and sends the rest back to the client, which
// drops it.
//
// Tests add what they need: second addresses (AddAddress), source-bound
// requests (DialTCPFrom, DialUDPFrom), hand-made TCP segments
// (SendTCPSegment), load-balancer status (SetLoadBalancerIngress), changes to
// the Node object (UpdateNode, UpdateNodeStatus).
//
// Everything is removed by Close, and namespaces left by runs that crashed are
// removed by the next New.
package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Config says what test bed to build.
type Config struct {
	// Pods is the number of pod namespaces (default 3).
	Pods int
	// Logf reports progress; default: discard.
	Logf func(format string, args ...any)
	// KeepDir keeps the run's temp dir (logs) after Close.
	KeepDir bool
}

// Testbed is one running test bed.
type Testbed struct {
	ID         string
	Dir        string // the run's temp dir: logs, kubeconfig, binaries
	Root       string // kpipe repository root
	NodeNS     string
	ClientNS   string
	Pods       []*Pod
	Token      string
	Kubeconfig string

	cfg        Config
	lock       *os.File
	handles    nsHandles
	restConfig *rest.Config
	client     kubernetes.Interface
	etcd       *Process
	apiserver  *Process
	kpipe      *Kpipe
	// etcdArgv and apiserverArgv start them again (StartEtcd, StartAPIServer).
	etcdArgv, apiserverArgv []string

	mu         sync.Mutex
	namespaces []string
	procs      []*Process
	closeOnce  sync.Once
	closeErr   error
}

// New builds and starts a test bed: control plane, node, client and pods with
// their echo servers, and the Node object. It does not start kpipe (see
// Testbed.Kpipe). On error everything made so far is removed.
func New(ctx context.Context, cfg Config) (_ *Testbed, err error) {
	if cfg.Pods <= 0 {
		cfg.Pods = 3
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("the e2e test bed needs root (network namespaces, iptables)")
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	RemoveLeftovers(cfg.Logf)

	tb := &Testbed{ID: randomHex(3), Root: root, cfg: cfg}
	tb.Dir = filepath.Join(os.TempDir(), NamePrefix+tb.ID)
	if err := os.Mkdir(tb.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("create run dir: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(tb.Dir, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		os.RemoveAll(tb.Dir)
		return nil, fmt.Errorf("create run lock: %w", err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		os.RemoveAll(tb.Dir)
		return nil, fmt.Errorf("take run lock: %w", err)
	}
	tb.lock = lock
	defer func() {
		if err != nil {
			tb.Close()
		}
	}()
	cfg.Logf("test bed %s in %s", tb.ID, tb.Dir)

	bins, err := EnsureControlPlane(root, cfg.Logf)
	if err != nil {
		return nil, err
	}
	echoBin := tb.path("echoserver")
	if err := GoBuild(root, false, nil, echoBin, "./e2e/echoserver"); err != nil {
		return nil, err
	}
	start := time.Now()
	if err := tb.buildTopology(cfg.Pods); err != nil {
		return nil, err
	}
	if err := tb.startControlPlane(ctx, bins); err != nil {
		return nil, err
	}
	if err := tb.startEchoServers(echoBin); err != nil {
		return nil, err
	}
	if err := tb.createNode(ctx); err != nil {
		return nil, err
	}
	cfg.Logf("test bed %s up in %v: control plane, node, client, %d pods", tb.ID, time.Since(start).Round(time.Millisecond), cfg.Pods)
	return tb, nil
}

func (tb *Testbed) path(name string) string { return filepath.Join(tb.Dir, name) }

func (tb *Testbed) track(p *Process) {
	tb.mu.Lock()
	tb.procs = append(tb.procs, p)
	tb.mu.Unlock()
}

// Client is a Kubernetes client for the test bed's apiserver.
func (tb *Testbed) Client() kubernetes.Interface { return tb.client }

// RESTConfig is the client configuration Client uses (dialing from the node
// namespace).
func (tb *Testbed) RESTConfig() *rest.Config { return rest.CopyConfig(tb.restConfig) }

// APIServerLogTail is the end of the kube-apiserver's log.
func (tb *Testbed) APIServerLogTail(n int) string { return tb.apiserver.Tail(n) }

// Close stops every process the test bed started, deletes its namespaces and
// (unless KeepDir) its temp dir. Safe to call more than once and concurrently.
func (tb *Testbed) Close() error {
	tb.closeOnce.Do(func() { tb.closeErr = tb.close() })
	return tb.closeErr
}

func (tb *Testbed) close() error {
	var errs []error
	if tb.kpipe != nil {
		if err := tb.kpipe.stopQuiet(); err != nil {
			errs = append(errs, err)
		}
	}
	tb.mu.Lock()
	procs := append([]*Process(nil), tb.procs...)
	namespaces := append([]string(nil), tb.namespaces...)
	tb.mu.Unlock()
	// Stop in reverse start order: echo servers, apiserver, etcd.
	var wg sync.WaitGroup
	for i := len(procs) - 1; i >= 0; i-- {
		wg.Add(1)
		go func(p *Process) {
			defer wg.Done()
			_ = p.Stop(5 * time.Second)
		}(procs[i])
	}
	wg.Wait()
	tb.handles.closeAll()
	for _, ns := range namespaces {
		if err := deleteNamespace(ns); err != nil {
			errs = append(errs, err)
		}
	}
	if tb.lock != nil {
		tb.lock.Close()
	}
	if tb.Dir != "" && !tb.cfg.KeepDir {
		if err := os.RemoveAll(tb.Dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// RemoveLeftovers deletes namespaces and run dirs left by earlier runs that
// died without cleaning up: those whose run lock nobody holds any more.
func RemoveLeftovers(logf func(string, ...any)) {
	live := map[string]bool{}
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), NamePrefix+"*"))
	for _, dir := range dirs {
		id := strings.TrimPrefix(filepath.Base(dir), NamePrefix)
		if runIsLive(dir) {
			live[id] = true
			continue
		}
		logf("removing leftover run dir %s", dir)
		_ = os.RemoveAll(dir)
	}
	names, err := listNamespaces()
	if err != nil {
		logf("list network namespaces: %v", err)
		return
	}
	for _, ns := range names {
		if !strings.HasPrefix(ns, NamePrefix) {
			continue
		}
		id, _, _ := strings.Cut(strings.TrimPrefix(ns, NamePrefix), "-")
		if live[id] {
			continue
		}
		logf("removing leftover network namespace %s", ns)
		if err := deleteNamespace(ns); err != nil {
			logf("remove %s: %v", ns, err)
		}
	}
}

// runIsLive reports whether the run owning dir still holds its lock.
func runIsLive(dir string) bool {
	f, err := os.Open(filepath.Join(dir, "lock"))
	if err != nil {
		return false
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return true
	}
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return false
}
