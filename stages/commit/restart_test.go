package commit

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// TestRestartedCommitWritesOnlyWhatDiffers: a commit stage with a new ledger
// (a restarted kpipe) over a kernel that already holds its plan compares
// chain by chain and rewrites only the chain another writer changed; the next
// change is then written as a partial sync.
func TestRestartedCommitWritesOnlyWhatDiffers(t *testing.T) {
	k := fakekernel.New()
	st := rendertest.SyntheticState(20, 2)
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	svc := serviceChain(k)
	k.Mu.Lock()
	k.Tables[nf.TableNAT][svc] = k.Tables[nf.TableNAT][svc][1:]
	k.Mu.Unlock()
	k.Payloads = nil

	restarted := testStage(k) // a new ledger
	if err := restarted.apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, st, "after the restart")
	if got := regexpDeclared(strings.Join(k.Payloads, "")); !slices.Equal(got, []string{svc}) {
		t.Errorf("the restarted commit rewrote %v; want only the changed %s", got, svc)
	}

	k.Payloads = nil
	shrunk := with(st, nil, nil, "svc5")
	if err := restarted.apply(context.Background(), planOf(shrunk, 2, false)); err != nil {
		t.Fatal(err)
	}
	requireFresh(t, k, shrunk, "after the first change")
	if got := regexpDeclared(strings.Join(k.Payloads, "")); len(got) != 2 {
		t.Errorf("the first change after the restart rewrote %v; want svc5's two chains", got)
	}
}

// legacyKernel is the fake kernel as the legacy backend answers: no expected
// digests; it records the chains each Digests call asked for.
type legacyKernel struct {
	*fakekernel.Kernel
	asked []string
}

func (k *legacyKernel) ExpectedDigest(context.Context, string, string) (uint64, bool) {
	return 0, false
}

func (k *legacyKernel) Digests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	k.asked = append(k.asked, names...)
	return k.Kernel.Digests(ctx, table, names)
}

// TestLegacyFullSyncReadsNoServiceChains: where the kernel cannot say what a
// chain's digest should be (the legacy backend, whose read is a whole
// iptables-save), a full sync does not read the chains to compare: it writes
// them, as before the comparison existed.
func TestLegacyFullSyncReadsNoServiceChains(t *testing.T) {
	k := &legacyKernel{Kernel: fakekernel.New()}
	st := rendertest.SyntheticState(20, 2)
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	k.asked = nil
	if err := testStage(k).apply(context.Background(), planOf(st, 1, true)); err != nil {
		t.Fatal(err)
	}
	for _, name := range k.asked {
		if nf.KindOf(name) == nf.KindService {
			t.Fatalf("a legacy full sync read service chain %s (asked for %d chains)", name, len(k.asked))
		}
	}
	requireFresh(t, k.Kernel, st, "after the full sync")
}

// recordingTool is the real kernel, with the payloads commit writes recorded.
type recordingTool struct {
	nf.Tool
	payloads []string
}

func (r *recordingTool) Prepare(payload []byte) func(context.Context) error {
	r.payloads = append(r.payloads, string(payload))
	return r.Tool.Prepare(payload)
}

// TestRestartedCommitComparesWithTheKernel: the same in the real kernel, in a
// network namespace: a restarted commit stage reads every chain's rules over
// netlink, and rewrites only a service chain and a filter chain that were
// changed by hand, and the top-level chain a rule was added to.
func TestRestartedCommitComparesWithTheKernel(t *testing.T) {
	requireNFTables(t)
	st := rendertest.SyntheticState(50, 3)
	plan := planOf(st, 1, true)
	netnstest.New(t).Run(t, func() error {
		ctx := context.Background()
		tool := nf.Tool{Family: bus.IPv4}
		if err := testStage(tool).apply(ctx, plan); err != nil {
			return err
		}
		var svc string
		for _, c := range plan.Table(nf.TableNAT).Chains {
			if nf.KindOf(c.Name) == nf.KindService {
				svc = c.Name
				break
			}
		}
		if svc == "" {
			return fmt.Errorf("no service chain in the plan")
		}
		hand := [][]string{
			{"-t", "nat", "-D", svc, "1"},
			{"-t", "nat", "-A", nf.ChainServices, "-j", "ACCEPT"},
			{"-t", "filter", "-F", nf.ChainForward},
		}
		for _, args := range hand {
			if out, err := exec.Command("iptables", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("iptables %v: %v %s", args, err, out)
			}
		}
		rec := &recordingTool{Tool: tool}
		if err := testStage(rec).apply(ctx, plan); err != nil {
			return err
		}
		got := regexpDeclared(strings.Join(rec.payloads, ""))
		if want := sorted([]string{svc, nf.ChainServices, nf.ChainForward}); !slices.Equal(got, want) {
			return fmt.Errorf("the restarted commit rewrote %v; want only the changed %v", got, want)
		}
		return kernelHolds(ctx, tool, plan, "after the restart")
	})
}

// kernelHolds says (nil) whether the kernel holds what a fresh write of plan
// leaves: every chain's digest is the one its rules give.
func kernelHolds(ctx context.Context, tool nf.Tool, plan *bus.Plan, when string) error {
	for _, tp := range plan.Tables {
		digests, err := tool.Digests(ctx, tp.Table, nil)
		if err != nil {
			return err
		}
		for _, c := range tp.Chains {
			want, ok := tool.ExpectedDigest(ctx, tp.Table, c.Rules)
			if !ok || digests[c.Name] != want {
				return fmt.Errorf("%s, %s %s is not as planned", when, tp.Table, c.Name)
			}
		}
	}
	return nil
}
