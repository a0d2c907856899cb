// Command benchproxy measures kpipe and upstream kube-proxy (iptables and
// nftables modes) side by side against the e2e test bed's real
// kube-apiserver: N services (a tenth NodePort) with 10 endpoints each, the
// proxies one after the other, each in a fresh node namespace with the same
// flags, at --iptables-min-sync-period 1s and 0. Every figure of rules comes
// from the kernel (iptables or nft listing a chain, nf_tables notifications), none from
// a proxy's own metrics (but for when a restarted kpipe says it has synced,
// which the kernel cannot show: nothing changes there). Needs root. Run from
// the repository:
//
//	go tool task bench-proxy                 # BENCH_N=1000
//	BENCH_N=10000 go tool task bench-proxy   # about 40 minutes on 2 cores
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
	"math/rand/v2"
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
	// 9m57s of its 10 minutes once the restarts were measured both ways.
	seriesBudget = 45 * time.Second
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
				r, err := benchOne(ctx, tb, w, proxy, bins[proxy], minSync, seq)
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
	isolated   []time.Duration // sorted
	backToBack []time.Duration // sorted
	churnTook  time.Duration
	churnTxns  int
	churnBytes int
	churnLost  bool // notifications were lost: the counts are low
	converge   time.Duration
	usage      usage
	restart    restarted // kpipe only
}

// benchOne runs proxy in a fresh node namespace through every phase.
func benchOne(ctx context.Context, tb *testbed.Testbed, w *workload, proxy, bin string, minSync time.Duration, seq int) (r result, err error) {
	node, err := tb.NewFreshNode(fmt.Sprintf("bench%d", seq))
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, node.Close()) }()
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
	seen, err := k.waitFor(w.svcs[len(w.svcs)-1], firstSyncLimit, alive)
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

	// One endpoint change at a time: isolated (the proxy idle, its min-sync
	// period passed), then back to back.
	if r.isolated, err = latencies(ctx, w, k, alive, minSync+100*time.Millisecond); err != nil {
		return r, fmt.Errorf("isolated changes: %w", err)
	}
	if r.backToBack, err = latencies(ctx, w, k, alive, 0); err != nil {
		return r, fmt.Errorf("back-to-back changes: %w", err)
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
	seen, err = k.waitFor(lastSvc, 5*time.Minute, alive)
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

// changeOne replaces one endpoint of a random service and waits, up to
// limit, for the kernel to hold it: when the API write began, how long it
// took, and when the kernel was seen holding the change.
func changeOne(ctx context.Context, w *workload, k kernel, alive func() error, limit time.Duration) (began time.Time, wrote time.Duration, seen time.Time, err error) {
	s := w.svcs[rand.IntN(len(w.svcs))]
	began = time.Now()
	if err = w.replaceEndpoint(ctx, s); err != nil {
		return began, 0, time.Time{}, err
	}
	wrote = time.Since(began)
	seen, err = k.waitFor(s, limit, alive)
	return began, wrote, seen, err
}

// latencies makes changeCount endpoint changes (fewer past seriesBudget), each at a random service,
// the next gap after the previous one showed in the kernel, and returns how
// long each took from the API write to the kernel, sorted.
func latencies(ctx context.Context, w *workload, k kernel, alive func() error, gap time.Duration) ([]time.Duration, error) {
	out := make([]time.Duration, 0, changeCount)
	var api []time.Duration // the API writes alone: the floor of every figure
	defer func() {
		slices.Sort(api)
		if len(api) > 0 {
			logf("%d API writes (gap %v) took p50/p99 %s/%s ms", len(api), gap, ms(percentile(api, 50)), ms(percentile(api, 99)))
		}
	}()
	began := time.Now()
	for range changeCount {
		if len(out) >= minChanges && time.Since(began) > seriesBudget {
			break
		}
		time.Sleep(gap)
		t, wrote, seen, err := changeOne(ctx, w, k, alive, 2*time.Minute)
		if err != nil {
			return nil, err
		}
		api = append(api, wrote)
		out = append(out, seen.Sub(t))
	}
	slices.Sort(out)
	return out, nil
}

// percentile is the nearest-rank p-th percentile of sorted.
func percentile(sorted []time.Duration, p int) time.Duration {
	i := (len(sorted)*p+99)/100 - 1
	return sorted[max(i, 0)]
}

func ms(d time.Duration) string {
	return strconv.FormatInt(d.Round(time.Millisecond).Milliseconds(), 10)
}

// msList is sorted in milliseconds: "[2950 3131 3200]".
func msList(sorted []time.Duration) string {
	out := make([]string, len(sorted))
	for i, d := range sorted {
		out[i] = ms(d)
	}
	return "[" + strings.Join(out, " ") + "]"
}

// series is a latency series' p50/p99, with its size when the budget cut it short.
func series(sorted []time.Duration) string {
	out := ms(percentile(sorted, 50)) + "/" + ms(percentile(sorted, 99))
	if len(sorted) < changeCount {
		out += fmt.Sprintf("(n=%d)", len(sorted))
	}
	return out
}

func printHeader(n int) {
	fmt.Printf("\nN=%d services x %d endpoints (every %dth NodePort); times in ms; churn: %d updates paced over %v\n",
		n, endpointsPerSvc, nodePortEvery, churnUpdates, churnSpread)
	fmt.Printf("%-9s %-8s %10s %15s %15s %9s %6s %11s %9s %8s %7s\n",
		"proxy", "min-sync", "first-sync", "isolated p50/99", "b2b p50/99", "churn-api", "txns", "bytes", "converge", "RSS-MiB", "CPU-s")
}

func printRow(proxy string, minSync time.Duration, r result) {
	lost := ""
	if r.churnLost {
		lost = " (notifications lost: txns and bytes low)"
	}
	fmt.Printf("%-9s %-8v %10s %15s %15s %9s %6d %11d %9s %8.1f %7.1f%s\n",
		proxy, minSync, ms(r.firstSync),
		series(r.isolated), series(r.backToBack),
		ms(r.churnTook), r.churnTxns, r.churnBytes, ms(r.converge),
		float64(r.usage.peakRSSKiB)/1024, r.usage.cpu.Seconds(), lost)
	if proxy == "kpipe" {
		lost = ""
		if r.restart.lost {
			lost = " (notifications lost: txns and bytes low)"
		}
		rs := r.restart
		fmt.Printf("%-9s %-8v restarted over its rules, a change made as it starts: in the kernel after %s ms (median of %v); written meanwhile at most %d txns, %d bytes%s\n",
			"", "", ms(percentile(rs.change, 50)), msList(rs.change), rs.txns, rs.bytes, lost)
		fmt.Printf("%-9s %-8v restarted, nothing changed: synced in %s ms (%v), writing at most %d txns, %d bytes; the first change after it %s ms (%v)\n",
			"", "", ms(percentile(rs.synced, 50)), msList(rs.synced), rs.syncedTxns, rs.syncedBytes, ms(percentile(rs.changeSynced, 50)), msList(rs.changeSynced))
	}
}

// printRatios prints kpipe's figures over kube-proxy's at the largest N, per
// mode and min-sync period.
func printRatios(cfg config, results map[runKey]result) {
	n := cfg.sizes[len(cfg.sizes)-1]
	fmt.Printf("\nkpipe/kube-proxy ratios at N=%d (below 1: kpipe less)\n", n)
	ratio := func(a, b float64) string {
		if b == 0 {
			return "-"
		}
		return strconv.FormatFloat(a/b, 'f', 2, 64)
	}
	dur := func(a, b time.Duration) string { return ratio(float64(a), float64(b)) }
	for _, minSync := range cfg.minSyncs {
		kp, ok := results[runKey{n, "kpipe", minSync}]
		if !ok {
			continue
		}
		for _, mode := range []string{"iptables", "nftables"} {
			up, ok := results[runKey{n, mode, minSync}]
			if !ok {
				continue
			}
			fmt.Printf("kpipe/%s min-sync %v: first-sync %s, isolated p50 %s p99 %s, b2b p50 %s p99 %s, churn txns %s bytes %s converge %s, RSS %s, CPU %s\n",
				mode, minSync, dur(kp.firstSync, up.firstSync),
				dur(percentile(kp.isolated, 50), percentile(up.isolated, 50)), dur(percentile(kp.isolated, 99), percentile(up.isolated, 99)),
				dur(percentile(kp.backToBack, 50), percentile(up.backToBack, 50)), dur(percentile(kp.backToBack, 99), percentile(up.backToBack, 99)),
				ratio(float64(kp.churnTxns), float64(up.churnTxns)), ratio(float64(kp.churnBytes), float64(up.churnBytes)),
				dur(kp.converge, up.converge),
				ratio(float64(kp.usage.peakRSSKiB), float64(up.usage.peakRSSKiB)), dur(kp.usage.cpu, up.usage.cpu))
		}
	}
}
