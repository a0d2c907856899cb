package commit

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// runWithRepairs runs a commit stage over k with a repairs mailbox until the test
// ends, and applies a first plan of st.
func runWithRepairs(t *testing.T, k *fakekernel.Kernel, st bus.State) (*Stage, *bus.Mailbox[bus.Repair]) {
	t.Helper()
	s, repairs := startWithRepairs(t, k)
	s.p.In.Put(planOf(st, 1, true))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	return s, repairs
}

// startWithRepairs runs a commit stage over k with a repairs mailbox until the
// test ends.
func startWithRepairs(t *testing.T, k *fakekernel.Kernel) (*Stage, *bus.Mailbox[bus.Repair]) {
	t.Helper()
	s := testStage(k)
	repairs := bus.NewMergingMailbox(bus.MergeRepairs)
	s.p.Repairs = repairs
	t.Cleanup(runStage(t, s))
	return s, repairs
}

// serviceChain is one of the KUBE-SVC- chains in k's nat table (k.Mu held).
func serviceChain(k *fakekernel.Kernel) string {
	for c := range k.Tables[nf.TableNAT] {
		if nf.KindOf(c) == nf.KindService {
			return c
		}
	}
	return ""
}

// waitFor waits until cond holds of the fake kernel.
func waitFor(t *testing.T, k *fakekernel.Kernel, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		k.Mu.Lock()
		ok := cond()
		k.Mu.Unlock()
		if ok {
			return
		}
	}
	t.Fatalf("gave up waiting for %s", what)
}

// A repair rewrites exactly the chains another writer changed, from the last plan
// and at once (no new plan, no result to coalesce), puts back kpipe's jumps
// missing in the tables named, and leaves alone a chain of the same kind that kpipe
// never wrote and another agent's chain.
func TestRepairRewritesOnlyTheChangedChains(t *testing.T) {
	k := fakekernel.New()
	st := rendertest.SyntheticState(20, 2)
	s, repairs := runWithRepairs(t, k, st)
	k.Mu.Lock()
	svc := serviceChain(k)
	nat := k.Tables[nf.TableNAT]
	nat[svc][0] = "-A " + svc + " -j RETURN"                                // a rule replaced
	nat[nf.ChainServices] = nat[nf.ChainServices][:1]                       // rules deleted
	nat["KUBE-SVC-NOTKPIPES"] = []string{"-A KUBE-SVC-NOTKPIPES -j RETURN"} // not kpipe's
	nat["AGENT"] = []string{"-A AGENT -j RETURN"}
	k.Payloads, k.Events = nil, nil
	k.Mu.Unlock()

	repairs.Put(bus.Repair{Chains: map[string]map[string]bool{nf.TableNAT: {svc: true, nf.ChainServices: true, "KUBE-SVC-NOTKPIPES": true, "AGENT": true}},
		Jumps: map[string]bool{nf.TableNAT: true}, Since: time.Now()})
	waitFor(t, k, "the jumps", func() bool { return slices.Contains(k.Events, "jumps nat") })
	got := regexpDeclared(strings.Join(k.Payloads, ""))
	if want := sorted([]string{svc, nf.ChainServices}); !slices.Equal(got, want) {
		t.Errorf("the repair rewrote %v; want only %v", got, want)
	}
	k.Mu.Lock()
	nat = k.Tables[nf.TableNAT]
	for _, c := range []string{"KUBE-SVC-NOTKPIPES", "AGENT"} {
		if len(nat[c]) != 1 {
			t.Errorf("the repair changed %s, which kpipe did not write: %q", c, nat[c])
		}
		delete(nat, c)
	}
	k.Mu.Unlock()
	requireFresh(t, k, st, "after the repair")
	if r, ok := s.p.Results.TryTake(); ok {
		t.Errorf("a repair posted a result to coalesce: %+v", r)
	}
}

// A lost table (or lost notifications) rewrites everything as a full sync, counted
// as one.
func TestRepairOfALostTableIsAFullSync(t *testing.T) {
	k := fakekernel.New()
	st := rendertest.SyntheticState(20, 2)
	s, repairs := runWithRepairs(t, k, st)
	fullBefore := observations(t, s.metrics.SyncFullDuration, "IPv4")
	k.Mu.Lock()
	k.Tables[nf.TableNAT] = map[string][]string{}
	k.Payloads, k.Events = nil, nil
	k.Mu.Unlock()
	repairs.Put(bus.Repair{Lost: true, Jumps: map[string]bool{nf.TableNAT: true}, Since: time.Now()})
	waitFor(t, k, "the jumps", func() bool { return slices.Contains(k.Events, "jumps nat") })
	requireFresh(t, k, st, "after the repair of a deleted nat table")
	if !slices.Contains(k.Events, "jumps") {
		t.Errorf("the repair of a lost table was not a full sync (events %q)", k.Events)
	}
	if n := observations(t, s.metrics.SyncFullDuration, "IPv4"); n != fullBefore+1 {
		t.Errorf("full syncs counted: %v, want %v: a full repair is a full sync for the metrics", n, fullBefore+1)
	}
}

// A repair asked for before any plan was applied waits for the first plan, which
// rewrites what it names, and then checks the jumps.
func TestRepairBeforeTheFirstPlan(t *testing.T) {
	k := fakekernel.New()
	s, repairs := startWithRepairs(t, k)
	repairs.Put(bus.Repair{Jumps: map[string]bool{nf.TableFilter: true}, Since: time.Now()})
	time.Sleep(20 * time.Millisecond)
	k.Mu.Lock()
	if k.Restores != 0 || len(k.Events) != 0 {
		t.Errorf("a repair with no plan applied yet wrote: %q", k.Events)
	}
	k.Mu.Unlock()
	st := rendertest.SyntheticState(5, 1)
	s.p.In.Put(planOf(st, 1, false))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	waitFor(t, k, "the jumps", func() bool { return slices.Contains(k.Events, "jumps filter") })
	requireFresh(t, k, st, "after the first plan")
}

// A repair that fails is not retried in a loop: the chains stay in doubt, and the
// next plan rewrites them.
func TestFailedRepairWaitsForTheNextPlan(t *testing.T) {
	k := fakekernel.New()
	st := rendertest.SyntheticState(5, 1)
	s, repairs := runWithRepairs(t, k, st)
	k.Mu.Lock()
	svc := serviceChain(k)
	k.Tables[nf.TableNAT][svc] = nil
	k.BeforeRestore = func(int, string) error { return errors.New("injected: iptables-restore failed") }
	before := k.Restores
	k.Mu.Unlock()
	repairs.Put(bus.Repair{Chains: map[string]map[string]bool{nf.TableNAT: {svc: true}}, Since: time.Now()})
	time.Sleep(100 * time.Millisecond)
	k.Mu.Lock()
	tries := k.Restores - before
	k.BeforeRestore = nil
	k.Mu.Unlock()
	if tries != 1 {
		t.Errorf("a failing repair ran iptables-restore %d times in 100 ms; want once", tries)
	}
	s.p.In.Put(planOf(st, 2, false))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	requireFresh(t, k, st, "after the next plan")
}

// A commit stopped while it repairs returns at once (the repair stays pending for
// the restarted stage), instead of applying the repair again and again.
func TestStopDuringARepair(t *testing.T) {
	k := fakekernel.New()
	st := rendertest.SyntheticState(5, 1)
	s := testStage(k)
	repairs := bus.NewMergingMailbox(bus.MergeRepairs)
	s.p.Repairs = repairs
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	s.p.In.Put(planOf(st, 1, true))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	k.Mu.Lock()
	k.StallAfter = func(int) bool { return true } // the repair's restore hangs until the stage is stopped
	delete(k.Tables, nf.TableNAT)                 // lost, as the repair says
	k.Mu.Unlock()
	repairs.Put(bus.Repair{Lost: true, Since: time.Now()})
	waitFor(t, k, "the repair's restore", func() bool { return k.Restores > 1 })
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a commit stopped during a repair did not return")
	}
	if s.repair == nil {
		t.Error("the repair cut short by the stop was dropped; the restarted stage must do it")
	}
}

// kpipe's own writes come back as notifications like anyone's (port ids and pids
// cannot tell them apart: other containers in the host network namespace reuse
// them), so a repair may name every chain kpipe just wrote. Commit compares
// those chains in the kernel with what it wrote: it writes nothing for them,
// however often they are named; of the chains named, it rewrites only the one
// another writer changed, and once it is back, nothing again.
func TestRepairWritesOnlyChainsNotAsKpipeWroteThem(t *testing.T) {
	k := fakekernel.New()
	st := rendertest.SyntheticState(20, 2)
	_, repairs := runWithRepairs(t, k, st)
	k.Mu.Lock()
	named := map[string]map[string]bool{}
	for table, chains := range k.Tables {
		named[table] = map[string]bool{}
		for c := range chains {
			if nf.KindOf(c) != nf.KindOther {
				named[table][c] = true
			}
		}
	}
	svc := serviceChain(k)
	k.Mu.Unlock()
	// Each round also asks for the jumps, whose check shows the repair was taken.
	repairWrote := func() []string {
		t.Helper()
		k.Mu.Lock()
		k.Payloads, k.Events = nil, nil
		k.Mu.Unlock()
		repairs.Put(bus.Repair{Chains: named, Jumps: map[string]bool{nf.TableNAT: true}, Since: time.Now()})
		waitFor(t, k, "the repair's jump check", func() bool { return slices.Contains(k.Events, "jumps nat") })
		k.Mu.Lock()
		defer k.Mu.Unlock()
		return regexpDeclared(strings.Join(k.Payloads, ""))
	}
	for round := range 3 {
		if got := repairWrote(); len(got) > 0 {
			t.Fatalf("round %d: a repair naming the chains as kpipe wrote them rewrote %d of them (%v ...)", round, len(got), got[:min(3, len(got))])
		}
	}
	k.Mu.Lock()
	k.Tables[nf.TableNAT][svc] = append(k.Tables[nf.TableNAT][svc], "-A "+svc+" -j ACCEPT") // another writer
	k.Mu.Unlock()
	if got := repairWrote(); !slices.Equal(got, []string{svc}) {
		t.Errorf("after another writer appended a rule to %s, the repair rewrote %v; want only it", svc, got)
	}
	requireFresh(t, k, st, "after the repair")
	for round := range 3 {
		if got := repairWrote(); len(got) > 0 {
			t.Errorf("round %d after the repair: rewrote %v again", round, got)
		}
	}
}
