package netfilter_test

import (
	"bytes"
	"context"
	"errors"
	"syscall"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// BenchmarkKernelWriteAfterRefusal is what a write costs right after the
// kernel refused a batch in its validation, in the nat table of 1,000
// synthetic services with kpipe's chains reachable from the built-in ones.
//
// When the walk at commit (nft_table_validate) finds a jump loop, a jump
// stack deeper than 16 (EMLINK) or a target in a chain its hook does not
// allow, the kernel sets the table to NFT_VALIDATE_DO and replays the batch,
// walking the whole table after every rule to name the one at fault
// (refused-after-N-chains: one walk a rule). From upstream 9a32e9850686
// ("don't write table validation state without mutex", Linux 6.9 and its
// stable backports) to 6f93616a7323 ("reset table validation state on
// abort": Linux 7.0, and the 6.18 and 6.6 stable updates of February 2026)
// the table stayed in that state after the abort, so the next transaction
// walked it after every rule too (upstream: an iptables-restore from 0.5 s
// to 82 s); the first commit that passed its walk set it back. On such a kernel the after-a-refusal cases
// cost one walk per rule written, as refused-after-N-chains does; on a fixed
// one, what their plain cases cost.
func BenchmarkKernelWriteAfterRefusal(b *testing.B) {
	ns := netnstest.New(b)
	plan, _ := syntheticPlan(1000)
	tool := nf.Tool{Family: bus.IPv4, Writer: nf.WriterNetlink}
	for _, tp := range plan.Tables {
		ns.Run(b, func() error { return tool.Restore(context.Background(), nf.Assemble(tp.Table, tp.Chains, nil)) })
	}
	ns.Run(b, func() error { return tool.EnsureJumps(context.Background(), nf.Jumps(false)) })
	var services []bus.Chain
	for _, c := range plan.Table(nf.TableNAT).Chains {
		if nf.KindOf(c.Name) == nf.KindService {
			services = append(services, c)
		}
	}
	oneChain := nf.Assemble(nf.TableNAT, services[:1], nil)
	tenChains := nf.Assemble(nf.TableNAT, services[:10], nil)
	// A service chain that jumps back to KUBE-SERVICES: a loop, refused as
	// EMLINK in the walk (the upstream report's CALLEE -j CALLER).
	loop := "-A " + services[0].Name + " -j KUBE-SERVICES\n"
	refusal := []byte("*nat\n" + loop + "COMMIT\n")
	write := func(b *testing.B, payload []byte) {
		ns.Run(b, func() error { return tool.RestoreNetlink(context.Background(), payload) })
	}
	refuse := func(b *testing.B, payload []byte) {
		ns.Run(b, func() error {
			if err := tool.RestoreNetlink(context.Background(), payload); !errors.Is(err, syscall.EMLINK) {
				b.Fatalf("the loop was not refused as EMLINK: %v", err)
			}
			return nil
		})
	}
	for _, c := range []struct {
		name    string
		payload []byte
	}{{"one-chain", oneChain}, {"10-chains", tenChains}} {
		rules := bytes.Count(c.payload, []byte("\n-A "))
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				write(b, c.payload)
			}
			b.ReportMetric(float64(rules), "rules")
		})
		b.Run(c.name+"/after-a-refusal", func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				refuse(b, refusal)
				b.StartTimer()
				write(b, c.payload)
			}
			b.ReportMetric(float64(rules), "rules")
		})
	}
	// What a refused batch costs: the replay walks the table after each of
	// its rules, up to the one refused (at the end here).
	refusedLate := bytes.Replace(tenChains, []byte("COMMIT\n"), []byte(loop+"COMMIT\n"), 1)
	b.Run("refused-after-10-chains", func(b *testing.B) {
		for b.Loop() {
			refuse(b, refusedLate)
		}
		b.ReportMetric(float64(bytes.Count(refusedLate, []byte("\n-A "))), "rules")
	})
}
