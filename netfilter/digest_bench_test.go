package netfilter_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/writertest"
)

// BenchmarkDigestsOfEveryChain reads the digest of every chain of the nat
// table, asking by name (as a restarted commit stage compares), at n services.
func BenchmarkDigestsOfEveryChain(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		plan, payload := syntheticPlan(n)
		var names []string
		for _, tp := range plan.Tables {
			if tp.Table == "nat" {
				for _, c := range tp.Chains {
					names = append(names, c.Name)
				}
			}
		}
		bed := writertest.New(b, bus.IPv4)
		bed.Netlink.Run(b, func() error { return nf.Tool{Family: bus.IPv4}.Restore(context.Background(), payload) })
		b.Run(fmt.Sprintf("services=%d/chains=%d", n, len(names)), func(b *testing.B) {
			for b.Loop() {
				bed.Netlink.Run(b, func() error {
					d, err := nf.Tool{Family: bus.IPv4}.Digests(context.Background(), "nat", names)
					if err == nil && len(d) != len(names) {
						err = fmt.Errorf("%d digests of %d chains", len(d), len(names))
					}
					return err
				})
			}
		})
	}
}
