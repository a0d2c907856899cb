package netfilter_test

import (
	"context"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// BenchmarkExpectedDigests computes the expected digest of every chain of the
// 10,000-service plan, as a restarted kpipe does before comparing.
func BenchmarkExpectedDigests(b *testing.B) {
	plan, _ := syntheticPlan(10000)
	tool := nf.Tool{Family: bus.IPv4}
	b.ReportAllocs()
	for b.Loop() {
		for _, tp := range plan.Tables {
			for _, c := range tp.Chains {
				if _, ok := tool.ExpectedDigest(context.Background(), tp.Table, c.Rules); !ok {
					b.Fatalf("no digest for %s", c.Name)
				}
			}
		}
	}
}
