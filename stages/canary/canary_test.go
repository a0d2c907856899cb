package canary

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// TestFlushIsNoticed: after `iptables -F` (the chain stays, its rule goes) in nat
// or filter, or `-X` (the chain goes) in any table, the check asks for a full
// resync and puts the canary back; with the canaries in place it asks for
// nothing. (The mangle canary is an empty chain, as kube-proxy's: kpipe has no
// rules in mangle to repair after a flush.) Real iptables, in a throwaway network
// namespace.
func TestFlushIsNoticed(t *testing.T) {
	if _, err := exec.LookPath("iptables"); err != nil {
		netnstest.Unavailable(t, "iptables not installed (go tool task setup)")
	}
	netnstest.New(t).Run(t, func() error {
		resync := bus.NewResyncFlag()
		s := NewStage(Params{Interval: time.Hour, Resync: map[bus.Family]*bus.ResyncFlag{bus.IPv4: resync}, Env: bus.Envs{Board: bus.NewBoard()}.For(bus.Canary)})
		ctx := context.Background()
		tool := nf.Tool{Family: bus.IPv4}
		if err := tool.EnsureCanaries(ctx, tables); err != nil {
			return err
		}
		if err := s.check(ctx, bus.IPv4, tool); err != nil {
			return err
		}
		if resync.Lower() {
			return fmt.Errorf("resync asked for with every canary in place")
		}
		for _, table := range tables {
			flushes := [][][]string{
				{{"-t", table, "-F"}},                 // the whole table
				{{"-t", table, "-F", nf.ChainCanary}}, // the canary's rule
				{{"-t", table, "-F", nf.ChainCanary}, {"-t", table, "-X", nf.ChainCanary}}, // the chain itself
			}
			if table == nf.TableMangle {
				flushes = flushes[2:]
			}
			for _, flush := range flushes {
				for _, args := range flush {
					if out, err := exec.Command("iptables", args...).CombinedOutput(); err != nil {
						return fmt.Errorf("iptables %v: %v %s", args, err, out)
					}
				}
				if err := s.check(ctx, bus.IPv4, tool); err != nil {
					return err
				}
				if !resync.Lower() {
					return fmt.Errorf("iptables %v went unnoticed", flush)
				}
				for _, t := range tables {
					if alive, err := tool.CanaryAlive(ctx, t); !alive || err != nil {
						return fmt.Errorf("canary in %s not restored after iptables %v: %v", t, flush, err)
					}
				}
			}
		}
		return nil
	})
}

// On the nf_tables backend the stage subscribes to the changes: with an hour's
// poll interval, a canary flushed by another process still brings a repair at
// once. It stops promptly when its context ends (kpipe's shutdown waits for it).
func TestSubscribedStageStops(t *testing.T) {
	if _, err := exec.LookPath("iptables"); err != nil {
		netnstest.Unavailable(t, "iptables not installed (go tool task setup)")
	}
	ns := netnstest.New(t)
	// runIn runs the stage in the namespace: a goroutine started inside ns.Run
	// would run on another thread, in the host's namespace, and write the host's
	// tables.
	runIn := func(ctx context.Context, s *Stage) <-chan error {
		done := make(chan error, 1)
		go ns.Run(t, func() error { done <- s.Run(ctx); return nil })
		return done
	}
	ns.Run(t, func() error {
		repairs := bus.NewMergingMailbox(bus.MergeRepairs)
		s := NewStage(Params{Interval: time.Hour, Resync: map[bus.Family]*bus.ResyncFlag{bus.IPv4: bus.NewResyncFlag()},
			Repairs: map[bus.Family]*bus.Mailbox[bus.Repair]{bus.IPv4: repairs}, Env: bus.Envs{Board: bus.NewBoard()}.For(bus.Canary)})
		for round := range 20 {
			ctx, cancel := context.WithCancel(context.Background())
			done := runIn(ctx, s)
			time.Sleep(time.Duration(round) * 5 * time.Millisecond)
			cancel()
			select {
			case err := <-done:
				if err != nil {
					return err
				}
			case <-time.After(5 * time.Second):
				return fmt.Errorf("round %d: Run still running 5s after its context ended", round)
			}
		}

		ctx, cancel := context.WithCancel(context.Background())
		done := runIn(ctx, s)
		defer func() { cancel(); <-done }()
		tool := nf.Tool{Family: bus.IPv4}
		// Flushed again until a repair comes: a flush before Run subscribed goes
		// unseen, and then nothing puts the canary's rule back but this loop
		// (a rule added by another process asks for no repair; a flush of it does).
		for deadline := time.Now().Add(10 * time.Second); ; {
			if time.Now().After(deadline) {
				return errors.New("a flushed canary brought no repair: the stage is not subscribed to the changes")
			}
			if alive, err := tool.CanaryAlive(ctx, nf.TableNAT); err == nil && !alive {
				// Fails while the stage has not made the chain yet: tried again.
				_ = exec.Command("iptables", "-w", "5", "-t", nf.TableNAT, "-A", nf.ChainCanary, "-m", "comment", "--comment", "kpipe canary", "-j", "RETURN").Run()
			}
			if alive, err := tool.CanaryAlive(ctx, nf.TableNAT); err == nil && alive {
				if out, err := exec.Command("iptables", "-w", "5", "-t", nf.TableNAT, "-F", nf.ChainCanary).CombinedOutput(); err != nil {
					return fmt.Errorf("iptables -F: %v %s", err, out)
				}
			}
			wait, stop := context.WithTimeout(ctx, time.Second)
			r, err := repairs.Take(wait)
			stop()
			if err == nil {
				if !r.Lost {
					return fmt.Errorf("repair %+v after the canary was flushed; want everything", r)
				}
				return nil
			}
		}
	})
}

// TestTableWithoutCanaryIsGivenUp: on a legacy host without iptable_mangle the
// mangle canary can never be made. The stage gives that table up and keeps
// watching nat and filter: restarted ten times it neither asks for a full
// resync nor fails, and stops asking iptables about mangle; a flush of nat is
// still noticed. Both answers iptables may give about the missing table: the
// canary is not there (nf_tables), or the table does not exist (legacy).
func TestTableWithoutCanaryIsGivenUp(t *testing.T) {
	for _, answer := range []noTableAnswer{answersGone, answersError} {
		fake := newTableCanaries(map[string]noTableAnswer{nf.TableMangle: answer})
		resync := bus.NewResyncFlag()
		s := NewStage(Params{Interval: time.Millisecond, Resync: map[bus.Family]*bus.ResyncFlag{bus.IPv4: resync},
			Tools: map[bus.Family]Canaries{bus.IPv4: fake}, Env: bus.Envs{Board: bus.NewBoard()}.For(bus.Canary)})
		var resyncs, failures []int
		var mangleAsked int
		for run := range 10 {
			if err := runWhileChecking(t, s, fake, nil); err != nil {
				failures = append(failures, run)
				t.Logf("answer %d, run %d: %v", answer, run, err)
			}
			if resync.Lower() {
				resyncs = append(resyncs, run)
			}
			if run == 0 {
				mangleAsked = fake.calls(nf.TableMangle)
			}
		}
		if len(resyncs) > 0 || len(failures) > 0 {
			t.Errorf("answer %d: over 10 runs of the stage, full resyncs asked for at runs %v and runs failed at %v; want none",
				answer, resyncs, failures)
		}
		if n := fake.calls(nf.TableMangle) - mangleAsked; n > 0 {
			t.Errorf("answer %d: iptables asked %d more times about the mangle canary after the first run", answer, n)
		}
		// nat is still watched: flushed while the stage runs, it asks for a resync
		// and the canary is put back.
		flushed := false
		if err := runWhileChecking(t, s, fake, func() bool {
			if !flushed {
				fake.flush(nf.TableNAT)
				flushed = true
			}
			return resync.Lower()
		}); err != nil {
			t.Errorf("answer %d: Run = %v after nat was flushed", answer, err)
		}
		if alive, _ := fake.CanaryAlive(context.Background(), nf.TableNAT); !alive {
			t.Errorf("answer %d: the nat canary was not put back", answer)
		}
	}
}

// runWhileChecking runs s until it has checked fake's nat canary twice more and
// until (if not nil) returns true, then stops it and returns what Run returned;
// or returns at once what Run returns if it ends by itself.
func runWhileChecking(t *testing.T, s *Stage, fake *tableCanaries, until func() bool) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	checked := fake.calls(nf.TableNAT) + 2
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		select {
		case err := <-done:
			return err
		default:
		}
		if fake.calls(nf.TableNAT) >= checked && (until == nil || until()) {
			cancel()
			return <-done
		}
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatal("the stage did not check the nat canary within 10s")
		}
	}
}
