// Command benchproxy measures kpipe and upstream kube-proxy (iptables and
// nftables modes) side by side against the e2e test bed's real
// kube-apiserver: N services (a tenth NodePort, 2,000 at most) with 10
// endpoints each, the proxies one after the other, each in a fresh node
// namespace with the same flags, at --iptables-min-sync-period 1s and 0.
// Every figure of rules comes from the kernel (iptables or nft listing a
// chain, nf_tables notifications), none from a proxy's own metrics (but for
// when a restarted kpipe says it has synced, which the kernel cannot show:
// nothing changes there). Needs root. Run from the repository:
//
//	go tool task bench-proxy                 # BENCH_N=1000
//	BENCH_N=10000 go tool task bench-proxy   # about 40 minutes on 2 cores
//
// Beside first sync, change latency, churn, RSS and CPU, each run measures
// first packets through ClusterIPs from a client pod, and at the shortest
// min-sync period each kind of change one at a time (an endpoint removed or
// added, a Service deleted or added). The scale curve, a table by size:
//
//	BENCH_PROXIES=kpipe BENCH_MIN_SYNC=0s BENCH_N=1000,10000,30000,50000 go tool task bench-proxy
//
// BENCH_N is one size or several ("1000,10000"); BENCH_PROXIES a subset of
// "kpipe,iptables,nftables"; BENCH_MIN_SYNC the min-sync-periods ("1s,0s");
// BENCH_KEEP=1 keeps the run dir (the proxies' logs); BENCH_PROFILE=dir saves
// kpipe's heap profiles after the first sync and after the churn there, and a
// CPU profile over each churn and over a restart's first seconds (go tool
// pprof -tagfocus stage=…); BENCH_KPIPE_ENV adds to kpipe's environment
// ("GOGC=50 GOMEMLIMIT=180MiB"), BENCH_KPIPE_ARGS to its flags ("--log-format
// json --log-level debug").
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

const (
	changeCount = 50 // endpoint changes per latency series
	// seriesBudget bounds a series of a slow proxy (nftables mode takes ~10 s
	// a change at 10,000 services; any proxy ~1.1 s a change isolated at
	// min-sync 1 s): it stops after this long, with at least minChanges
	// changes, and the row says how many it made. At 60 s, BENCH_N=1000 took
	// 9m57s of its 10 minutes once the restarts were measured both ways; 30 s
	// and kindsBudget leave room for the kinds of change and the first
	// packets.
	seriesBudget = 30 * time.Second
	// kindsBudget bounds each pair of kinds (endpoint removed and added,
	// service deleted and added), measured at the shortest min-sync period
	// only: at 1 s each change would wait 1.1 s first.
	kindsBudget  = 20 * time.Second
	minChanges   = 5
	churnUpdates = 2000 // endpoint changes in the churn
	churnSpread  = 10 * time.Second
	syncPeriod   = "30s" // kube-proxy's default, given to all
)

var allProxies = []string{"kpipe", "iptables", "nftables"}

// firstSyncLimit bounds the wait for a proxy's first sync; a proxy that does
// not finish in it (kube-proxy's iptables mode at 10,000 services) is
// reported so, and not started again at the next period of that size.
const firstSyncLimit = 15 * time.Minute

var errSlowFirstSync = errors.New("first sync did not finish")

func main() { os.Exit(run()) }

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench-proxy: "+format+"\n", args...)
}

type config struct {
	sizes    []int
	proxies  []string
	minSyncs []time.Duration
}

func readConfig() (config, error) {
	var c config
	for _, f := range list("BENCH_N", "1000") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return c, fmt.Errorf("BENCH_N: %q is not a positive number", f)
		}
		c.sizes = append(c.sizes, n)
	}
	slices.Sort(c.sizes)
	for _, p := range list("BENCH_PROXIES", strings.Join(allProxies, ",")) {
		if !slices.Contains(allProxies, p) {
			return c, fmt.Errorf("BENCH_PROXIES: unknown proxy %q (have %v)", p, allProxies)
		}
		c.proxies = append(c.proxies, p)
	}
	for _, f := range list("BENCH_MIN_SYNC", "1s,0s") {
		d, err := time.ParseDuration(f)
		if err != nil || d < 0 {
			return c, fmt.Errorf("BENCH_MIN_SYNC: %q is not a duration", f)
		}
		c.minSyncs = append(c.minSyncs, d)
	}
	return c, nil
}

// list is the comma-separated environment variable name, def when unset.
func list(name, def string) []string {
	v := os.Getenv(name)
	if strings.TrimSpace(v) == "" {
		v = def
	}
	var out []string
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func run() int {
	cfg, err := readConfig()
	if err != nil {
		logf("%v", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	began := time.Now()
	tb, err := testbed.New(ctx, testbed.Config{Pods: 1, Logf: logf, KeepDir: os.Getenv("BENCH_KEEP") != ""})
	if err != nil {
		logf("test bed: %v", err)
		return 1
	}
	defer closeTestbed(tb)
	bins, err := binaries(tb)
	if err != nil {
		logf("%v", err)
		return 1
	}
	w, err := newWorkload(ctx, tb)
	if err != nil {
		logf("%v", err)
		return 1
	}
	failed := false
	results := map[runKey]result{}
	seq := 0
	for _, n := range cfg.sizes {
		t := time.Now()
		if err := w.grow(ctx, n); err != nil {
			logf("create %d services: %v", n, err)
			return 1
		}
		logf("%d services with %d endpoints each in the API (%v)", n, endpointsPerSvc, time.Since(t).Round(time.Millisecond))
		printHeader(n)
		for _, proxy := range cfg.proxies {
			slow := false
			for _, minSync := range cfg.minSyncs {
				if slow {
					// The first sync does not depend on the period: another
					// wait of firstSyncLimit would show the same.
					fmt.Printf("%-9s %-8v not run: the first sync did not finish within %v at the period before\n", proxy, minSync, firstSyncLimit)
					continue
				}
				seq++
				k := runKey{n, proxy, minSync}
				kinds := minSync == slices.Min(cfg.minSyncs)
				r, err := benchOne(ctx, tb, w, proxy, bins[proxy], minSync, kinds, seq)
				if errors.Is(err, errSlowFirstSync) {
					slow = true
					fmt.Printf("%-9s %-8v first sync did not finish within %v\n", proxy, minSync, firstSyncLimit)
					continue
				}
				if err != nil {
					failed = true
					fmt.Printf("%-9s %-8v FAILED: %v\n", proxy, minSync, err)
					if ctx.Err() != nil {
						return 1
					}
					continue
				}
				results[k] = r
				printRow(proxy, minSync, r)
			}
		}
	}
	printRatios(cfg, results)
	printScale(cfg, results)
	logf("done in %v (test bed %s)", time.Since(began).Round(time.Second), tb.Dir)
	if failed {
		return 1
	}
	return 0
}

// closeTestbed removes the test bed: processes, namespaces, run dir.
func closeTestbed(tb *testbed.Testbed) {
	if err := tb.Close(); err != nil {
		logf("cleanup: %v", err)
	}
}

// binaries are the proxies' executables: kpipe built from this tree,
// kube-proxy built and cached with the control plane.
func binaries(tb *testbed.Testbed) (map[string]string, error) {
	k, err := tb.BuildKpipe()
	if err != nil {
		return nil, fmt.Errorf("build kpipe: %w", err)
	}
	kp, err := tb.KubeProxy("iptables", logf)
	if err != nil {
		return nil, fmt.Errorf("kube-proxy: %w", err)
	}
	return map[string]string{"kpipe": k.Bin, "iptables": kp.Bin, "nftables": kp.Bin}, nil
}

// proxyArgs are the flags every proxy runs with: kpipe takes kube-proxy's.
// --conntrack-max-per-core 0 leaves nf_conntrack_max alone (a namespace
// cannot set it).
func proxyArgs(tb *testbed.Testbed, mode string, minSync time.Duration) []string {
	return []string{
		"--kubeconfig", tb.Kubeconfig,
		"--hostname-override", testbed.NodeName,
		"--proxy-mode", mode,
		"--cluster-cidr", testbed.ClusterCIDR,
		"--iptables-min-sync-period", minSync.String(),
		"--iptables-sync-period", syncPeriod,
		"--healthz-bind-address", "127.0.0.1:10256",
		"--metrics-bind-address", strings.TrimPrefix(testbed.MetricsURL, "http://"),
		"--conntrack-max-per-core", "0",
	}
}

// command starts proxy's binary: BENCH_KPIPE_ENV ("GOMEMLIMIT=180MiB") sets
// kpipe's environment, through env(1), which execs in place.
func command(proxy, bin string) []string {
	if vars := strings.Fields(os.Getenv("BENCH_KPIPE_ENV")); proxy == "kpipe" && len(vars) > 0 {
		return append(append([]string{"env"}, vars...), bin)
	}
	return []string{bin}
}

type runKey struct {
	n       int
	proxy   string
	minSync time.Duration
}

type result struct {
	firstSync  time.Duration
	isolated   []time.Duration // sorted, as every series
	backToBack []time.Duration
	// The kinds of change, isolated, at the shortest min-sync period only.
	epRemoved, epAdded   []time.Duration
	svcDeleted, svcAdded []time.Duration
	// First packets: connect times through ClusterIPs, and through no
	// proxy (to endpoints, before the proxy started).
	connect, noProxy []time.Duration
	churnTook        time.Duration
	churnTxns        int
	churnBytes       int
	churnLost        bool // notifications were lost: the counts are low
	converge         time.Duration
	usage            usage
	restart          restarted // kpipe only
}

// benchOne runs proxy in a fresh node namespace through every phase; the
// kinds of change too when kinds.
func benchOne(ctx context.Context, tb *testbed.Testbed, w *workload, proxy, bin string, minSync time.Duration, kinds bool, seq int) (r result, err error) {
	node, err := tb.NewFreshNode(fmt.Sprintf("bench%d", seq))
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, node.Close()) }()
	path, err := newPacketPath(tb, node, strconv.Itoa(seq))
	if err != nil {
		return r, fmt.Errorf("first-packet path: %w", err)
	}
	defer path.close()
	if r.noProxy, err = path.connectTimes(endpointTargets(w.svcs)); err != nil {
		return r, fmt.Errorf("first packets, no proxy: %w", err)
	}
	mode := proxy
	if proxy == "kpipe" {
		mode = "iptables"
	}
	k := kernel{tb: tb, node: node, nft: proxy == "nftables"}

	// First sync: from the start to the last service's chain complete.
	start := time.Now()
	name := fmt.Sprintf("bench-%d-%s", seq, proxy)
	args := append(append(command(proxy, bin), proxyArgs(tb, mode, minSync)...), profileArgs(proxy)...)
	if proxy == "kpipe" {
		args = append(args, strings.Fields(os.Getenv("BENCH_KPIPE_ARGS"))...)
	}
	p, err := node.Start(name, args...)
	if err != nil {
		return r, err
	}
	defer func() { _ = p.Stop(15 * time.Second) }()
	alive := running(ctx, p, proxy)
	pid, err := proxyPID(p.PID(), bin)
	if err != nil {
		return r, err
	}
	seen, err := k.waitFor(w.svcs[len(w.svcs)-1], firstSyncLimit, alive, false)
	if err != nil {
		if alive() == nil {
			return r, fmt.Errorf("%w: %v", errSlowFirstSync, err)
		}
		return r, fmt.Errorf("first sync: %w", err)
	}
	r.firstSync = seen.Sub(start)
	prof := newProfiler(tb, node.NS, name, proxy, pid)
	prof.at("first-sync")
	if _, err := k.waitAll(w.svcs, time.Minute, alive); err != nil {
		return r, fmt.Errorf("after the first sync: %w", err)
	}
	if r.connect, err = path.connectTimes(clusterTargets(w.svcs)); err != nil {
		return r, fmt.Errorf("first packets: %w", err)
	}

	// One endpoint change at a time: isolated (the proxy idle, its min-sync
	// period passed), then back to back.
	if r.isolated, err = latencies(ctx, w, k, alive, minSync+100*time.Millisecond); err != nil {
		return r, fmt.Errorf("isolated changes: %w", err)
	}
	if r.backToBack, err = latencies(ctx, w, k, alive, 0); err != nil {
		return r, fmt.Errorf("back-to-back changes: %w", err)
	}
	if kinds {
		if err := measureKinds(ctx, w, k, alive, minSync+100*time.Millisecond, &r); err != nil {
			return r, err
		}
	}

	// Churn, its writes counted by the kernel's notifications from its start
	// to convergence.
	writes, err := countWrites(tb, node.NS)
	if err != nil {
		return r, err
	}
	defer writes.stop()
	profiled := prof.cpu("churn.cpu", int(churnSpread/time.Second)+3)
	last, lastSvc, took, err := w.churn(ctx, churnUpdates, churnSpread)
	if err != nil {
		return r, fmt.Errorf("churn: %w", err)
	}
	r.churnTook = took
	// The last update's chain is cheap to poll; a dump then shows whether
	// everything else was there too, or is waited for.
	seen, err = k.waitFor(lastSvc, 5*time.Minute, alive, false)
	if err != nil {
		return r, fmt.Errorf("after the churn: %w", err)
	}
	if n, _, err := k.mismatches(w.svcs); err != nil || n > 0 {
		if seen, err = k.waitAll(w.svcs, 5*time.Minute, alive); err != nil {
			return r, fmt.Errorf("after the churn: %w", err)
		}
	}
	r.converge = seen.Sub(last)
	r.churnTxns, r.churnBytes, r.churnLost = writes.stop()
	if profiled != nil {
		if err := <-profiled; err != nil {
			logf("churn profile: %v", err)
		}
	}
	prof.at("churn")
	if r.usage, err = readUsage(pid); err != nil {
		return r, err
	}
	logf("%s min-sync %v: log %s", proxy, minSync, p.LogPath)
	if proxy == "kpipe" {
		if r.restart, err = restart(ctx, tb, w, k, p, args, seq); err != nil {
			return r, fmt.Errorf("restart: %w", err)
		}
	}
	return r, nil
}

// measureKinds measures each kind of change, isolated (gap after the proxy
// finished the one before: kernel.settle), into r.
func measureKinds(ctx context.Context, w *workload, k kernel, alive func() error, gap time.Duration, r *result) error {
	eps, err := changeSeries(ctx, k, alive, gap, kindsBudget, w.svcs, w.endpointKinds()...)
	if err != nil {
		return err
	}
	svcs, err := changeSeries(ctx, k, alive, gap, kindsBudget, w.clusterIPOnly(), w.serviceKinds()...)
	if err != nil {
		return err
	}
	r.epRemoved, r.epAdded, r.svcDeleted, r.svcAdded = eps[0], eps[1], svcs[0], svcs[1]
	return nil
}

// restartRounds is how often kpipe is restarted each way, for medians.
const restartRounds = 3

// restarted is kpipe restarted over its own rules, restartRounds times each
// way. With an endpoint change made as the new process starts: how long until
// the kernel had it (the new process lists the cluster, renders and compares
// it all first), and what the kernel was written meanwhile (nothing but that
// change, when the restarted kpipe compares instead of rewriting). With
// nothing changed until the new process reports its first sync: how long
// that took, what it wrote (nothing), and how long the first change after it
// took. Durations are sorted; txns and bytes are the most of any round.
type restarted struct {
	change       []time.Duration
	txns, bytes  int
	synced       []time.Duration
	syncedTxns   int
	syncedBytes  int
	changeSynced []time.Duration
	lost         bool
}

// restart restarts kpipe (p) over its rules, as restarted says.
func restart(ctx context.Context, tb *testbed.Testbed, w *workload, k kernel, p *testbed.Process, argv []string, seq int) (restarted, error) {
	var r restarted
	for round := range restartRounds {
		// A change as it starts.
		again, err := startAgain(tb, k, p, argv, fmt.Sprintf("bench-%d-kpipe-restarted-%d", seq, round+1), round == 0)
		if err != nil {
			return r, err
		}
		defer func() { _ = again.p.Stop(15 * time.Second) }()
		defer again.writes.stop() // when a round fails; counted below
		alive := running(ctx, again.p, "restarted kpipe")
		_, _, seen, err := changeOne(ctx, w, k, alive, 5*time.Minute)
		if err != nil {
			return r, err
		}
		r.change = append(r.change, seen.Sub(again.start))
		// Its full sync is done too (the change may have come after it), and
		// with it any rewrite the restart made.
		if err := waitSynced(tb, k.node.NS, time.Minute, alive); err != nil {
			return r, err
		}
		txns, bytes, lost := again.writes.stop()
		r.txns, r.bytes, r.lost = max(r.txns, txns), max(r.bytes, bytes), r.lost || lost
		if again.profiled != nil {
			if err := <-again.profiled; err != nil {
				logf("restart profile: %v", err)
			}
		}

		// Nothing changed until its first sync is done; then one change.
		synced, err := startAgain(tb, k, again.p, argv, fmt.Sprintf("bench-%d-kpipe-resynced-%d", seq, round+1), false)
		if err != nil {
			return r, err
		}
		defer func() { _ = synced.p.Stop(15 * time.Second) }()
		defer synced.writes.stop()
		alive = running(ctx, synced.p, "restarted kpipe")
		if err := waitSynced(tb, k.node.NS, time.Minute, alive); err != nil {
			return r, err
		}
		r.synced = append(r.synced, time.Since(synced.start))
		txns, bytes, lost = synced.writes.stop()
		r.syncedTxns, r.syncedBytes, r.lost = max(r.syncedTxns, txns), max(r.syncedBytes, bytes), r.lost || lost
		t, _, seen, err := changeOne(ctx, w, k, alive, time.Minute)
		if err != nil {
			return r, err
		}
		r.changeSynced = append(r.changeSynced, seen.Sub(t))
		p = synced.p
	}
	for _, d := range [][]time.Duration{r.change, r.synced, r.changeSynced} {
		slices.Sort(d)
	}
	return r, nil
}

// started is a kpipe started again over the rules of the one before.
type started struct {
	p        *testbed.Process
	start    time.Time
	writes   *writeCounter // the kernel's writes since
	profiled <-chan error  // its CPU profile's outcome (nil: none taken)
}

// startAgain stops p and starts kpipe (argv) again in the same namespace,
// counting the kernel's writes from before it starts; with profile, its CPU
// profile over its first seconds is saved (when profiles are on).
func startAgain(tb *testbed.Testbed, k kernel, p *testbed.Process, argv []string, name string, profile bool) (started, error) {
	var st started
	if err := p.Stop(15 * time.Second); err != nil {
		return st, err
	}
	var err error
	if st.writes, err = countWrites(tb, k.node.NS); err != nil {
		return st, err
	}
	st.start = time.Now()
	if st.p, err = k.node.Start(name, argv...); err != nil {
		st.writes.stop()
		return st, err
	}
	if profile {
		st.profiled = newProfiler(tb, k.node.NS, name, "kpipe", 0).cpu("restart.cpu", 4)
	}
	return st, nil
}

// waitSynced waits for kpipe in ns to report its first IPv4 sync done, on
// its metrics address (kube-proxy's last-sync gauge), polled every 50 ms.
func waitSynced(tb *testbed.Testbed, ns string, limit time.Duration, alive func() error) error {
	for end := time.Now().Add(limit); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if err := alive(); err != nil {
			return err
		}
		m, err := tb.ScrapeMetrics(ns, testbed.MetricsURL+"/metrics")
		if err == nil && testbed.Sum(m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", map[string]string{"ip_family": "IPv4"}) > 0 {
			return nil
		}
	}
	return fmt.Errorf("restarted kpipe reported no sync in %v", limit)
}

// running is nil while p (the proxy what) runs and ctx is live, else why not.
func running(ctx context.Context, p *testbed.Process, what string) func() error {
	return func() error {
		if p.Exited() {
			return fmt.Errorf("%s exited: %v\n--- log (%s):\n%s", what, p.ExitErr(), p.LogPath, p.Tail(20))
		}
		return ctx.Err()
	}
}
