package netfilter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// legacy is the iptables-legacy backend of family: it takes the xtables lock,
// which the nf_tables backend does not.
func legacy(t *testing.T, family bus.Family) Tool {
	t.Helper()
	tool := Tool{Family: family, backend: "-legacy"}
	if _, err := exec.LookPath(tool.binary("")); err != nil {
		netnstest.Unavailable(t, fmt.Sprintf("%s not installed", tool.binary("")))
	}
	return tool
}

// holdXtablesLock points the iptables tools of this test at a lock file of its
// own (XTABLES_LOCKFILE, so nothing else on the machine waits) and holds that
// lock, as another iptables writer would, until the returned func is called.
func holdXtablesLock(t *testing.T) (release func()) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "xtables.lock")
	t.Setenv("XTABLES_LOCKFILE", path)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	released := false
	release = func() {
		if !released {
			released = true
			f.Close() // drops the lock
		}
	}
	t.Cleanup(release)
	return release
}

// within runs f in ns on its own goroutine and returns what f returned, or fails
// the test if f has not returned after limit (a hang is then a clean failure).
func within(t *testing.T, ns *netnstest.Namespace, limit time.Duration, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go ns.Run(t, func() error { done <- f(); return nil })
	select {
	case err := <-done:
		return err
	case <-time.After(limit):
		t.Fatalf("still running after %v", limit)
		return nil
	}
}

// With the xtables lock held by someone else, an iptables call gives up when its
// context ends, instead of waiting for the lock for ever (go-iptables' bare --wait).
func TestEnsureJumpsStopsWaitingForTheLock(t *testing.T) {
	for _, family := range []bus.Family{bus.IPv4, bus.IPv6} {
		t.Run(family.String(), func(t *testing.T) {
			tool := legacy(t, family)
			ns := netnstest.New(t)
			release := holdXtablesLock(t)
			defer release()
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			start := time.Now()
			err := within(t, ns, 2*time.Second, func() error { return tool.EnsureJumps(ctx, Jumps(true)) })
			if err == nil {
				t.Fatalf("EnsureJumps succeeded while another process held the xtables lock")
			}
			t.Logf("EnsureJumps gave up after %v: %v", time.Since(start).Round(time.Millisecond), err)
		})
	}
}

// Even without a context deadline, a held lock costs a bounded wait (-w), not a hang.
func TestListChainBoundedWaitForTheLock(t *testing.T) {
	tool := legacy(t, bus.IPv4)
	ns := netnstest.New(t)
	holdXtablesLock(t)
	err := within(t, ns, 10*time.Second, func() error {
		_, err := tool.ListChain(context.Background(), TableFilter, "INPUT")
		return err
	})
	if err == nil || errors.Is(err, ErrNoChain) {
		t.Fatalf("ListChain with the lock held = %v; want an error that is not ErrNoChain", err)
	}
}

// tools are the backends a kernel test runs against.
func tools(t *testing.T) []Tool {
	var out []Tool
	for _, tl := range []Tool{{Family: bus.IPv4}, {Family: bus.IPv6}, {Family: bus.IPv4, backend: "-legacy"}, {Family: bus.IPv6, backend: "-legacy"}} {
		if _, err := exec.LookPath(tl.binary("")); err == nil {
			out = append(out, tl)
		}
	}
	if len(out) == 0 {
		netnstest.Unavailable(t, "no iptables installed (go tool task setup)")
	}
	return out
}

func (t Tool) run1(args ...string) error {
	if out, err := exec.Command(t.binary(""), append([]string{"-w", "5"}, args...)...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s %v: %v %s", t.binary(""), args, err, out)
	}
	return nil
}

func TestListChain(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				ctx := context.Background()
				if _, err := tool.ListChain(ctx, TableNAT, "KPIPE-NO-SUCH"); !errors.Is(err, ErrNoChain) {
					return fmt.Errorf("ListChain of a missing chain = %v; want ErrNoChain", err)
				}
				if err := tool.run1("-t", TableNAT, "-N", "KPIPE-TEST"); err != nil {
					return err
				}
				if rules, err := tool.ListChain(ctx, TableNAT, "KPIPE-TEST"); err != nil || len(rules) != 0 {
					return fmt.Errorf("ListChain of an empty chain = %q, %v; want no rules", rules, err)
				}
				for _, c := range []string{"one", "two"} {
					if err := tool.run1("-t", TableNAT, "-A", "KPIPE-TEST", "-m", "comment", "--comment", c+" rule", "-j", "RETURN"); err != nil {
						return err
					}
				}
				rules, err := tool.ListChain(ctx, TableNAT, "KPIPE-TEST")
				want := []string{`-A KPIPE-TEST -m comment --comment "one rule" -j RETURN`, `-A KPIPE-TEST -m comment --comment "two rule" -j RETURN`}
				if err != nil || strings.Join(rules, "\n") != strings.Join(want, "\n") {
					return fmt.Errorf("ListChain = %q, %v; want %q", rules, err, want)
				}
				if _, err := tool.ListChain(ctx, "nosuchtable", "INPUT"); err == nil || errors.Is(err, ErrNoChain) {
					return fmt.Errorf("ListChain in a table that cannot exist = %v; want an error other than ErrNoChain", err)
				}
				return nil
			})
		})
	}
}

// EnsureJumps puts every jump in place once, however often it runs, and puts
// back one that was deleted.
func TestEnsureJumps(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				ctx := context.Background()
				js := Jumps(true)
				for range 2 {
					if err := tool.EnsureJumps(ctx, js); err != nil {
						return err
					}
				}
				if err := tool.run1("-t", TableNAT, "-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", ChainServices); err != nil {
					return err
				}
				if err := tool.EnsureJumps(ctx, js); err != nil {
					return err
				}
				for _, j := range js {
					rules, err := tool.ListChain(ctx, j.Table, j.From)
					if err != nil {
						return err
					}
					n := 0
					for _, r := range rules {
						if strings.HasSuffix(r, " -j "+j.To) {
							n++
							if j.Comment != "" && !strings.Contains(r, j.Comment) {
								return fmt.Errorf("jump %q has lost its comment %q", r, j.Comment)
							}
						}
					}
					if n != 1 {
						return fmt.Errorf("%s/%s has %d jumps to %s; want 1: %q", j.Table, j.From, n, j.To, rules)
					}
				}
				return nil
			})
		})
	}
}

// EnsureJumps never moves a jump of kpipe's that is there: rules another agent
// put in front of them stay in front, in their order. A missing jump goes in
// at the top, as kube-proxy inserts it, and nothing else moves.
func TestEnsureJumpsLeavesOthersInFront(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				ctx := context.Background()
				js := Jumps(true)
				if err := tool.EnsureJumps(ctx, js); err != nil {
					return err
				}
				chains := [][2]string{{TableNAT, "PREROUTING"}, {TableFilter, "INPUT"}}
				for _, c := range chains {
					for _, pos := range []string{"1", "3"} {
						if err := tool.run1("-t", c[0], "-I", c[1], pos, "-m", "comment", "--comment", "agent "+pos, "-j", "ACCEPT"); err != nil {
							return err
						}
					}
					if err := tool.run1("-t", c[0], "-A", c[1], "-m", "comment", "--comment", "agent last", "-j", "ACCEPT"); err != nil {
						return err
					}
				}
				before := map[[2]string][]string{}
				for _, c := range chains {
					rules, err := tool.ListChain(ctx, c[0], c[1])
					if err != nil {
						return err
					}
					before[c] = rules
				}
				if err := tool.EnsureJumps(ctx, js); err != nil {
					return err
				}
				for _, c := range chains {
					if rules, _ := tool.ListChain(ctx, c[0], c[1]); !slices.Equal(rules, before[c]) {
						return fmt.Errorf("%s/%s after EnsureJumps:\n%s\nwant it unchanged:\n%s", c[0], c[1], strings.Join(rules, "\n"), strings.Join(before[c], "\n"))
					}
				}
				// kpipe's jump in PREROUTING (second, behind "agent 1") deleted:
				// put back at the top, the rest as it was.
				jump := "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j " + ChainServices
				if err := tool.run1("-t", TableNAT, "-D", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", ChainServices); err != nil {
					return err
				}
				if err := tool.EnsureJumps(ctx, js); err != nil {
					return err
				}
				want := append([]string{jump}, slices.DeleteFunc(slices.Clone(before[chains[0]]), func(r string) bool { return r == jump })...)
				if rules, _ := tool.ListChain(ctx, TableNAT, "PREROUTING"); !slices.Equal(rules, want) {
					return fmt.Errorf("PREROUTING after its kpipe jump was put back:\n%s\nwant\n%s", strings.Join(rules, "\n"), strings.Join(want, "\n"))
				}
				return nil
			})
		})
	}
}

// CanaryAlive says false, with no error, when the canary chain was deleted or
// flushed; true when it is in place.
func TestCanaryAlive(t *testing.T) {
	tables := []string{TableMangle, TableNAT, TableFilter}
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				ctx := context.Background()
				for _, table := range tables {
					if alive, err := tool.CanaryAlive(ctx, table); alive || err != nil {
						return fmt.Errorf("CanaryAlive(%s) before any canary = %v, %v; want false, nil", table, alive, err)
					}
				}
				for range 2 {
					if err := tool.EnsureCanaries(ctx, tables); err != nil {
						return err
					}
				}
				for _, table := range tables {
					if alive, err := tool.CanaryAlive(ctx, table); !alive || err != nil {
						return fmt.Errorf("CanaryAlive(%s) = %v, %v; want true, nil", table, alive, err)
					}
					want := 1
					if table == TableMangle {
						want = 0 // as kube-proxy's, so that its --cleanup can delete it
					}
					if rules, _ := tool.ListChain(ctx, table, ChainCanary); len(rules) != want {
						return fmt.Errorf("canary chain in %s holds %q; want %d rules", table, rules, want)
					}
				}
				if err := tool.run1("-t", TableNAT, "-F", ChainCanary); err != nil {
					return err
				}
				if err := tool.run1("-t", TableFilter, "-F", ChainCanary); err != nil {
					return err
				}
				if err := tool.run1("-t", TableFilter, "-X", ChainCanary); err != nil {
					return err
				}
				for table, want := range map[string]bool{TableMangle: true, TableNAT: false, TableFilter: false} {
					if alive, err := tool.CanaryAlive(ctx, table); alive != want || err != nil {
						return fmt.Errorf("CanaryAlive(%s) after flushing nat and deleting filter = %v, %v; want %v, nil", table, alive, err, want)
					}
				}
				return nil
			})
		})
	}
}

// When iptables cannot answer (here: the lock is held past the context), CanaryAlive
// says so with an error, not with "flushed".
func TestCanaryAliveErrorIsNotFlushed(t *testing.T) {
	tool := legacy(t, bus.IPv4)
	ns := netnstest.New(t)
	ns.Run(t, func() error { return tool.EnsureCanaries(context.Background(), []string{TableNAT}) })
	holdXtablesLock(t)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var alive bool
	err := within(t, ns, 2*time.Second, func() error {
		var err error
		alive, err = tool.CanaryAlive(ctx, TableNAT)
		return err
	})
	if err == nil {
		t.Fatalf("CanaryAlive with iptables unable to answer = %v, nil; want an error", alive)
	}
}

func TestHasRandomFully(t *testing.T) {
	if _, err := exec.LookPath("iptables"); err != nil {
		netnstest.Unavailable(t, "iptables not installed")
	}
	out, err := exec.Command("iptables", "--version").Output()
	if err != nil {
		t.Fatal(err)
	}
	// Every iptables since 1.6.2 has it; the machines kpipe's tests run on are newer.
	if !HasRandomFully(bus.IPv4) {
		t.Errorf("HasRandomFully(IPv4) = false with %s", strings.TrimSpace(string(out)))
	}
}

// fakeTools puts scripts named like the iptables tools first on PATH.
func fakeTools(t *testing.T, script string, names ...string) {
	t.Helper()
	dir := t.TempDir()
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("#!/bin/sh\n"+script+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
}

func TestHasRandomFullyOldIptables(t *testing.T) {
	fakeTools(t, `echo "iptables v1.4.21"`, "iptables", "ip6tables")
	for _, f := range []bus.Family{bus.IPv4, bus.IPv6} {
		if HasRandomFully(f) {
			t.Errorf("HasRandomFully(%v) = true with iptables 1.4.21", f)
		}
	}
}

func TestHasRandomFullyBoundedWait(t *testing.T) {
	defer func(d time.Duration) { versionWait = d }(versionWait)
	versionWait = 200 * time.Millisecond
	fakeTools(t, `exec sleep 2`, "iptables")
	start := time.Now()
	if HasRandomFully(bus.IPv4) {
		t.Error("HasRandomFully = true from an iptables that never answered")
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("HasRandomFully took %v with a hanging iptables; want about %v", d, versionWait)
	}
}

// A table the kernel cannot have is told from a failure that may pass: legacy
// iptables asked about a table that does not exist (here an unknown name, which
// it answers as it answers a table whose module is not loaded) fails with
// ErrNoTable; a held lock does not.
func TestNoTable(t *testing.T) {
	tool := legacy(t, bus.IPv4)
	ns := netnstest.New(t)
	ns.Run(t, func() error {
		_, err := tool.CanaryAlive(context.Background(), "kpipe-no-such-table")
		if !errors.Is(err, ErrNoTable) {
			return fmt.Errorf("CanaryAlive in a table the kernel lacks = %v; want ErrNoTable", err)
		}
		return nil
	})
	holdXtablesLock(t)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := within(t, ns, 2*time.Second, func() error { _, err := tool.CanaryAlive(ctx, TableNAT); return err })
	if err == nil || errors.Is(err, ErrNoTable) {
		t.Errorf("CanaryAlive with the lock held = %v; want an error other than ErrNoTable", err)
	}
}
