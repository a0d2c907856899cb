package e2e

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// Helpers of the Service-feature scenarios (nodeport_test.go, external_test.go,
// policy_test.go, flags_test.go, features_test.go).

// otherNode is the nodeName of endpoints "on another node": they are pods of
// the bridge like the others, only their EndpointSlice entry says otherwise.
const otherNode = "kpe2e-other"

// Addresses the scenarios use besides the test bed's own.
const (
	// clientAltIPv4 is a second address some tests add to the client's eth0.
	clientAltIPv4 = "198.51.100.3"
	// nodeAltIPv4 is a second address some tests add to the node's eth0.
	nodeAltIPv4 = "198.51.100.11"
)

// nodeAddrs4 are the node's IPv4 addresses a masqueraded packet can carry.
var nodeAddrs4 = []string{testbed.BridgeIPv4, testbed.NodeIPv4, nodeAltIPv4}

// nodeAddrs6 are the node's IPv6 addresses a masqueraded packet can carry.
var nodeAddrs6 = []string{testbed.BridgeIPv6, testbed.NodeIPv6}

// restartKpipe restarts kpipe with extra flags after the default ones and
// waits until it has synced (/healthz 200). When the test ends kpipe is
// restarted with the default flags, after the evidence of a failure (rules,
// log) has been logged. Calling it again in the same test restarts with the
// new flags; the restore happens once.
func (e *env) restartKpipe(extra ...string) {
	e.t.Helper()
	e.restoreKpipeAtEnd()
	start := time.Now()
	if err := e.k.Restart(extra...); err != nil {
		e.t.Fatalf("restart kpipe with %q: %v", extra, err)
	}
	e.t.Logf("kpipe restarted with extra flags %q, synced after %v", extra, since(start))
}

// restoreKpipeAtEnd makes sure kpipe is restarted with its default flags when
// the test ends, after the evidence of a failure has been logged (once per
// test, however often it is called).
func (e *env) restoreKpipeAtEnd() {
	if e.flagsChanged {
		return
	}
	e.flagsChanged = true
	e.t.Cleanup(func() {
		if e.t.Failed() && !e.dumped {
			e.dumpEvidence()
		}
		if err := e.k.Restart(); err != nil {
			e.t.Errorf("restart kpipe with its default flags: %v", err)
		}
	})
}

// restoreKpipe restarts kpipe with the default flags now (the test goes on).
func (e *env) restoreKpipe() {
	e.t.Helper()
	if err := e.k.Restart(); err != nil {
		e.t.Fatalf("restart kpipe with its default flags: %v", err)
	}
}

// create creates svc (built with testbed.Service and changed) and returns it
// as stored.
func (e *env) create(svc *corev1.Service) *corev1.Service {
	e.t.Helper()
	out, err := tb.CreateService(e.ctx, svc)
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

// setEndpoints makes the slice of svc for the family of eps hold exactly eps.
func (e *env) setEndpoints(svc *corev1.Service, eps ...[]testbed.Endpoint) {
	e.t.Helper()
	var all []testbed.Endpoint
	for _, l := range eps {
		all = append(all, l...)
	}
	if _, err := tb.SetEndpoints(e.ctx, svc, all); err != nil {
		e.t.Fatal(err)
	}
}

// addAddress adds cidr to dev in namespace ns until the test ends.
func addAddress(t *testing.T, ns, dev, cidr string) {
	t.Helper()
	if err := tb.AddAddress(ns, dev, cidr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := tb.DelAddress(ns, dev, cidr); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
}

// typed returns a service of type typ (NodePort or LoadBalancer) with ports.
func typed(ns, name string, typ corev1.ServiceType, ports ...corev1.ServicePort) *corev1.Service {
	svc := testbed.Service(ns, name, ports...)
	svc.Spec.Type = typ
	return svc
}

// dualStack makes svc RequireDualStack, IPv4 first.
func dualStack(svc *corev1.Service) *corev1.Service {
	svc.Spec.IPFamilyPolicy = ptr.To(corev1.IPFamilyPolicyRequireDualStack)
	svc.Spec.IPFamilies = []corev1.IPFamily{corev1.IPv4Protocol, corev1.IPv6Protocol}
	return svc
}

// local are ready endpoints on this node (IPv4).
func local(pods ...int) []testbed.Endpoint { return tb.ReadyEndpoints(pods...) }

// remote are ready endpoints whose slice entry names another node (IPv4).
func remote(pods ...int) []testbed.Endpoint {
	eps := tb.ReadyEndpoints(pods...)
	for i := range eps {
		eps[i].NodeName = otherNode
	}
	return eps
}

// terminating are serving, terminating, not ready endpoints (IPv4) on node.
func terminating(node string, pods ...int) []testbed.Endpoint {
	eps := tb.ReadyEndpoints(pods...)
	for i := range eps {
		eps[i].Ready, eps[i].Serving, eps[i].Terminating, eps[i].NodeName = false, true, true, node
	}
	return eps
}

// notServing are terminating endpoints that no longer serve (IPv4) on node.
func notServing(node string, pods ...int) []testbed.Endpoint {
	eps := tb.ReadyEndpoints(pods...)
	for i := range eps {
		eps[i].Ready, eps[i].Serving, eps[i].Terminating, eps[i].NodeName = false, false, true, node
	}
	return eps
}

func podIPs6(pods ...int) []string {
	out := make([]string, len(pods))
	for i, n := range pods {
		out[i] = tb.Pod(n).IPv6
	}
	return out
}

// tcpFrom is a TCP dialer whose connections come from source address src.
func tcpFrom(src string, timeout time.Duration) dialer {
	return dialer{"tcp", src, func(ns, addr string) (testbed.Answer, error) { return tb.DialTCPFrom(ns, src, addr, timeout) }}
}

// Short-hands: quick dialers for requests that must be answered, and 1 s ones
// for requests that must not be (a drop shows as a timeout).
var (
	tcp2 = tcp(2 * time.Second)
	udp2 = udp(2 * time.Second)
	tcp1 = tcp(time.Second)
	udp1 = udp(time.Second)
)

// samples is how many requests make it all but certain (a miss chance below
// 1e-7) that every one of k equally likely endpoints answers at least once.
func samples(k int) int {
	if k <= 1 {
		return 10
	}
	n, p := 0, float64(k)
	for p >= 1e-7 {
		p *= 1 - 1/float64(k)
		n++
	}
	return n
}

// hits counts the answers of a series of requests: by answering endpoint and
// by the source address the endpoint saw.
type hits struct {
	endpoints map[string]int
	sources   map[string]int
}

func (h hits) String() string {
	return fmt.Sprintf("answers by endpoint %v, sources seen %v", h.endpoints, h.sources)
}

// sample makes n requests from ns to addr; all must be answered.
func sample(d dialer, ns, addr string, n int) (hits, error) {
	h := hits{endpoints: map[string]int{}, sources: map[string]int{}}
	for i := 0; i < n; i++ {
		a, err := d.dial(ns, addr)
		if err != nil {
			return h, fmt.Errorf("request %d/%d from %s to %s: %w (so far: %v)", i+1, n, ns, addr, err, h)
		}
		h.endpoints[a.Endpoint]++
		h.sources[a.SourceIP()]++
	}
	return h, nil
}

// exactly says whether the answering endpoints are exactly want.
func (h hits) exactly(want []string) error {
	if missing, extra := compareAnswerers(h.endpoints, want); len(missing) > 0 || len(extra) > 0 {
		return fmt.Errorf("%v: endpoints that never answered %v, unexpected answerers %v", h, missing, extra)
	}
	return nil
}

// sourcesIn says whether every source the endpoints saw is one of allowed.
func (h hits) sourcesIn(allowed []string) error {
	for src := range h.sources {
		found := false
		for _, a := range allowed {
			found = found || src == a
		}
		if !found {
			return fmt.Errorf("%v: source %s is not one of %v", h, src, allowed)
		}
	}
	return nil
}

// eventuallyExactly waits until a series of requests from ns to addr is all
// answered, by exactly the endpoints want (enough requests that each must
// have answered), each seeing a source among sources (none given: any), and
// returns that series' hits.
func eventuallyExactly(t *testing.T, d dialer, ns, addr string, want []string, sources ...string) hits {
	t.Helper()
	var h hits
	testbed.Eventually(t, 20*time.Second, func() error {
		var err error
		if h, err = sample(d, ns, addr, samples(len(want))); err != nil {
			return err
		}
		if err := h.exactly(want); err != nil {
			return err
		}
		if len(sources) > 0 {
			return h.sourcesIn(sources)
		}
		return nil
	})
	explainAgrees(t, "requests from "+short(ns)+" to "+addr, d, ns, addr, observed{saw: sawAnswered, answerers: want, sources: sources})
	return h
}

// expectExactly is eventuallyExactly that logs what it saw under what.
func expectExactly(t *testing.T, what string, d dialer, ns, addr string, want []string, sources ...string) hits {
	t.Helper()
	h := eventuallyExactly(t, d, ns, addr, want, sources...)
	t.Logf("%s (%s from %s): %v", what, addr, short(ns), h)
	return h
}

// A negative outcome (dropped, refused, unanswered) counts once it holds for
// settleRequests requests in a row, settleInterval apart: a rule that flaps
// must not pass on a lucky first try.
const (
	settleRequests = 5
	settleInterval = 100 * time.Millisecond
)

// eventuallyConsistently waits (up to 20 s) until a request from ns to addr
// has the outcome check accepts: kpipe has converged. Then the next
// settleRequests-1 requests, settleInterval apart, must have it too;
// otherwise the test fails with the outcomes seen, in order. It returns the
// outcomes.
func eventuallyConsistently(t *testing.T, what string, d dialer, ns, addr string, check func(testbed.Answer, error) error) []string {
	t.Helper()
	seen, err := settle(20*time.Second, d, ns, addr, check)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return seen
}

// settle is eventuallyConsistently's work: it returns the outcomes of the
// requests from the first accepted one on, or why they do not count.
func settle(timeout time.Duration, d dialer, ns, addr string, check func(testbed.Answer, error) error) ([]string, error) {
	var seen []string
	try := func() error {
		a, err := d.dial(ns, addr)
		seen = append(seen, outcome(a, err))
		return check(a, err)
	}
	if err := testbed.Poll(timeout, 100*time.Millisecond, func() error {
		seen = seen[:0]
		return try()
	}); err != nil {
		return nil, fmt.Errorf("not so after %v: %w", timeout, err)
	}
	for i := 2; i <= settleRequests; i++ {
		time.Sleep(settleInterval)
		if err := try(); err != nil {
			return seen, fmt.Errorf("%s from %s flapped: request %d of %d in a row after it first held: %w (outcomes in order: %s)",
				addr, short(ns), i, settleRequests, err, strings.Join(seen, "; "))
		}
	}
	return seen, nil
}

// outcome says in a few words what became of a request.
func outcome(a testbed.Answer, err error) string {
	switch {
	case err == nil:
		return "answered by " + a.Endpoint + " (source seen " + a.SeenSource + ")"
	case errors.Is(err, testbed.ErrRefused):
		return "refused"
	case errors.Is(err, testbed.ErrTimeout):
		return "timed out"
	}
	return "error: " + err.Error()
}

// eventuallyDropped waits until requests from ns to addr time out: dropped,
// neither answered nor refused (see eventuallyConsistently). d should have a
// short timeout (tcp1, udp1).
func eventuallyDropped(t *testing.T, what string, d dialer, ns, addr string) {
	t.Helper()
	start := time.Now()
	eventuallyConsistently(t, what, d, ns, addr, func(a testbed.Answer, err error) error {
		if err == nil || !errors.Is(err, testbed.ErrTimeout) {
			return fmt.Errorf("%s, want it dropped (a timeout)", outcome(a, err))
		}
		return nil
	})
	t.Logf("%s: %s from %s dropped, %d times in a row (checked within %v)", what, addr, short(ns), settleRequests, since(start))
	explainAgrees(t, what, d, ns, addr, observed{saw: sawDropped})
}

// eventuallyRefused waits until requests from ns to addr are refused (see
// eventuallyConsistently).
func eventuallyRefused(t *testing.T, what string, d dialer, ns, addr string) {
	t.Helper()
	eventuallyConsistently(t, what, d, ns, addr, func(a testbed.Answer, err error) error {
		if err == nil || !errors.Is(err, testbed.ErrRefused) {
			return fmt.Errorf("%s, want it refused", outcome(a, err))
		}
		return nil
	})
	t.Logf("%s: %s from %s refused, %d times in a row", what, addr, short(ns), settleRequests)
	explainAgrees(t, what, d, ns, addr, observed{saw: sawRefused})
}

// eventuallyUnanswered waits until requests from ns to addr fail, refused or
// timed out: no endpoint answers them (see eventuallyConsistently).
func eventuallyUnanswered(t *testing.T, what string, d dialer, ns, addr string) {
	t.Helper()
	seen := eventuallyConsistently(t, what, d, ns, addr, func(a testbed.Answer, err error) error {
		if err == nil {
			return fmt.Errorf("%s, want no answer", outcome(a, err))
		}
		return nil
	})
	t.Logf("%s: %s from %s not answered, %d times in a row: %s", what, addr, short(ns), settleRequests, strings.Join(seen, "; "))
	explainAgrees(t, what, d, ns, addr, observed{saw: sawUnanswered})
}

// short names a test bed namespace by its role ("node", "client", "pod11").
func short(ns string) string {
	if i := strings.LastIndexByte(ns, '-'); i >= 0 && strings.HasPrefix(ns, testbed.NamePrefix) {
		return ns[i+1:]
	}
	return ns
}

// serviceChain matches the name of a service port's KUBE-SVC- chain (kube-proxy's
// hash: 16 base32 characters), not kpipe's KUBE-SVC-B<bits>- dispatch chains.
var serviceChain = regexp.MustCompile(`^KUBE-SVC-[A-Z2-7]{16}$`)

// rulesMatching returns the lines of an iptables-save dump containing every
// one of words.
func rulesMatching(save string, words ...string) []string {
	var out []string
	for _, l := range strings.Split(save, "\n") {
		ok := true
		for _, w := range words {
			ok = ok && strings.Contains(l, w)
		}
		if ok {
			out = append(out, l)
		}
	}
	return out
}

// metricSum scrapes kpipe's /metrics and adds up the samples of name whose
// labels include every pair of labels.
func metricSum(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	sum, err := scrapeSum(name, labels)
	if err != nil {
		t.Fatal(err)
	}
	return sum
}

// scrapeSum is metricSum's work: an error when /metrics does not answer.
func scrapeSum(name string, labels map[string]string) (float64, error) {
	m, err := kpipeMetrics()
	if err != nil {
		return 0, err
	}
	return testbed.Sum(m, name, labels), nil
}

// kpipeMetrics scrapes kpipe's /metrics (see testbed.ScrapeMetrics).
func kpipeMetrics() (map[string]float64, error) {
	return tb.ScrapeMetrics(tb.NodeNS, testbed.MetricsURL+"/metrics")
}
