package e2e

import (
	"net"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// With kpipe's default flags no listener of kpipe's serves /debug/stages or the
// kill endpoint: healthz and metrics answer 404 (from the node, and healthz from
// the network), and nothing listens on the debug address. Held over a second, so
// a listener bound late is caught too.
func TestDebugHandlersOffByDefault(t *testing.T) {
	e := setup(t)
	e.startWith("--kubeconfig="+tb.Kubeconfig, "--hostname-override="+testbed.NodeName, "--cluster-cidr="+testbed.ClusterCIDR)
	nodeHealthz := "http://" + net.JoinHostPort(testbed.NodeIPv4, "10256")
	served := []struct{ ns, base string }{
		{tb.NodeNS, testbed.HealthzURL}, {tb.NodeNS, testbed.MetricsURL}, {tb.ClientNS, nodeHealthz},
	}
	for range 5 {
		for _, l := range served {
			for _, req := range []struct {
				post bool
				path string
			}{{true, "/debug/stages/commit-ipv4/kill"}, {false, "/debug/stages"}, {false, "/debug/pprof/"}} {
				do := tb.HTTPGet
				if req.post {
					do = tb.HTTPPost
				}
				code, body, err := do(l.ns, l.base+req.path)
				if err != nil || code != 404 {
					t.Fatalf("%s%s from %s: HTTP %d %q, %v; want 404", l.base, req.path, l.ns, code, body, err)
				}
			}
		}
		for _, base := range []string{testbed.DebugURL, "http://" + net.JoinHostPort(testbed.NodeIPv4, "10249")} {
			ns := tb.NodeNS
			if base != testbed.DebugURL {
				ns = tb.ClientNS // metrics stay on loopback
			}
			if code, _, err := tb.HTTPPost(ns, base+"/debug/stages/commit-ipv4/kill"); err == nil {
				t.Fatalf("POST %s/debug/stages/commit-ipv4/kill from %s answered %d; want nothing listening", base, ns, code)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	if n := metricSum(t, "kpipe_stage_restarts_total", nil); n != 0 {
		t.Errorf("kpipe_stage_restarts_total = %v; want 0 (no kill got through)", n)
	}
}
