package render

import (
	"bytes"
	"fmt"
	"maps"
	"net/netip"
	"runtime"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render/rendertest"
	"github.com/kpipe/kpipe/stages/render/tracer"
)

// BenchmarkRenderFull renders every chain of a cluster of 1k and 10k services, their
// ClusterIPs at random over 10.96.0.0/12 (a full sync). Besides the time it
// reports how many nat rules a new connection to a service's first port walks
// from KUBE-SERVICES to its service's rule, at most and on average.
func BenchmarkRenderFull(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("services=%d/endpoints=10", n), func(b *testing.B) {
			st := rendertest.SyntheticState(n, 10)
			b.ReportAllocs()
			var p *bus.Plan
			for b.Loop() {
				p = Render(baseConfig(), full(st))
			}
			b.ReportMetric(float64(p.Table(nf.TableNAT).RuleCount+p.Table(nf.TableFilter).RuleCount), "rules")
			b.ReportMetric(float64(len(p.Table(nf.TableNAT).Chains)), "nat-chains")
			rules := natRules(p)
			worst, total := 0, 0
			for _, s := range st.Services {
				n, _ := walk(rules, netip.AddrPortFrom(s.ClusterIPs[0], uint16(s.Ports[0].Port)))
				worst, total = max(worst, n), total+n
			}
			b.ReportMetric(float64(worst), "walk-max")
			b.ReportMetric(float64(total)/float64(len(st.Services)), "walk-mean")
		})
	}
}

// BenchmarkRenderOneEndpointChanged renders a partial sync after one service's
// endpoints changed in a 10k-service cluster, as the render stage does: with its
// cache of the services that did not change.
func BenchmarkRenderOneEndpointChanged(b *testing.B) {
	st := rendertest.SyntheticState(10000, 10)
	rr := NewRenderer(baseConfig())
	rr.Render(full(st))
	key := bus.ServiceKey{Namespace: "ns7", Name: "svc7"}
	states := [2]bus.State{st, st}
	states[1].Slices = maps.Clone(st.Slices)
	changed := *st.Slices[key]["svc7-1"]
	changed.Items = changed.Items[:9]
	states[1].Slices[key] = map[string]*bus.EndpointSlice{"svc7-1": &changed}
	b.ReportAllocs()
	var p *bus.Plan
	i := 0
	for b.Loop() {
		i++
		p = rr.Render(&bus.Snapshot{State: states[i%2]})
	}
	b.ReportMetric(float64(len(p.Table(nf.TableNAT).Chains)), "nat-chains")
}

// BenchmarkRenderCacheMemory reports the live heap a Renderer's cache holds
// after rendering 10k services with 10 endpoints each (plans dropped), and how
// much of it is the rules' text.
func BenchmarkRenderCacheMemory(b *testing.B) {
	st := rendertest.SyntheticState(10000, 10)
	var cached, text float64
	for b.Loop() {
		before := liveHeap()
		rr := NewRenderer(baseConfig())
		p := rr.Render(full(st))
		text = 0
		for _, tp := range p.Tables {
			for _, c := range tp.Chains {
				text += float64(len(c.Rules))
			}
		}
		p = nil
		cached = float64(liveHeap() - before)
		runtime.KeepAlive(rr)
	}
	b.ReportMetric(cached/(1<<20), "cache-MiB")
	b.ReportMetric(text/(1<<20), "plan-text-MiB")
}

// liveHeap is the heap in use after a full collection.
func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkExplainRuleset is kpipe explain's work after iptables-save has
// printed a node's rules (1k and 10k services × 10 endpoints, kpipe's layout):
// read the document, then follow one packet from a pod to a ClusterIP.
func BenchmarkExplainRuleset(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("services=%d/endpoints=10", n), func(b *testing.B) {
			st := rendertest.SyntheticState(n, 10)
			plan := Render(baseConfig(), full(st))
			var doc bytes.Buffer
			if err := nf.WriteRulesets(&doc, []nf.Ruleset{nf.PlanRuleset(plan, nf.FreshBuiltins(nf.Jumps(true)))}); err != nil {
				b.Fatal(err)
			}
			s := st.Services[keyOf(st.Services)]
			pkt := tracer.Packet{Source: ip("10.244.1.20"), Dest: s.ClusterIPs[0], Proto: "tcp", DPort: int(s.Ports[0].Port),
				From: tracer.FromPrerouting, InInterface: "veth1"}
			for b.Loop() {
				rs, err := nf.ParseRulesetOf(doc.Bytes(), bus.IPv4)
				if err != nil {
					b.Fatal(err)
				}
				if res := tracer.TraceRuleset(rs, nil, pkt); res.Err != nil || len(res.Endpoints) == 0 {
					b.Fatalf("%s", res)
				}
			}
			b.ReportMetric(float64(doc.Len())/(1<<20), "MiB-of-rules")
		})
	}
}

// keyOf is one of m's keys.
func keyOf[K comparable, V any](m map[K]V) K {
	for k := range m {
		return k
	}
	var zero K
	return zero
}
