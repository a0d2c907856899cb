package commit

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/bus/bustest"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// watchedTool is the real kernel, with the payloads commit writes and its jump
// checks recorded (the stage runs on another goroutine).
type watchedTool struct {
	nf.Tool
	mu         sync.Mutex
	payloads   []string
	jumpChecks int
}

func (w *watchedTool) Prepare(payload []byte) func(context.Context) error {
	w.mu.Lock()
	w.payloads = append(w.payloads, string(payload))
	w.mu.Unlock()
	return w.Tool.Prepare(payload)
}

func (w *watchedTool) EnsureJumps(ctx context.Context, js []nf.Jump) error {
	err := w.Tool.EnsureJumps(ctx, js)
	w.mu.Lock()
	w.jumpChecks++
	w.mu.Unlock()
	return err
}

// heard is the repair the kernel's notifications ask for, as canary names it:
// every chain of kpipe's kind that changed, whoever changed it; empty when the
// kernel stayed quiet for a moment.
func heard(t *testing.T, sub *nf.Subscription) bus.Repair {
	t.Helper()
	r := bus.Repair{Chains: map[string]map[string]bool{}, Since: time.Now()}
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		cs, err := sub.Next(ctx)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			return r
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			if nf.KindOf(c.Chain) != nf.KindOther {
				if r.Chains[c.Table] == nil {
					r.Chains[c.Table] = map[string]bool{}
				}
				r.Chains[c.Table][c.Chain] = true
			}
		}
	}
}

// TestOwnWritesHeardFromTheKernelWriteNothing: in the real kernel, the
// notifications of kpipe's own writes name the chains it wrote; the repair they
// ask for reads those chains, finds them as written, and writes nothing, so
// nothing more is heard. A rule another writer appends is heard, and only that
// chain is rewritten; the rewrite is heard in turn and writes nothing.
func TestOwnWritesHeardFromTheKernelWriteNothing(t *testing.T) {
	requireNFTables(t)
	ns := netnstest.New(t)
	tool := &watchedTool{Tool: nf.Tool{Family: bus.IPv4}}
	var sub *nf.Subscription
	ns.Run(t, func() (err error) {
		sub, err = tool.Subscribe(context.Background())
		return err
	})
	defer sub.Close()
	s := testStage(tool)
	repairs := bus.NewMergingMailbox(bus.MergeRepairs)
	s.p.Repairs = repairs
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() {
		var err error
		ns.Run(t, func() error { err = s.Run(ctx); return nil })
		stopped <- err
	}()
	defer func() { cancel(); <-stopped }()
	st := rendertest.SyntheticState(20, 2)
	s.p.In.Put(planOf(st, 1, true))
	if r := bustest.Take(t, s.p.Results, "result"); !r.OK {
		t.Fatal(r.Err)
	}
	// repair hands r to commit with a jump check, whose end shows it was taken,
	// and returns the chains the repair wrote.
	repair := func(r bus.Repair) []string {
		t.Helper()
		tool.mu.Lock()
		tool.payloads = nil
		checks := tool.jumpChecks
		tool.mu.Unlock()
		r.Jumps = map[string]bool{nf.TableNAT: true}
		repairs.Put(r)
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			tool.mu.Lock()
			done, payloads := tool.jumpChecks > checks, tool.payloads
			tool.mu.Unlock()
			if done {
				return regexpDeclared(strings.Join(payloads, ""))
			}
			if time.Now().After(deadline) {
				t.Fatal("the repair did not check the jumps")
			}
		}
	}
	own := heard(t, sub)
	if len(own.Chains[nf.TableNAT]) == 0 {
		t.Fatalf("kpipe's full sync was not heard: %v", own.Chains)
	}
	if got := repair(own); len(got) > 0 {
		t.Fatalf("the notifications of kpipe's own full sync rewrote %d chains (%v ...)", len(got), got[:min(3, len(got))])
	}
	for round := range 3 {
		if r := heard(t, sub); len(r.Chains) > 0 {
			t.Fatalf("round %d: kpipe's chains changed again after its own write was checked: %v", round, r.Chains)
		}
	}

	svc := ""
	for _, c := range planOf(st, 1, true).Table(nf.TableNAT).Chains {
		if nf.KindOf(c.Name) == nf.KindService {
			svc = c.Name
			break
		}
	}
	ns.Run(t, func() error {
		if out, err := exec.Command("iptables", "-t", "nat", "-A", svc, "-j", "ACCEPT").CombinedOutput(); err != nil {
			return fmt.Errorf("iptables: %v %s", err, out)
		}
		return nil
	})
	foreign := heard(t, sub)
	if got := repair(foreign); len(got) != 1 || got[0] != svc {
		t.Fatalf("after another writer appended to %s (heard: %v), the repair rewrote %v; want only it", svc, foreign.Chains, got)
	}
	rewrite := heard(t, sub)
	if !rewrite.Chains[nf.TableNAT][svc] {
		t.Fatalf("kpipe's rewrite of %s was not heard: %v", svc, rewrite.Chains)
	}
	if got := repair(rewrite); len(got) > 0 {
		t.Fatalf("the notifications of kpipe's rewrite of %s rewrote %v", svc, got)
	}
	if r := heard(t, sub); len(r.Chains) > 0 {
		t.Fatalf("kpipe's chains changed again after its rewrite was checked: %v", r.Chains)
	}
}
