package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// percentile is the nearest-rank p-th percentile of sorted.
func percentile(sorted []time.Duration, p int) time.Duration {
	i := (len(sorted)*p+99)/100 - 1
	return sorted[max(i, 0)]
}

func ms(d time.Duration) string {
	return strconv.FormatInt(d.Round(time.Millisecond).Milliseconds(), 10)
}

func us(d time.Duration) string {
	return strconv.FormatInt(d.Round(time.Microsecond).Microseconds(), 10)
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
	fmt.Printf("\nN=%d services x %d endpoints (every %dth NodePort, %d at most); times in ms; churn: %d updates paced over %v\n",
		n, endpointsPerSvc, nodePortEvery, maxNodePorts, churnUpdates, churnSpread)
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
	if len(r.epRemoved) > 0 {
		fmt.Printf("%-9s %-8v one at a time, p50/99: endpoint removed %s, endpoint added %s, service deleted %s, service added %s\n",
			"", "", series(r.epRemoved), series(r.epAdded), series(r.svcDeleted), series(r.svcAdded))
	}
	fmt.Printf("%-9s %-8v first packet, connect p50/99 in µs over %d connections: through ClusterIPs %s/%s, no proxy %s/%s\n",
		"", "", firstPackets, us(percentile(r.connect, 50)), us(percentile(r.connect, 99)), us(percentile(r.noProxy, 50)), us(percentile(r.noProxy, 99)))
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
				mode, minSync, durRatio(kp.firstSync, up.firstSync),
				durRatio(percentile(kp.isolated, 50), percentile(up.isolated, 50)), durRatio(percentile(kp.isolated, 99), percentile(up.isolated, 99)),
				durRatio(percentile(kp.backToBack, 50), percentile(up.backToBack, 50)), durRatio(percentile(kp.backToBack, 99), percentile(up.backToBack, 99)),
				ratio(float64(kp.churnTxns), float64(up.churnTxns)), ratio(float64(kp.churnBytes), float64(up.churnBytes)),
				durRatio(kp.converge, up.converge),
				ratio(float64(kp.usage.peakRSSKiB), float64(up.usage.peakRSSKiB)), durRatio(kp.usage.cpu, up.usage.cpu))
			fmt.Printf("kpipe/%s min-sync %v: %s\n", mode, minSync, strings.Join(kindRatios(kp, up), ", "))
		}
	}
}

// kindRatios are kpipe's p50 and p99 over up's for each kind of change both
// measured, and for the first packets' connect.
func kindRatios(kp, up result) []string {
	var out []string
	for _, f := range []struct {
		name   string
		kp, up []time.Duration
	}{
		{"endpoint removed", kp.epRemoved, up.epRemoved},
		{"endpoint added", kp.epAdded, up.epAdded},
		{"service deleted", kp.svcDeleted, up.svcDeleted},
		{"service added", kp.svcAdded, up.svcAdded},
		{"first-packet connect", kp.connect, up.connect},
	} {
		if len(f.kp) == 0 || len(f.up) == 0 {
			continue
		}
		out = append(out, fmt.Sprintf("%s p50 %s p99 %s", f.name,
			durRatio(percentile(f.kp, 50), percentile(f.up, 50)), durRatio(percentile(f.kp, 99), percentile(f.up, 99))))
	}
	return out
}

// printScale prints, for each proxy run at more than one size, its figures
// by size: one change of each kind as p50, a restart (kpipe) as the median
// time to its first sync with nothing changed.
func printScale(cfg config, results map[runKey]result) {
	if len(cfg.sizes) < 2 {
		return
	}
	for _, proxy := range cfg.proxies {
		fmt.Printf("\n%s by size; times in ms (p50), connect in µs\n", proxy)
		fmt.Printf("%8s %-8s %10s %9s %9s %9s %9s %9s %9s %9s %8s %7s\n",
			"N", "min-sync", "first-sync", "replaced", "ep-rm", "ep-add", "svc-del", "svc-add", "connect", "restart", "RSS-MiB", "CPU-s")
		for _, n := range cfg.sizes {
			for _, minSync := range cfg.minSyncs {
				r, ok := results[runKey{n, proxy, minSync}]
				if !ok {
					fmt.Printf("%8d %-8v not measured\n", n, minSync)
					continue
				}
				fmt.Printf("%8d %-8v %10s %9s %9s %9s %9s %9s %9s %9s %8.1f %7.1f\n",
					n, minSync, ms(r.firstSync), p50(r.isolated, ms), p50(r.epRemoved, ms), p50(r.epAdded, ms),
					p50(r.svcDeleted, ms), p50(r.svcAdded, ms), p50(r.connect, us), p50(r.restart.synced, ms),
					float64(r.usage.peakRSSKiB)/1024, r.usage.cpu.Seconds())
			}
		}
	}
}

// p50 is sorted's median in unit, "-" when nothing was measured.
func p50(sorted []time.Duration, unit func(time.Duration) string) string {
	if len(sorted) == 0 {
		return "-"
	}
	return unit(percentile(sorted, 50))
}

// ratio is a over b to two places, "-" when b is 0.
func ratio(a, b float64) string {
	if b == 0 {
		return "-"
	}
	return strconv.FormatFloat(a/b, 'f', 2, 64)
}

func durRatio(a, b time.Duration) string { return ratio(float64(a), float64(b)) }
