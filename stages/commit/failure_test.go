package commit

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
)

var errRejected = errors.New("injected: the kernel rejected the transaction")

// payloadOps lists the chains a payload writes or deletes, as "table chain".
func payloadOps(payload string) []string {
	var out []string
	table := ""
	for _, l := range strings.Split(payload, "\n") {
		switch {
		case strings.HasPrefix(l, "*"):
			table = l[1:]
		case strings.HasPrefix(l, ":"):
			name, _, _ := strings.Cut(l[1:], " ")
			out = append(out, table+" "+name)
		case strings.HasPrefix(l, "-X "):
			out = append(out, table+" "+strings.TrimSpace(l[3:]))
		}
	}
	return out
}

// TestRejectedTransactionAtEachStep: the kernel rejects one transaction of a
// commit, each of them in turn: the first filter pass (guards), nat, the final
// filter pass, and with a batched plan each batch. Whichever it is:
//   - the commit fails (coalesce then retries it after a backoff),
//   - no state the kernel went through lets a packet through a gap that neither
//     the old nor the new rules have (a service without DNAT and REJECT, a
//     firewall chain reachable without its DROP): the transactions before the
//     rejected one left each table whole, the ones after it were not tried,
//   - the ledger holds every chain of the rejected run in doubt,
//   - once the kernel takes writes again, the next commit of the same state
//     (partial: nothing tells it what the failed one did but the ledger) leaves
//     exactly what a fresh kpipe writes.
func TestRejectedTransactionAtEachStep(t *testing.T) {
	for _, size := range []struct {
		name     string
		services int
	}{{"one restore", 40}, {"batched", maxChainsPerRestore/2 + 200}} {
		before := largeState(size.services)
		after, gaps := gapScenario(before)
		// How many transactions the change takes when nothing fails.
		k := fakekernel.New()
		s := testStage(k)
		if err := s.apply(context.Background(), planOf(before, 1, true)); err != nil {
			t.Fatal(err)
		}
		var tables []string
		k.BeforeCommit = func(table string) error { tables = append(tables, table); return nil }
		if err := s.apply(context.Background(), planOf(after, 2, false)); err != nil {
			t.Fatal(err)
		}
		if size.services < 100 && len(tables) != 3 {
			t.Fatalf("%s: the change took the transactions %v; the test wants filter, nat, filter", size.name, tables)
		}
		for i := range tables {
			t.Run(fmt.Sprintf("%s/transaction %d of %d (%s)", size.name, i+1, len(tables), tables[i]), func(t *testing.T) {
				k := fakekernel.New()
				s := testStage(k)
				if err := s.apply(context.Background(), planOf(before, 1, true)); err != nil {
					t.Fatal(err)
				}
				state := map[string]map[string][]string{}
				state[nf.TableNAT], _ = k.Save(context.Background(), nf.TableNAT)
				state[nf.TableFilter], _ = k.Save(context.Background(), nf.TableFilter)
				k.Observe = func(table string, chains map[string][]string) {
					state[table] = chains
					for _, g := range gaps(state[nf.TableNAT], state[nf.TableFilter]) {
						t.Errorf("after transaction %d (%s): %s", k.Blocks, table, g)
					}
				}
				// From transaction i on, the kernel refuses everything (a step
				// that deleted chains is tried again without them: refused too).
				n := 0
				k.BeforeCommit = func(string) error {
					if n++; n >= i+1 {
						return errRejected
					}
					return nil
				}
				k.Payloads = nil
				err := s.apply(context.Background(), planOf(after, 2, false))
				if !errors.Is(err, errRejected) {
					t.Fatalf("commit = %v; want the rejection", err)
				}
				for _, g := range gaps(state[nf.TableNAT], state[nf.TableFilter]) {
					t.Errorf("left after the rejection: %s", g)
				}
				failed := k.Payloads[len(k.Payloads)-1]
				for _, o := range payloadOps(failed) {
					table, chain, _ := strings.Cut(o, " ")
					if !s.ledger.unsure[key(table, chain)] {
						t.Errorf("%s/%s, written by the rejected run, is not in doubt in the ledger", table, chain)
					}
				}
				k.BeforeCommit = nil
				if err := s.apply(context.Background(), planOf(after, 3, false)); err != nil {
					t.Fatal(err)
				}
				requireFresh(t, k, after, "after the retry")
				if len(s.ledger.unsure) != 0 {
					t.Errorf("%d chains still in doubt after a successful commit", len(s.ledger.unsure))
				}
			})
		}
	}
}

// TestFailedCommitsAreCountedAndRecover runs the stage as the supervisor does
// while the kernel rejects every write: each plan is answered with a failure
// (coalesce backs off and retries on it), counted in kube-proxy's restore
// failure metrics (a partial plan also as a partial failure), and the board
// shows the failures in a row (which the events stage turns into a Warning
// and health into a 503 once a change has waited long enough). When the
// kernel takes writes again the next plan succeeds and the board's count
// starts over.
func TestFailedCommitsAreCountedAndRecover(t *testing.T) {
	k := fakekernel.New()
	board := bus.NewBoard()
	s := testStageOn(k, board)
	stop := runStage(t, s)
	defer stop()
	before := largeState(40)
	after, _ := gapScenario(before)
	s.p.In.Put(planOf(before, 1, true))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatalf("first commit: %+v", r)
	}
	good := k.Dump()
	k.Mu.Lock()
	k.BeforeCommit = func(table string) error {
		if table == nf.TableNAT {
			return errRejected
		}
		return nil
	}
	k.Mu.Unlock()
	for gen := uint64(2); gen <= 4; gen++ {
		s.p.In.Put(planOf(after, gen, gen == 4)) // coalesce retries a failure as a full sync
		r := bustest.Take(t, s.p.Results, "result")
		if r.OK || r.Generation != gen || !errors.Is(r.Err, errRejected) {
			t.Fatalf("generation %d: result %+v; want a failure carrying the rejection", gen, r)
		}
	}
	family := bus.IPv4.String()
	if got := value(t, s.metrics.RestoreFailures.WithLabelValues(family)); got != 3 {
		t.Errorf("restore failures = %v; want 3", got)
	}
	if got := value(t, s.metrics.PartialRestoreFailures.WithLabelValues(family)); got != 2 {
		t.Errorf("partial restore failures = %v; want 2 (the full retry is not partial)", got)
	}
	rep := board.Read()[bus.Commit.Of(bus.IPv4)]
	if rep.Errors != 3 || !strings.Contains(rep.LastError, errRejected.Error()) || rep.Generation != 1 {
		t.Errorf("board after 3 failures: %+v; want 3 errors, the rejection, the last good generation 1", rep)
	}
	// The nat table was never touched: the last good rules are all there.
	if d := lineDiff(tableLines(good, nf.TableNAT), tableLines(k.Dump(), nf.TableNAT)); d != "" {
		t.Errorf("nat changed although every nat transaction was rejected:\n%s", d)
	}

	k.Mu.Lock()
	k.BeforeCommit = nil
	k.Mu.Unlock()
	s.p.In.Put(planOf(after, 5, true))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK || r.Generation != 5 {
		t.Fatalf("after the fault went away: %+v; want OK", r)
	}
	requireFresh(t, k, after, "after the fault went away")
	if rep := board.Read()[bus.Commit.Of(bus.IPv4)]; rep.Generation != 5 || !rep.LastSync.After(rep.LastErrorAt) {
		t.Errorf("board after the recovery: %+v; want generation 5 synced after the last error", rep)
	}
}

// tableLines keeps the lines of a fakekernel Dump that belong to table.
func tableLines(dump, table string) string {
	var out []string
	for _, l := range strings.Split(dump, "\n") {
		if strings.HasPrefix(l, table+" ") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestChainInUseHoldsUpNothing runs the real kernel (the netlink writer, or
// iptables-restore off nf_tables): a service loses its endpoints (filter gets
// its REJECT first) and another is deleted, but the kernel refuses to delete
// that one's chain because a rule that is not kpipe's still jumps to it
// (EBUSY). The commit succeeds all the same and leaves no gap at any point:
// everything else is written, the chain is emptied and left. Once the foreign
// rule is gone, the next periodic sync deletes it.
func TestChainInUseHoldsUpNothing(t *testing.T) {
	netnstest.RequireRoot(t)
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		netnstest.Unavailable(t, "iptables-restore not installed (go tool task setup)")
	}
	before := largeState(40)
	after, gaps := gapScenario(before)
	var deleted bus.ServiceKey
	for k, svc := range after.Services {
		if len(svc.LoadBalancerIPs) == 0 && len(after.Slices[k]) > 0 {
			deleted = k
			break
		}
	}
	delete(after.Services, deleted)
	delete(after.Slices, deleted)
	dsvc := before.Services[deleted]
	held := nf.ServiceChain(nf.PrefixService, dsvc.PortName(dsvc.Ports[0]))
	ctx := context.Background()
	tool := nf.Tool{Family: bus.IPv4}
	var want map[string][]string // nat as a fresh kpipe writes after
	netnstest.New(t).Run(t, func() error {
		if err := realStage().apply(ctx, planOf(after, 1, true)); err != nil {
			return err
		}
		var err error
		want, err = tool.Save(ctx, nf.TableNAT)
		return err
	})
	netnstest.New(t).Run(t, func() error {
		s := realStage()
		if err := s.apply(ctx, planOf(before, 1, true)); err != nil {
			return err
		}
		iptables := func(args ...string) error {
			if out, err := exec.Command("iptables", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("iptables %v: %v %s", args, err, out)
			}
			return nil
		}
		// Another agent's chain jumps into the service chain kpipe is about to delete.
		if err := iptables("-t", "nat", "-N", "OTHER-AGENT"); err != nil {
			return err
		}
		if err := iptables("-t", "nat", "-A", "OTHER-AGENT", "-j", held); err != nil {
			return err
		}
		if err := s.apply(ctx, planOf(after, 2, false)); err != nil {
			return fmt.Errorf("a chain the kernel will not delete failed the commit: %w", err)
		}
		if g, err := gapsIn(ctx, tool, gaps); err != nil || len(g) > 0 {
			return fmt.Errorf("after the commit: %v %v", g, err)
		}
		nat, err := tool.Save(ctx, nf.TableNAT)
		if err != nil {
			return err
		}
		if rules, ok := nat[held]; !ok || len(rules) > 0 {
			return fmt.Errorf("%s: in nat %v, rules %q; want it there, emptied", held, ok, rules)
		}
		delete(nat, held)
		delete(nat, "OTHER-AGENT")
		if d := lineDiff(saveText(want), saveText(nat)); d != "" {
			return fmt.Errorf("nat besides the chain in use is not what a fresh kpipe writes:\n%s", d)
		}
		// The other agent goes away: the next periodic sync deletes the chain.
		if err := iptables("-t", "nat", "-F", "OTHER-AGENT"); err != nil {
			return err
		}
		if err := iptables("-t", "nat", "-X", "OTHER-AGENT"); err != nil {
			return err
		}
		refresh := planOf(after, 3, false)
		refresh.Refresh = true
		if err := s.apply(ctx, refresh); err != nil {
			return fmt.Errorf("periodic sync once the fault is gone: %w", err)
		}
		got, err := tool.Chains(ctx, nf.TableNAT)
		if err != nil {
			return err
		}
		if slices.Contains(got, held) {
			return fmt.Errorf("%s still in nat after the periodic sync", held)
		}
		return nil
	})
}

// saveText renders a table as Tool.Save returns it, chain by chain, for lineDiff.
func saveText(chains map[string][]string) string {
	var b strings.Builder
	for _, c := range slices.Sorted(maps.Keys(chains)) {
		b.WriteString(":" + c + "\n")
		for _, r := range chains[c] {
			b.WriteString(r + "\n")
		}
	}
	return b.String()
}

// TestRetriedFailureKeepsTheLedgerBounded: while the kernel rejects every
// try of the same plan (another agent's jump holding a chain, say, retried by
// coalesce for as long as it lasts), the rules the ledger keeps as guards for
// the filter chains in doubt do not grow with the tries.
func TestRetriedFailureKeepsTheLedgerBounded(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	before := largeState(40)
	after, _ := gapScenario(before)
	if err := s.apply(context.Background(), planOf(before, 1, true)); err != nil {
		t.Fatal(err)
	}
	k.BeforeCommit = func(table string) error {
		if table == nf.TableNAT {
			return errRejected
		}
		return nil
	}
	held := func() int {
		n := 0
		for _, rules := range s.ledger.tried {
			n += len(rules)
		}
		return n
	}
	sizes := []int{}
	for gen := uint64(2); gen < 12; gen++ {
		if err := s.apply(context.Background(), planOf(after, gen, false)); !errors.Is(err, errRejected) {
			t.Fatalf("try %d = %v; want the rejection", gen-1, err)
		}
		sizes = append(sizes, held())
	}
	if sizes[0] == 0 || sizes[len(sizes)-1] != sizes[0] {
		t.Errorf("guard rules held in the ledger after each failed try: %v bytes; want the same after every try", sizes)
	}
}
