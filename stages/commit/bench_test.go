package commit

import (
	"context"
	"fmt"
	"maps"
	"runtime"
	"runtime/metrics"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/netfilter/writertest"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// BenchmarkCommit measures what a sync costs in the kernel on this host, as the
// commit stage writes it (iptables-restore --noflush, batched), inside a throwaway
// network namespace: a full sync into empty tables (start-up), a restarted
// kpipe's full sync over what it left, a partial sync after one service's endpoints changed, and the
// periodic sync (top-level chains rewritten, jumps re-ensured).
func BenchmarkCommit(b *testing.B) {
	netnstest.RequireRoot(b)
	cfg := render.Config{Family: bus.IPv4, NodeName: "bench-node", MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR}
	for _, n := range []int{1000, 10000} {
		st := rendertest.SyntheticState(n, 10)
		fullPlan := render.Render(cfg, &bus.Snapshot{State: st, Full: true})
		same := render.Render(cfg, &bus.Snapshot{State: st})
		partial := render.Render(cfg, &bus.Snapshot{State: withOneChange(st)})
		periodic := render.Render(cfg, &bus.Snapshot{State: st, Refresh: true})
		added := render.Render(cfg, &bus.Snapshot{State: withNewService(st)})
		b.Run(fmt.Sprintf("services=%d/full-into-empty", n), func(b *testing.B) {
			var held uint64
			for b.Loop() {
				b.StopTimer()
				ns := netnstest.New(b)
				ns.Run(b, func() error { return writertest.MakeTables(bus.IPv4) }) // as on a node
				peak := watchLiveHeap()
				b.StartTimer()
				ns.Run(b, func() error { return apply(fullPlan) })
				b.StopTimer()
				held = max(held, peak())
				b.StartTimer()
			}
			b.ReportMetric(float64(fullPlan.Table(nf.TableNAT).RuleCount+fullPlan.Table(nf.TableFilter).RuleCount), "rules")
			b.ReportMetric(float64(held)/(1<<20), "held-MiB")
		})
		ns := netnstest.New(b)
		s := realStage()
		write := func(p *bus.Plan) func() error { return func() error { return s.apply(context.Background(), p) } }
		ns.Run(b, write(fullPlan))
		// A restarted kpipe (a new ledger) over the rules it left: it reads
		// every chain back and compares, and writes nothing.
		b.Run(fmt.Sprintf("services=%d/restart-over-itself", n), func(b *testing.B) {
			for b.Loop() {
				ns.Run(b, func() error { return realStage().apply(context.Background(), fullPlan) })
			}
		})
		// Each iteration changes one service's endpoints, or changes them back.
		b.Run(fmt.Sprintf("services=%d/partial-one-service", n), func(b *testing.B) {
			i := 0
			for b.Loop() {
				ns.Run(b, write([]*bus.Plan{partial, same}[i%2]))
				i++
			}
		})
		b.Run(fmt.Sprintf("services=%d/partial-new-service", n), func(b *testing.B) {
			i := 0
			for b.Loop() {
				ns.Run(b, write([]*bus.Plan{added, same}[i%2]))
				i++
			}
		})
		ns.Run(b, write(same))
		removed := render.Render(cfg, &bus.Snapshot{State: withoutEndpoint(st, 1, "svc7")})
		for _, fast := range []bool{true, false} {
			b.Run(fmt.Sprintf("services=%d/partial-endpoint-removed/fast-path=%v", n, fast), func(b *testing.B) {
				benchRemoval(b, ns, s.ledger, fast, removed, same)
			})
		}
		b.Run(fmt.Sprintf("services=%d/periodic", n), func(b *testing.B) {
			for b.Loop() {
				ns.Run(b, write(periodic))
			}
		})
	}
}

// BenchmarkCommitKubeProxyLayout is the same full sync into empty tables with
// kube-proxy's layout: one KUBE-SEP- chain per endpoint (what kpipe writes when every
// endpoint is on this node). At 10k services this shape does not finish in
// minutes on iptables-nft, so it is measured at 1000.
func BenchmarkCommitKubeProxyLayout(b *testing.B) {
	netnstest.RequireRoot(b)
	cfg := render.Config{Family: bus.IPv4, NodeName: "bench-node", MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR}
	st := rendertest.SyntheticState(1000, 10)
	for _, sl := range st.Slices {
		for _, s := range sl {
			for i := range s.Items {
				s.Items[i].NodeName = "bench-node"
			}
		}
	}
	plan := render.Render(cfg, &bus.Snapshot{State: st, Full: true})
	b.Run("services=1000/full-into-empty", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			ns := netnstest.New(b)
			b.StartTimer()
			ns.Run(b, func() error { return apply(plan) })
			b.StopTimer()
			b.StartTimer()
		}
		b.ReportMetric(float64(len(plan.Table(nf.TableNAT).Chains)), "nat-chains")
	})
}

// benchRemoval times plans that remove a middle endpoint of one service
// (each put back, untimed, after): from the plan to the delete-only
// transaction landed (the endpoint out of the rules) and to the end of the
// walked write. Without the fast path the endpoint is out only at the end.
func benchRemoval(b *testing.B, ns *netnstest.Namespace, ledger *Ledger, fast bool, removed, same *bus.Plan) {
	watch := &deleteWatcher{Tool: nf.Tool{Family: bus.IPv4}}
	var kernel Kernel = watch
	if !fast {
		kernel = struct{ Kernel }{watch} // no RuleDeleter: today's one walked write
	}
	s := testStage(kernel)
	s.ledger, s.last = ledger, same
	var landed time.Time
	watch.landed = func() error { landed = time.Now(); return nil }
	var toGone, toWalked time.Duration
	for b.Loop() {
		landed = time.Time{}
		start := time.Now()
		ns.Run(b, func() error { return s.apply(context.Background(), removed) })
		walked := time.Now()
		if landed.IsZero() {
			landed = walked
		}
		toGone, toWalked = toGone+landed.Sub(start), toWalked+walked.Sub(start)
		b.StopTimer()
		s.last = removed
		ns.Run(b, func() error { return s.apply(context.Background(), same) })
		s.last = same
		b.StartTimer()
	}
	if fast && watch.count < b.N {
		b.Fatalf("%d delete-only transactions in %d removals", watch.count, b.N)
	}
	b.ReportMetric(float64(toGone.Milliseconds())/float64(b.N), "ms-to-gone")
	b.ReportMetric(float64(toWalked.Milliseconds())/float64(b.N), "ms-to-walked")
}

func withOneChange(st bus.State) bus.State {
	key := bus.ServiceKey{Namespace: "ns7", Name: "svc7"}
	changed := *st.Slices[key]["svc7-1"]
	changed.Items = changed.Items[:len(changed.Items)-1]
	out := st
	out.Slices = map[bus.ServiceKey]map[string]*bus.EndpointSlice{}
	for k, v := range st.Slices {
		out.Slices[k] = v
	}
	out.Slices[key] = map[string]*bus.EndpointSlice{"svc7-1": &changed}
	return out
}

// withNewService adds one service with 10 endpoints to st (made by
// rendertest.SyntheticState with 10 endpoints a service) at the next random ClusterIP,
// as the apiserver allocates one.
func withNewService(st bus.State) bus.State {
	n := len(st.Services)
	next := rendertest.SyntheticState(n+1, 10)
	key := bus.ServiceKey{Namespace: fmt.Sprintf("ns%d", n%100), Name: fmt.Sprintf("svc%d", n)}
	out := st
	out.Services, out.Slices = maps.Clone(st.Services), maps.Clone(st.Slices)
	out.Services[key], out.Slices[key] = next.Services[key], next.Slices[key]
	return out
}

// watchLiveHeap samples the heap live after each collection until peak is
// called, which returns its highest rise over the live heap when it began:
// what the work in between held at once (the heap grows to twice that before
// the next collection).
func watchLiveHeap() (peak func() uint64) {
	runtime.GC()
	sample := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	live := func() uint64 { metrics.Read(sample); return sample[0].Value.Uint64() }
	base, highest := live(), uint64(0)
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			highest = max(highest, live())
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	return func() uint64 {
		close(done)
		<-stopped
		if highest < base {
			return 0
		}
		return highest - base
	}
}
