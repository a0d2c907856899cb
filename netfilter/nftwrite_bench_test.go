package netfilter_test

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/writertest"
	"github.com/kpipe/kpipe/stages/render"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// BenchmarkNetlinkFullSync writes the full plan of n synthetic services × 10
// endpoints in one batch per table, over itself, and reports how the time
// splits between kpipe (parsing the payload, encoding the rules) and the
// kernel (the batch's sendmsg and answer).
func BenchmarkNetlinkFullSync(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		_, payload := syntheticPlan(n)
		bed := writertest.New(b, bus.IPv4)
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
			var encode, kernel time.Duration
			for b.Loop() {
				start := time.Now()
				write, err := nf.TranslateAndWrite(bus.IPv4, payload)
				if err != nil {
					b.Fatal(err)
				}
				encoded := time.Now()
				bed.Netlink.Run(b, func() error { return write(context.Background()) })
				encode += encoded.Sub(start)
				kernel += time.Since(encoded)
			}
			b.ReportMetric(float64(encode.Milliseconds())/float64(b.N), "encode-ms/op")
			b.ReportMetric(float64(kernel.Milliseconds())/float64(b.N), "kernel-ms/op")
		})
		// The same batch into empty tables: what the kernel needs to take a
		// node's first sync in one transaction, the bound the commit stage's
		// first sync is measured against (BenchmarkCommit full-into-empty). The
		// timer runs only over the write.
		b.Run(fmt.Sprintf("services=%d/into-empty", n), func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				bed.Reset(b)
				write, err := nf.TranslateAndWrite(bus.IPv4, payload)
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				bed.Netlink.Run(b, func() error { return write(context.Background()) })
			}
		})
	}
}

// BenchmarkNetlinkTranslate turns the full payload of 10,000 synthetic
// services × 10 endpoints into netlink batches without writing them: kpipe's
// share of a first sync through the netlink writer, which needs no namespace.
func BenchmarkNetlinkTranslate(b *testing.B) {
	_, payload := syntheticPlan(10000)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := nf.TranslateAndWrite(bus.IPv4, payload); err != nil {
			b.Fatal(err)
		}
	}
}

// syntheticPlan is the full plan of n synthetic services × 10 endpoints, and
// its payload.
func syntheticPlan(n int) (*bus.Plan, []byte) {
	cfg := render.Config{Family: bus.IPv4, NodeName: "bench-node", MasqueradeBit: 14, DetectLocal: render.DetectClusterCIDR,
		ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}
	plan := render.Render(cfg, &bus.Snapshot{State: rendertest.SyntheticState(n, 10), Full: true})
	var payload bytes.Buffer
	for _, tp := range plan.Tables {
		payload.Write(nf.Assemble(tp.Table, tp.Chains, nil))
	}
	return plan, payload.Bytes()
}
