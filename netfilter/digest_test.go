package netfilter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mdlayher/netlink"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// digestPayload is a nat table in kpipe's shapes (dispatch, comment, statistic,
// recent, MARK, DNAT, MASQUERADE) for the family, with one empty chain.
func digestPayload(f bus.Family) string {
	vip, ep1, ep2, dst := "10.96.0.10/32", "10.244.1.5", "10.244.2.6", "10.244.1.5:8080"
	if f == bus.IPv6 {
		vip, ep1, ep2, dst = "fd00:96::10/128", "fd00:244::5", "fd00:244::6", "[fd00:244::5]:8080"
	}
	return fmt.Sprintf(`*nat
:KUBE-SVCS-A - [0:0]
:KUBE-SVC-X - [0:0]
:KUBE-SEP-1 - [0:0]
:KUBE-SEP-2 - [0:0]
:KUBE-EMPTY - [0:0]
-A KUBE-SVCS-A -d %[1]s -p tcp -m comment --comment "ns/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-X
-A KUBE-SVCS-A -d %[1]s -p udp -m comment --comment "ns/web:dns cluster IP" -m udp --dport 53 -j KUBE-SVC-X
-A KUBE-SVCS-A -d %[1]s -p tcp -m comment --comment "ns/web:https cluster IP" -m tcp --dport 443 -j KUBE-SVC-X
-A KUBE-SVC-X -m comment --comment "ns/web:http" -m recent --name KUBE-SEP-1 --rcheck --seconds 10800 --reap -j KUBE-SEP-1
-A KUBE-SVC-X -m comment --comment "ns/web:http" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-1
-A KUBE-SVC-X -m comment --comment "ns/web:http" -j KUBE-SEP-2
-A KUBE-SEP-1 -s %[2]s -j MARK --or-mark 0x4000
-A KUBE-SEP-1 -p tcp -m recent --set --name KUBE-SEP-1 -m tcp -j DNAT --to-destination %[4]s
-A KUBE-SEP-2 -s %[3]s -m addrtype --dst-type LOCAL -j MASQUERADE --random-fully
COMMIT
`, vip, ep1, ep2, dst)
}

// digestChains are the chains digestPayload writes.
var digestChains = []string{"KUBE-SVCS-A", "KUBE-SVC-X", "KUBE-SEP-1", "KUBE-SEP-2", "KUBE-EMPTY"}

func digestsNow(tool Tool, table string, names []string) (map[string]uint64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d, err := tool.Digests(ctx, table, names)
	if err != nil {
		return nil, fmt.Errorf("Digests(%s, %q): %w", table, names, err)
	}
	return d, nil
}

func restoreNow(tool Tool, payload string) error {
	return tool.Restore(context.Background(), []byte(payload))
}

// Two namespaces given the same rules hold them with equal digests, all chains
// there (the empty one too); writing the same rules again keeps the digests.
func TestDigestsEqualForTheSameRules(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			var first map[string]uint64
			netnstest.New(t).Run(t, func() error {
				if err := restoreNow(tool, digestPayload(tool.Family)); err != nil {
					return err
				}
				d, err := digestsNow(tool, TableNAT, nil)
				first = d
				return err
			})
			for _, c := range digestChains {
				if _, ok := first[c]; !ok {
					t.Fatalf("Digests = %v; %s is missing", first, c)
				}
			}
			netnstest.New(t).Run(t, func() error {
				if err := restoreNow(tool, digestPayload(tool.Family)); err != nil {
					return err
				}
				d, err := digestsNow(tool, TableNAT, nil)
				if err != nil {
					return err
				}
				if !maps.Equal(d, first) {
					return fmt.Errorf("another namespace with the same rules: %v; want %v", d, first)
				}
				if err := restoreNow(tool, digestPayload(tool.Family)); err != nil { // new rules, same text
					return err
				}
				if d, err = digestsNow(tool, TableNAT, nil); err != nil {
					return err
				}
				if !maps.Equal(d, first) {
					return fmt.Errorf("after writing the same rules again: %v; want %v", d, first)
				}
				return nil
			})
		})
	}
}

// Traffic through a chain's rules changes their counters, never the digest.
func TestDigestsIgnoreCounters(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				loopback := "127.0.0.1"
				if tool.Family == bus.IPv6 {
					loopback = "::1"
				}
				if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
					return fmt.Errorf("ip link set lo up: %v %s", err, out)
				}
				payload := `*filter
:KUBE-SVCS-LO - [0:0]
-A OUTPUT -o lo -j KUBE-SVCS-LO
-A KUBE-SVCS-LO -p udp -m udp --dport 9 -m comment --comment "discard" -j ACCEPT
-A KUBE-SVCS-LO -p udp -j ACCEPT
COMMIT
`
				if err := restoreNow(tool, payload); err != nil {
					return err
				}
				before, err := digestsNow(tool, TableFilter, nil)
				if err != nil {
					return err
				}
				conn, err := net.Dial("udp", net.JoinHostPort(loopback, "9"))
				if err != nil {
					return err
				}
				for range 5 {
					conn.Write([]byte("kpipe")) // refusals (nothing listens) do not matter
				}
				conn.Close()
				if err := countedPackets(tool, "KUBE-SVCS-LO"); err != nil {
					return err
				}
				after, err := digestsNow(tool, TableFilter, nil)
				if err != nil {
					return err
				}
				if !maps.Equal(after, before) {
					return fmt.Errorf("digests after traffic %v; before %v", after, before)
				}
				return nil
			})
		})
	}
}

// countedPackets checks that a rule of chain counted packets, so that a test of
// counters is not vacuous.
func countedPackets(tool Tool, chain string) error {
	out, err := tool.runTool(context.Background(), tool.binary("-save"), nil, "-c", "-t", TableFilter)
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "-A "+chain+" ") && !strings.HasPrefix(line, "[0:") {
			return nil
		}
	}
	return fmt.Errorf("no rule of %s counted a packet:\n%s", chain, out)
}

// Replacing a rule, reordering rules, deleting one, changing a comment: each
// changes the digest of that chain and of no other; writing the rules back gives
// the first digests again.
func TestDigestsTellChangesApart(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				payload := digestPayload(tool.Family)
				if err := restoreNow(tool, payload); err != nil {
					return err
				}
				first, err := digestsNow(tool, TableNAT, nil)
				if err != nil {
					return err
				}
				vip := "10.96.0.10/32"
				if tool.Family == bus.IPv6 {
					vip = "fd00:96::10/128"
				}
				changes := []struct {
					name   string
					change [][]string
				}{
					{"replace rule 2 (same count)", [][]string{{"-R", "KUBE-SVCS-A", "2", "-d", vip, "-p", "udp", "-m", "comment", "--comment", "ns/web:dns cluster IP", "-m", "udp", "--dport", "54", "-j", "KUBE-SVC-X"}}},
					{"change only a comment", [][]string{{"-R", "KUBE-SVCS-A", "2", "-d", vip, "-p", "udp", "-m", "comment", "--comment", "ns/web:dns2 cluster IP", "-m", "udp", "--dport", "53", "-j", "KUBE-SVC-X"}}},
					{"move rule 1 last", [][]string{{"-D", "KUBE-SVCS-A", "1"}, {"-A", "KUBE-SVCS-A", "-d", vip, "-p", "tcp", "-m", "comment", "--comment", "ns/web:http cluster IP", "-m", "tcp", "--dport", "80", "-j", "KUBE-SVC-X"}}},
					{"delete rule 3", [][]string{{"-D", "KUBE-SVCS-A", "3"}}},
					{"delete every rule", [][]string{{"-F", "KUBE-SVCS-A"}}},
				}
				seen := map[uint64]string{first["KUBE-SVCS-A"]: "the first rules"}
				for _, c := range changes {
					for _, args := range c.change {
						if err := tool.run1(append([]string{"-t", TableNAT}, args...)...); err != nil {
							return err
						}
					}
					d, err := digestsNow(tool, TableNAT, nil)
					if err != nil {
						return err
					}
					if other, ok := seen[d["KUBE-SVCS-A"]]; ok {
						return fmt.Errorf("%s: KUBE-SVCS-A has the digest of %s", c.name, other)
					}
					seen[d["KUBE-SVCS-A"]] = c.name
					if emptied := c.name == "delete every rule"; emptied != (d["KUBE-SVCS-A"] == first["KUBE-EMPTY"]) {
						return fmt.Errorf("%s: KUBE-SVCS-A %x, the empty chain %x: equal only when both are empty", c.name, d["KUBE-SVCS-A"], first["KUBE-EMPTY"])
					}
					for name, want := range first {
						if name != "KUBE-SVCS-A" && d[name] != want {
							return fmt.Errorf("%s: the digest of %s changed too", c.name, name)
						}
					}
					if err := restoreNow(tool, payload); err != nil {
						return err
					}
					if d, err = digestsNow(tool, TableNAT, nil); err != nil {
						return err
					}
					if !maps.Equal(d, first) {
						return fmt.Errorf("%s, then the first rules written back: %v; want %v", c.name, d, first)
					}
				}
				return nil
			})
		})
	}
}

// Asked for some chains, Digests answers for exactly those that exist, with the
// digests it gives for the whole table.
func TestDigestsOfNamedChains(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				// Ten more chains than the sample.
				var extra strings.Builder
				extra.WriteString("*nat\n")
				for i := range 10 {
					fmt.Fprintf(&extra, ":KUBE-SVCS-%02d - [0:0]\n", i)
				}
				for i := range 10 {
					fmt.Fprintf(&extra, "-A KUBE-SVCS-%02d -p tcp -m tcp --dport %d -j KUBE-SVC-X\n", i, 1000+i)
				}
				extra.WriteString("COMMIT\n")
				if err := restoreNow(tool, digestPayload(tool.Family)); err != nil {
					return err
				}
				if err := restoreNow(tool, extra.String()); err != nil {
					return err
				}
				all, err := digestsNow(tool, TableNAT, nil)
				if err != nil {
					return err
				}
				many := []string{"KUBE-NO-SUCH"}
				for i := range 10 {
					many = append(many, fmt.Sprintf("KUBE-SVCS-%02d", i))
				}
				cases := []struct {
					names []string
					want  []string
				}{
					{[]string{"KUBE-SVC-X", "KUBE-EMPTY"}, []string{"KUBE-SVC-X", "KUBE-EMPTY"}},
					{[]string{"KUBE-SVCS-A"}, []string{"KUBE-SVCS-A"}},
					{[]string{"KUBE-EMPTY"}, []string{"KUBE-EMPTY"}},
					{[]string{"KUBE-NO-SUCH"}, nil},
					{[]string{"KUBE-NO-SUCH", "KUBE-SEP-1"}, []string{"KUBE-SEP-1"}},
					{[]string{}, nil},
					{many, many[1:]},
				}
				for _, c := range cases {
					d, err := digestsNow(tool, TableNAT, c.names)
					if err != nil {
						return err
					}
					got := slices.Sorted(maps.Keys(d))
					if want := slices.Sorted(slices.Values(c.want)); !slices.Equal(got, want) {
						return fmt.Errorf("Digests of %q answers for %q; want %q", c.names, got, want)
					}
					for name, digest := range d {
						if digest != all[name] {
							return fmt.Errorf("Digests of %q: %s has %x; the whole table says %x", c.names, name, digest, all[name])
						}
					}
				}
				if d, err := digestsNow(tool, TableFilter, []string{"KUBE-SVC-X"}); err != nil || len(d) != 0 {
					return fmt.Errorf("a nat chain asked for in filter: %v, %v; want none", d, err)
				}
				return nil
			})
		})
	}
}

// A table that no tool has written yet has no chains in nf_tables (nothing to
// digest, not an error); on legacy it lists its built-in chains, all empty.
func TestDigestsOfAnUnwrittenTable(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				d, err := digestsNow(tool, TableNAT, nil)
				if err != nil {
					return err
				}
				for name := range d {
					if !slices.Contains([]string{"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}, name) {
						return fmt.Errorf("an unwritten nat table has chain %s", name)
					}
				}
				return nil
			})
		})
	}
}

// The backend comes from the tool's own iptables: a Tool for iptables-legacy
// reads with iptables-legacy-save even on a host whose iptables is nf_tables.
func TestDigestsBackend(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			out, err := exec.Command(tool.binary(""), "-V").Output()
			if err != nil {
				t.Fatal(err)
			}
			want := bytes.Contains(out, []byte("(nf_tables)"))
			if tool.backend == "-legacy" && want {
				t.Fatalf("%s -V = %q: a legacy tool that says nf_tables", tool.binary(""), out)
			}
			got, err := tool.onNFTables(context.Background())
			if err != nil || got != want {
				t.Fatalf("onNFTables = %v, %v; %s -V says %q", got, err, tool.binary(""), out)
			}
		})
	}
}

// An ended context ends a read with its error.
func TestDigestsHonourContext(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				if err := restoreNow(tool, digestPayload(tool.Family)); err != nil {
					return err
				}
				if _, err := digestsNow(tool, TableNAT, nil); err != nil { // the backend is known now
					return err
				}
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				for _, names := range [][]string{nil, {"KUBE-SVC-X"}} {
					if d, err := tool.Digests(ctx, TableNAT, names); !errors.Is(err, context.Canceled) {
						return fmt.Errorf("Digests(%q) with an ended context = %v, %v; want context.Canceled", names, d, err)
					}
				}
				return nil
			})
		})
	}
}

// While another writer switches the table between two rulesets, every answer
// for the whole table is the digests of one of them; an answer by name may take
// each chain from either (each chain is read while nothing changes, not all at
// once), but every chain's digest, or its absence, is that chain's in one of
// them, never a mix of its listing from one and its rules from the other.
func TestDigestsConsistentWhileRulesChange(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			sample := digestPayload(tool.Family)
			// The second ruleset has one chain more, and other rules in KUBE-SVC-X;
			// the first deletes that chain.
			base := strings.Replace(sample, ":KUBE-EMPTY - [0:0]\n", ":KUBE-EMPTY - [0:0]\n:KUBE-EXTRA - [0:0]\n", 1)
			base = strings.Replace(base, "COMMIT\n", "-X KUBE-EXTRA\nCOMMIT\n", 1)
			other := strings.Replace(sample, ":KUBE-EMPTY - [0:0]\n", ":KUBE-EMPTY - [0:0]\n:KUBE-EXTRA - [0:0]\n-A KUBE-EXTRA -j KUBE-SVC-X\n", 1)
			other = strings.ReplaceAll(other, "-A KUBE-SVC-X -m comment --comment \"ns/web:http\" -j KUBE-SEP-2\n", "")
			ns := netnstest.New(t)
			var want [2]map[string]uint64
			ns.Run(t, func() error {
				for i, p := range []string{base, other} {
					if err := restoreNow(tool, p); err != nil {
						return err
					}
					d, err := digestsNow(tool, TableNAT, nil)
					if err != nil {
						return err
					}
					want[i] = d
				}
				return nil
			})
			if maps.Equal(want[0], want[1]) {
				t.Fatal("the two rulesets have the same digests")
			}
			_, stop := keepWriting(t, ns, tool, 0, func(i int) string { return []string{base, other}[i%2] })
			answers, changed := 0, 0
			ns.Run(t, func() error {
				defer stop()
				// Every other read asks for the chains by name (one dump each).
				named := append(slices.Clone(digestChains), "KUBE-EXTRA")
				for i, end := 0, time.Now().Add(time.Second); time.Now().Before(end); i++ {
					var names []string
					if i%2 == 1 {
						names = named
					}
					d, err := tool.Digests(context.Background(), TableNAT, names)
					if errors.Is(err, ErrBusy) {
						changed++
						continue
					}
					if err != nil {
						return err
					}
					answers++
					if names == nil && !maps.Equal(d, want[0]) && !maps.Equal(d, want[1]) {
						return fmt.Errorf("answer %d for the table is neither ruleset: %v; want %v or %v", answers, d, want[0], want[1])
					}
					for _, name := range names {
						got, ok := d[name]
						if !eitherHas(want, name, got, ok) {
							return fmt.Errorf("answer %d (names %q): %s is %x (there: %v), in neither ruleset: %v or %v", answers, names, name, got, ok, want[0], want[1])
						}
					}
				}
				return nil
			})
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			t.Logf("%d answers, %d reads that gave up on a changing ruleset", answers, changed)
			if answers == 0 {
				t.Fatal("no read gave an answer")
			}
		})
	}
}

// eitherHas says whether one of the rulesets' digests has chain as read: with
// digest d when there, or without it when not.
func eitherHas(rulesets [2]map[string]uint64, chain string, d uint64, there bool) bool {
	for _, r := range rulesets {
		if want, ok := r[chain]; ok == there && (!there || want == d) {
			return true
		}
	}
	return false
}

// scalePayload is a nat table of n bucket chains with four rules each, in the
// shape of kpipe's KUBE-SVCS- dispatch.
func scalePayload(n int) []byte {
	var b bytes.Buffer
	b.WriteString("*nat\n:KUBE-SVC-TARGET - [0:0]\n")
	for i := range n {
		fmt.Fprintf(&b, ":KUBE-SVCS-%05d - [0:0]\n", i)
	}
	for i := range n {
		for port := range 4 {
			fmt.Fprintf(&b, "-A KUBE-SVCS-%05d -d 10.%d.%d.%d/32 -p tcp -m comment --comment \"ns%d/svc:p%d cluster IP\" -m tcp --dport %d -j KUBE-SVC-TARGET\n",
				i, 96+i>>16, (i>>8)&0xff, i&0xff, i, port, 80+port)
		}
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}

// BenchmarkDigests reads a nat table of 10,000 chains (40,000 rules): all of it,
// one chain, 4,000 chains by name, and, to compare, iptables-save -t nat.
//
//	go test -run '^$' -bench BenchmarkDigests -benchtime 10x ./netfilter/
func BenchmarkDigests(b *testing.B) {
	const chains = 10000
	tool := Tool{Family: bus.IPv4}
	ns := netnstest.New(b)
	ns.Run(b, func() error {
		start := time.Now()
		err := tool.Restore(context.Background(), scalePayload(chains))
		b.Logf("iptables-restore of %d chains: %v", chains, time.Since(start))
		return err
	})
	b.Run("table", func(b *testing.B) {
		ns.Run(b, func() error {
			for b.Loop() {
				d, err := tool.Digests(context.Background(), TableNAT, nil)
				if err != nil {
					return err
				}
				if len(d) < chains {
					return fmt.Errorf("%d chains; want at least %d", len(d), chains)
				}
			}
			return nil
		})
	})
	b.Run("one-chain", func(b *testing.B) {
		ns.Run(b, func() error {
			for b.Loop() {
				d, err := tool.Digests(context.Background(), TableNAT, []string{"KUBE-SVCS-04711"})
				if err != nil {
					return err
				}
				if len(d) != 1 {
					return fmt.Errorf("one chain asked for, %d answered", len(d))
				}
			}
			return nil
		})
	})
	b.Run("4000-chains", func(b *testing.B) {
		var names []string
		for i := 0; i < chains; i += chains / 4000 {
			names = append(names, fmt.Sprintf("KUBE-SVCS-%05d", i))
		}
		ns.Run(b, func() error {
			for b.Loop() {
				d, err := tool.Digests(context.Background(), TableNAT, names)
				if err != nil {
					return err
				}
				if len(d) != len(names) {
					return fmt.Errorf("%d chains asked for, %d answered", len(names), len(d))
				}
			}
			return nil
		})
	})
	b.Run("iptables-save", func(b *testing.B) {
		ns.Run(b, func() error {
			for b.Loop() {
				if _, err := tool.Save(context.Background(), TableNAT); err != nil {
					return err
				}
			}
			return nil
		})
	})
}

// Only errors that say netlink is closed to this process send Digests to
// iptables-save for good; others (a missing table, a timeout) are answers or
// errors of one read.
func TestNetlinkUnusable(t *testing.T) {
	closed := []error{
		&netlink.OpError{Op: "dial", Err: os.NewSyscallError("socket", syscall.EPROTONOSUPPORT)},
		fmt.Errorf("nf_tables generation: %w", syscall.EPERM),
	}
	for _, err := range closed {
		if !netlinkUnusable(err) {
			t.Errorf("netlinkUnusable(%v) = false; want true", err)
		}
	}
	for _, err := range []error{nil, syscall.ENOENT, os.ErrDeadlineExceeded, context.Canceled, errChanged} {
		if netlinkUnusable(err) {
			t.Errorf("netlinkUnusable(%v) = true; want false", err)
		}
	}
}

// TestChainNames: the user chains of a table, as iptables-save lists them, on every
// backend (over netlink on nf_tables). (iptables-nft's save prints built-in
// chains that nf_tables only creates once a rule needs them.)
func TestChainNames(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool.binary(""), func(t *testing.T) {
			netnstest.New(t).Run(t, func() error {
				if err := restoreNow(tool, digestPayload(tool.Family)); err != nil {
					return err
				}
				got, err := tool.ChainNames(context.Background(), TableNAT)
				if err != nil {
					return err
				}
				want, err := tool.Chains(context.Background(), TableNAT)
				if err != nil {
					return err
				}
				user := func(names []string) []string {
					names = slices.DeleteFunc(slices.Clone(names), func(n string) bool { return !strings.HasPrefix(n, "KUBE-") })
					slices.Sort(names)
					return names
				}
				if !slices.Equal(user(got), user(want)) {
					return fmt.Errorf("ChainNames = %v; iptables-save lists %v", got, want)
				}
				if !slices.Contains(got, "KUBE-EMPTY") {
					return fmt.Errorf("ChainNames = %v; want the empty chain KUBE-EMPTY too", got)
				}
				return nil
			})
		})
	}
}

// Another agent writing to its own table, in the other family, all the time (a
// CNI on every pod start, the other family's commit) bumps the namespace's
// ruleset generation during every long read. Digests still answers, with the
// digests the chains have when nobody writes.
func TestDigestsWhileAnotherTableChanges(t *testing.T) {
	tool := Tool{Family: bus.IPv4}
	if !OnNFTables(bus.IPv4) {
		t.Skip("the generation is nf_tables'")
	}
	ns := netnstest.New(t)
	names := []string{"KUBE-NO-SUCH"}
	var quiet map[string]uint64
	ns.Run(t, func() error {
		if err := restoreNow(tool, string(scalePayload(2000))); err != nil {
			return err
		}
		for i := range 2000 {
			names = append(names, fmt.Sprintf("KUBE-SVCS-%05d", i))
		}
		d, err := digestsNow(tool, TableNAT, names)
		quiet = d
		return err
	})
	if len(quiet) != 2000 {
		t.Fatalf("%d digests of 2000 chains", len(quiet))
	}
	writes, stop := keepWriting(t, ns, Tool{Family: bus.IPv6}, time.Millisecond, func(i int) string {
		return fmt.Sprintf("*filter\n:OTHERCNI-POD - [0:0]\n-A OTHERCNI-POD -s fd00::%x/128 -j ACCEPT\nCOMMIT\n", i%2+1)
	})
	ns.Run(t, func() error {
		defer stop()
		// Read while the other agent writes at least 50 times, at least 3 times.
		for reads := 0; reads < 3 || writes.Load() < 50; reads++ {
			d, err := tool.Digests(context.Background(), TableNAT, names)
			if err != nil {
				return fmt.Errorf("read %d while another table changes: %w", reads+1, err)
			}
			if !maps.Equal(d, quiet) {
				return fmt.Errorf("read %d: %d digests while another table changes, %d of them as when quiet; want all %d", reads+1, len(d), countEqual(d, quiet), len(quiet))
			}
		}
		return nil
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	t.Logf("the other agent wrote %d times", writes.Load())
}

// keepWriting writes payload(i) with tool in ns, for i = 0, 1, … with pause
// between writes, on another goroutine, until stop, which returns the first
// error (stop may be called more than once); writes counts them.
func keepWriting(t *testing.T, ns *netnstest.Namespace, tool Tool, pause time.Duration, payload func(i int) string) (writes *atomic.Int64, stop func() error) {
	done := make(chan struct{})
	writer := make(chan error, 1)
	writes = new(atomic.Int64)
	go ns.Run(t, func() error {
		for i := 0; ; i++ {
			select {
			case <-done:
				writer <- nil
				return nil
			default:
			}
			if err := restoreNow(tool, payload(i)); err != nil {
				writer <- err
				return nil
			}
			writes.Add(1)
			time.Sleep(pause)
		}
	})
	var once sync.Once
	var err error
	return writes, func() error {
		once.Do(func() { close(done); err = <-writer })
		return err
	}
}

// countEqual counts the entries of d that are in want with the same value.
func countEqual(d, want map[string]uint64) int {
	n := 0
	for k, v := range d {
		if w, ok := want[k]; ok && w == v {
			n++
		}
	}
	return n
}
