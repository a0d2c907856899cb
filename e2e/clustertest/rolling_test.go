package clustertest

import (
	"cmp"
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/kpipe/kpipe/e2e/cluster"
)

// TestRollingUpdates is the number operators feel: a 4-replica Deployment
// behind a ClusterIP, a client pod opening 200 new connections a second
// through it, and `kubectl rollout restart` three times, under kube-proxy
// and then under kpipe, in the same cluster and run. It prints each proxy's
// failed requests per restart and the time from a pod's deletion (its
// deletionTimestamp seen by a watch) to its endpoint's removal from the
// service's rules (the KUBE-SVC chain's jump to its KUBE-SEP chain gone).
// It fails if a proxy leaves an old pod's endpoint in the rules (30 s).
//
// It prints figures and decides nothing from them: both proxies spend the
// same token bucket (a burst of two syncs, then one per min-sync-period, 1 s)
// and the EndpointSlice controller writes the ClusterIP's and the NodePort's
// slice apart, so where in that second a deletion lands decides most of its
// removal time (per pod from ~40 ms to ~1.1 s under either proxy), and the
// medians of three restarts swap order from run to run.
//
// The echo pods exit at SIGTERM with no drain: every request that reaches
// a pod after it has gone fails, so the count is what the proxy could have
// saved by removing the endpoint sooner.
func TestRollingUpdates(t *testing.T) {
	fullOnly(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	handOver(t, ctx, onKubeProxy)
	e := deployEcho(t, ctx, "roll-echo", 4)
	waitServed(t, ctx, e)
	probeIP := startProbe(t, ctx, "roll-client", fmt.Sprintf("clusterip=tcp:%s:80,every=5ms,timeout=1s,inflight=64", e.clusterIP))

	results := map[string]rollResult{}
	for _, h := range []handover{{name: "kube-proxy", to: "kube-proxy"}, toKpipeSetImage} {
		if h.do != nil {
			handOver(t, ctx, h)
			waitServed(t, ctx, e)
			time.Sleep(2 * time.Second)
		}
		results[h.to] = restartThrice(t, ctx, e, probeIP)
	}
	handOver(t, ctx, toKubeProxyUndo)

	t.Logf("rolling restarts of a 4-replica Deployment, 200 new connections/s through its ClusterIP:")
	for _, name := range []string{"kube-proxy", "kpipe"} {
		r := results[name]
		t.Logf("  %-10s failed requests per restart %v (median %d of ~%d each); pod deletion -> endpoint out of the rules: median %v, max %v over %d pods",
			name, r.failed, median(r.failed), r.attempts/3, median(r.removal).Round(time.Millisecond), slices.Max(r.removal).Round(time.Millisecond), len(r.removal))
	}
}

type rollResult struct {
	failed   []uint64        // failed requests, per restart
	attempts uint64          // all requests over the three restarts
	removal  []time.Duration // per deleted pod: deletion -> endpoint out of the rules
}

// restartThrice restarts e's Deployment three times, one after the other,
// counting the client's failures over each and timing each old pod's
// endpoint removal.
func restartThrice(t *testing.T, ctx context.Context, e echo, probeIP string) rollResult {
	t.Helper()
	var r rollResult
	for i := range 3 {
		before := countsNow(t, ctx, probeIP)["clusterip"]
		timer := startRemovalTimer(t, ctx, e)
		kubectl(t, ctx, "-n", "default", "rollout", "restart", "deployment/"+e.name)
		time.Sleep(time.Second) // the controller first bumps the generation
		if err := c.WaitDeployment(ctx, "default", e.name, 3*time.Minute); err != nil {
			t.Fatal(err)
		}
		removals := timer.stop(t, 4, 30*time.Second)
		time.Sleep(2 * time.Second) // the last old pod's late failures, if any
		after := countsNow(t, ctx, probeIP)["clusterip"]
		failed := after.Failed - before.Failed
		r.failed = append(r.failed, failed)
		r.attempts += after.OK + after.Failed - before.OK - before.Failed
		r.removal = append(r.removal, removals...)
		t.Logf("restart %d: %d of %d requests failed; endpoint removals %v", i+1, failed, after.OK+after.Failed-before.OK-before.Failed, removals)
	}
	return r
}

// removalTimer watches e's pods and the node's nat table: for every pod
// given a deletionTimestamp, the time until no KUBE-SVC chain jumps to the
// KUBE-SEP chain of its address.
type removalTimer struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	took   []time.Duration
	err    error
}

func startRemovalTimer(t *testing.T, ctx context.Context, e echo) *removalTimer {
	t.Helper()
	w, err := c.Client.CoreV1().Pods("default").Watch(ctx, metav1.ListOptions{LabelSelector: "app=" + e.name})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	rt := &removalTimer{cancel: cancel, done: make(chan struct{})}
	var timing sync.WaitGroup
	seen := map[string]bool{}
	go func() {
		defer close(rt.done)
		defer timing.Wait()
		defer w.Stop()
		for {
			select {
			case <-wctx.Done():
				return
			case ev, ok := <-w.ResultChan():
				if !ok {
					return
				}
				pod, isPod := ev.Object.(*corev1.Pod)
				if !isPod || ev.Type == watch.Error || pod.DeletionTimestamp == nil || pod.Status.PodIP == "" || seen[pod.Name] {
					continue
				}
				seen[pod.Name] = true
				deleted, ip := time.Now(), pod.Status.PodIP
				timing.Go(func() { rt.timeRemoval(wctx, deleted, ip) })
			}
		}
	}()
	return rt
}

func (rt *removalTimer) timeRemoval(ctx context.Context, deleted time.Time, ip string) {
	for ctx.Err() == nil {
		inRules, err := endpointInRules(ctx, ip)
		if err != nil {
			rt.mu.Lock()
			rt.err = err
			rt.mu.Unlock()
			return
		}
		if !inRules {
			rt.mu.Lock()
			rt.took = append(rt.took, time.Since(deleted))
			rt.mu.Unlock()
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop waits until want removals were timed (or timeout passes) and
// returns them.
func (rt *removalTimer) stop(t *testing.T, want int, timeout time.Duration) []time.Duration {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		rt.mu.Lock()
		n, err := len(rt.took), rt.err
		rt.mu.Unlock()
		if n >= want || err != nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	rt.cancel()
	<-rt.done
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if rt.err != nil {
		t.Fatal(rt.err)
	}
	if len(rt.took) < want {
		t.Errorf("only %d of %d deleted pods' endpoints left the rules within %v", len(rt.took), want, timeout)
	}
	return slices.Clone(rt.took)
}

// endpointInRules says whether any KUBE-SVC chain of the node's nat table
// jumps to a KUBE-SEP chain that DNATs to ip (both proxies write
// kube-proxy's chains).
func endpointInRules(ctx context.Context, ip string) (bool, error) {
	out, err := natRules(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return true, nil
		}
		return false, err
	}
	seps := map[string]bool{}
	lines := strings.Split(out, "\n")
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "-A" && strings.HasPrefix(f[1], "KUBE-SEP-") && strings.Contains(l, "--to-destination "+ip+":") {
			seps[f[1]] = true
		}
	}
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) > 1 && f[0] == "-A" && strings.HasPrefix(f[1], "KUBE-SVC-") && seps[f[len(f)-1]] {
			return true, nil
		}
	}
	return false, nil
}

// natRules is the node's nat table, as iptables-save lists it.
func natRules(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "ip", "netns", "exec", cluster.NodeNS, "iptables-save", "-t", "nat").Output()
	if err != nil {
		return "", fmt.Errorf("iptables-save in %s: %w", cluster.NodeNS, err)
	}
	return string(out), nil
}

// median is the middle value of xs (the upper one of an even count; zero
// for none).
func median[T cmp.Ordered](xs []T) T {
	var zero T
	if len(xs) == 0 {
		return zero
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
