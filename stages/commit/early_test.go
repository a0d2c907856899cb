package commit

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// readRecordingKernel is the fake kernel, recording the chains Digests read.
type readRecordingKernel struct {
	*fakekernel.Kernel
	mu   sync.Mutex
	read []string
}

func (k *readRecordingKernel) Digests(ctx context.Context, table string, names []string) (map[string]uint64, error) {
	k.mu.Lock()
	k.read = append(k.read, names...)
	k.mu.Unlock()
	return k.Kernel.Digests(ctx, table, names)
}

// take returns the chains read since the last take.
func (k *readRecordingKernel) take() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := k.read
	k.read = nil
	return out
}

// runFirstPlan starts s (a new ledger) with plan waiting, runs change once s
// has read the kernel at start, and returns once s answered the plan.
func runFirstPlan(t *testing.T, s *Stage, plan *bus.Plan, change func()) bus.Result {
	t.Helper()
	s.afterEarlyRead = change
	s.p.In.Put(plan)
	stop := runStage(t, s)
	defer stop()
	select {
	case <-s.p.Results.Ready():
		r, _ := s.p.Results.TryTake()
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no result for the first plan")
		return bus.Result{}
	}
}

// TestFirstSyncAfterTheEarlyRead: a restarted commit stage reads the kernel
// before its first plan comes. When nothing changed since, the first full sync
// writes nothing and reads only the few endpoint chains it plans; the stale
// endpoint chains kube-proxy leaves (one per endpoint) are never read. When
// another writer changed a chain after that read, the first full sync sees it
// and rewrites that chain: the read is not trusted once the kernel moved on.
func TestFirstSyncAfterTheEarlyRead(t *testing.T) {
	st := rendertest.SyntheticState(20, 2)
	plan := planOf(st, 1, true)
	planned := map[string]bool{}
	for _, tp := range plan.Tables {
		for _, c := range tp.Chains {
			planned[c.Name] = true
		}
	}
	setUp := func(t *testing.T) *readRecordingKernel {
		k := &readRecordingKernel{Kernel: fakekernel.New()}
		if err := testStage(k).apply(context.Background(), plan); err != nil {
			t.Fatal(err)
		}
		k.Payloads = nil
		k.take()
		return k
	}

	t.Run("nothing changed", func(t *testing.T) {
		k := setUp(t)
		// kube-proxy's endpoint chains, as a takeover finds them.
		stale := map[string]bool{}
		for i := range 500 {
			name := fmt.Sprintf("%sOLD%013d", nf.PrefixEndpoint, i)
			k.Tables[nf.TableNAT][name], stale[name] = nil, true
		}
		var early []string
		r := runFirstPlan(t, testStage(k), plan, func() { early = k.take() })
		if !r.OK {
			t.Fatalf("first plan: %v", r.Err)
		}
		if len(early) == 0 {
			t.Fatal("the stage read no chain before its first plan")
		}
		late := k.take()
		for _, name := range append(early, late...) {
			if stale[name] {
				t.Fatalf("the stage read %s, an endpoint chain no plan has (%d chains read early, %d late)", name, len(early), len(late))
			}
		}
		for _, name := range late {
			if !planned[name] || nf.KindOf(name) != nf.KindEndpoint {
				t.Errorf("the first full sync read %s again; want only the planned endpoint chains the early read leaves", name)
			}
		}
		for _, name := range regexpDeclared(strings.Join(k.Payloads, "")) {
			if planned[name] {
				t.Errorf("the first full sync wrote %s, which the kernel held as planned", name)
			}
		}
		requireFresh(t, k.Kernel, st, "after the first sync (the stale chains deleted)")
	})

	t.Run("changed after the read", func(t *testing.T) {
		k := setUp(t)
		svc := serviceChain(k.Kernel)
		r := runFirstPlan(t, testStage(k), plan, func() {
			k.Mu.Lock()
			defer k.Mu.Unlock()
			k.Tables[nf.TableNAT][svc] = k.Tables[nf.TableNAT][svc][1:]
		})
		if !r.OK {
			t.Fatalf("first plan: %v", r.Err)
		}
		requireFresh(t, k.Kernel, st, "after the first sync")
		if got := regexpDeclared(strings.Join(k.Payloads, "")); !slices.Equal(got, []string{svc}) {
			t.Errorf("the first full sync rewrote %v; want only %s, changed after the early read", got, svc)
		}
	})
}

// TestFirstSyncAfterTheEarlyReadInTheKernel: the same in the real kernel, in
// a network namespace: a restarted commit stage over its rules writes nothing
// when nothing changed, and rewrites a service chain deleted from by hand
// between its read at start and its first plan.
func TestFirstSyncAfterTheEarlyReadInTheKernel(t *testing.T) {
	requireNFTables(t)
	st := rendertest.SyntheticState(50, 3)
	plan := planOf(st, 1, true)
	var svc string
	for _, c := range plan.Table(nf.TableNAT).Chains {
		if nf.KindOf(c.Name) == nf.KindService {
			svc = c.Name
			break
		}
	}
	for _, change := range []bool{false, true} {
		t.Run(fmt.Sprintf("changed=%v", change), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				ctx := context.Background()
				tool := nf.Tool{Family: bus.IPv4}
				if err := testStage(tool).apply(ctx, plan); err != nil {
					return err
				}
				rec := &recordingTool{Tool: tool}
				s := testStage(rec)
				var handErr error
				s.afterEarlyRead = func() {
					if s.early == nil {
						handErr = fmt.Errorf("the stage did not read the kernel at start")
					}
					if change {
						if out, err := exec.Command("iptables", "-t", "nat", "-D", svc, "1").CombinedOutput(); err != nil {
							handErr = fmt.Errorf("iptables -D %s 1: %v %s", svc, err, out)
						}
					}
				}
				// Run on this thread: the namespace is this thread's.
				runCtx, cancel := context.WithCancel(ctx)
				s.p.In.Put(plan)
				go func() {
					<-s.p.Results.Ready()
					cancel()
				}()
				if err := s.Run(runCtx); err != nil {
					return err
				}
				if handErr != nil {
					return handErr
				}
				r, _ := s.p.Results.TryTake()
				if !r.OK {
					return fmt.Errorf("first plan: %v", r.Err)
				}
				got := regexpDeclared(strings.Join(rec.payloads, ""))
				var want []string
				if change {
					want = []string{svc}
				}
				if !slices.Equal(got, want) {
					return fmt.Errorf("the first full sync rewrote %v; want %v", got, want)
				}
				return kernelHolds(ctx, tool, plan, "after the first sync")
			})
		})
	}
}
