package e2e

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
	nf "github.com/kpipe/kpipe/netfilter"
)

// tamperLimit is how soon after a tamper kpipe's rules must be whole again;
// tamperWait is how long the test waits for them at all (more than the sync
// period, so that a kpipe that polls shows how long it takes).
const tamperLimit, tamperWait = time.Second, 35 * time.Second

// agentChain is another agent's chain (nat and filter); its rules carry
// agentComment, and a rule of it in PREROUTING (nat) or INPUT (filter) jumps to it.
const (
	agentChain   = "KPE2E-AGENT"
	agentComment = "kpe2e agent"
	// agentFirst is the comment of the rule another agent inserts in front of
	// kpipe's jump in PREROUTING (a jump to its chain, which returns): kpipe
	// leaves it there.
	agentFirst = "kpe2e agent first"
)

// TestTamperRepairedWithinASecond: with the default sync period (30 s) and canary
// interval, whatever another writer does to kpipe's rules — a table flushed, a
// chain deleted, the nat table deleted, a jump deleted, a service chain edited —
// is repaired within a second: the kernel holds kpipe's rules as before and the
// service answers again. Another agent's chains and rules stay as the tamper
// left them. A rule another agent puts in front of kpipe's jump is no tamper:
// it stays in front, as under kube-proxy, and kpipe's jump stays behind it.
// Each case's repair time is printed.
func TestTamperRepairedWithinASecond(t *testing.T) {
	e, svc, addr, client := answeringEcho(t)
	e.restartKpipe("--iptables-sync-period", "30s", "--iptables-min-sync-period", "1s", "--canary-interval", "30s")
	waitAnswer(t, tcp(2*time.Second), client, addr, 20*time.Second)
	t.Cleanup(func() { removeAgent(t) })

	svcChain := ""
	comment := `"` + testbed.ServiceComment(e.ns, svc.Name, "http") + " cluster IP\""
	for _, l := range strings.Split(e.iptablesSave("nat"), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "-A" && nf.KindOf(f[1]) == nf.KindService && strings.Contains(l, comment) {
			svcChain = f[1]
		}
	}
	if svcChain == "" {
		t.Fatalf("no KUBE-SVC- chain for %s", comment)
	}
	ipt := func(args ...string) []string { return append([]string{"iptables", "-w"}, args...) }
	servicePortals := []string{"-m", "comment", "--comment", "kubernetes service portals", "-j", nf.ChainServices}
	cases := []struct {
		name string
		cmds [][]string
		// gone: the tables whose agent rules the tamper removes (flushed: the
		// agent's chain stays) or, in deleted, with the agent's chain.
		flushed, deleted []string
		// first: another agent's rule put in front of kpipe's PREROUTING jump,
		// which must stay there.
		first bool
		// trafficBreaks: the tamper stops the service (else traffic is only checked to work).
		trafficBreaks bool
	}{
		{name: "nat flushed (iptables -t nat -F)", cmds: [][]string{ipt("-t", "nat", "-F")}, flushed: []string{"nat"}, trafficBreaks: true},
		// One transaction: kpipe could repair between two runs, and the chains
		// would be in use again.
		{name: "nat flushed, then kpipe chains deleted (-X)", cmds: [][]string{{"sh", "-c", fmt.Sprintf(
			`printf '*nat\n-F\n-X %s\n-X %s\nCOMMIT\n' | iptables-restore -w --noflush`, svcChain, nf.ChainServices)}},
			flushed: []string{"nat"}, trafficBreaks: true},
		{name: "nat table deleted (nft delete table ip nat)", cmds: [][]string{{"nft", "delete", "table", "ip", "nat"}}, deleted: []string{"nat"},
			trafficBreaks: true},
		{name: "jumps deleted from PREROUTING and OUTPUT", cmds: [][]string{
			ipt(append([]string{"-t", "nat", "-D", "PREROUTING"}, servicePortals...)...),
			ipt(append([]string{"-t", "nat", "-D", "OUTPUT"}, servicePortals...)...)}, trafficBreaks: true},
		{name: "a rule inserted in front of kpipe's PREROUTING jump", cmds: [][]string{
			ipt("-t", "nat", "-I", "PREROUTING", "1", "-p", "tcp", "-m", "comment", "--comment", agentFirst, "-j", agentChain)},
			first: true},
		{name: "a KUBE-SVC chain edited (a rule replaced)", cmds: [][]string{ipt("-t", "nat", "-R", svcChain, "1", "-j", "RETURN")},
			trafficBreaks: true},
		{name: "filter and mangle flushed", cmds: [][]string{ipt("-t", "filter", "-F"), ipt("-t", "mangle", "-F")}, flushed: []string{"filter"}},
	}
	var report []string
	for _, c := range cases {
		e.addAgent()
		before := e.kpipeRules()
		agentBefore := map[string][]string{"nat": e.agentRules("nat"), "filter": e.agentRules("filter")}
		want := map[string][]string{}
		for table, rules := range agentBefore {
			switch {
			case slices.Contains(c.deleted, table):
				want[table] = nil
			case slices.Contains(c.flushed, table):
				want[table] = []string{":" + agentChain}
			default:
				want[table] = rules
			}
		}
		// kpipeBack is what is timed; repaired adds the other agent's rules.
		kpipeBack := func() error {
			if d := testbed.Diff(before, e.kpipeRules(), "before", "now"); d != "" {
				return fmt.Errorf("kpipe's rules are not what they were:\n%s", d)
			}
			if c.first {
				return agentRuleKeptFirst(t)
			}
			return nil
		}
		repaired := func() error {
			if err := kpipeBack(); err != nil {
				return err
			}
			for table, rules := range want {
				if got := e.agentRules(table); !slices.Equal(got, rules) {
					return fmt.Errorf("the other agent's %s rules are %q; want %q", table, got, rules)
				}
			}
			return nil
		}

		start := time.Now()
		for _, cmd := range c.cmds {
			if out, err := tb.Exec(tb.NodeNS, cmd...); err != nil {
				t.Fatalf("%s: %q: %v %s", c.name, cmd, err, out)
			}
		}
		traffic := make(chan time.Duration, 1)
		var wg sync.WaitGroup
		wg.Go(func() {
			for time.Since(start) < tamperWait {
				if _, err := tb.DialTCP(client, addr, 100*time.Millisecond); err == nil {
					traffic <- time.Since(start)
					return
				}
			}
			traffic <- -1
		})
		for err := kpipeBack(); err != nil; err = kpipeBack() {
			if time.Since(start) > tamperWait {
				t.Fatalf("%s: not repaired %v after the tamper: %v", c.name, tamperWait, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		took := time.Since(start)
		wg.Wait()
		answered := <-traffic
		line := fmt.Sprintf("%-52s rules repaired %6v after the tamper; service answers %v after", c.name, took.Round(time.Millisecond), answered.Round(time.Millisecond))
		if !c.trafficBreaks {
			line = fmt.Sprintf("%-52s rules repaired %6v after the tamper; service answered throughout (%v)", c.name, took.Round(time.Millisecond), answered.Round(time.Millisecond))
		}
		t.Log(line)
		report = append(report, line)
		if took > tamperLimit {
			t.Errorf("%s: rules repaired %v after the tamper; want at most %v", c.name, took, tamperLimit)
		}
		if answered < 0 || answered > tamperLimit {
			t.Errorf("%s: the service answered %v after the tamper (-1: not within tamperWait); want at most %v", c.name, answered, tamperLimit)
		}
		// Repaired for good: no rewrite of the agent's rules, no flapping.
		for range 10 {
			time.Sleep(100 * time.Millisecond)
			if err := repaired(); err != nil {
				t.Fatalf("%s: after the repair: %v", c.name, err)
			}
		}
		if c.first {
			if out, err := tb.Exec(tb.NodeNS, ipt("-t", "nat", "-D", "PREROUTING", "-p", "tcp", "-m", "comment", "--comment", agentFirst, "-j", agentChain)...); err != nil {
				t.Fatalf("remove the rule in front: %v %s", err, out)
			}
		}
	}
	fmt.Printf("tamper → repaired (limit %v):\n  %s\n", tamperLimit, strings.Join(report, "\n  "))
}

// kpipeRules are kpipe's IPv4 nat and filter rules now. Its jumps in a built-in
// chain are sorted: their order among themselves depends on which went missing
// when (each missing one is put back first, as kube-proxy does); where other
// agents' rules are among them is checked apart (agentRuleKeptFirst).
func (e *env) kpipeRules() testbed.RuleDump {
	e.t.Helper()
	var d testbed.RuleDump
	for _, table := range []string{"nat", "filter"} {
		if err := d.NormalizeSave("ipv4", e.iptablesSave(table)); err != nil {
			e.t.Fatal(err)
		}
	}
	for key, rules := range d.Chains {
		if chain := strings.Fields(key)[2]; nf.KindOf(chain) == nf.KindOther {
			slices.Sort(rules)
		}
	}
	return d
}

// agentRules are the other agent's lines in table: its chain (":KPE2E-AGENT")
// and its rules, in order.
func (e *env) agentRules(table string) []string {
	e.t.Helper()
	var lines []string
	for _, l := range strings.Split(e.iptablesSave(table), "\n") {
		if strings.HasPrefix(l, ":"+agentChain+" ") {
			lines = append(lines, ":"+agentChain)
		} else if strings.Contains(l, `"`+agentComment+`"`) {
			lines = append(lines, l)
		}
	}
	return lines
}

// agentRuleKeptFirst says whether the rule another agent put in front of kpipe's
// jump in PREROUTING is still first, with kpipe's jump right behind it.
func agentRuleKeptFirst(t *testing.T) error {
	rules, err := chainRules("nat", "PREROUTING")
	if err != nil {
		return err
	}
	if len(rules) < 2 || !strings.Contains(rules[0], agentFirst) || !strings.HasSuffix(rules[1], "-j "+nf.ChainServices) {
		return fmt.Errorf("PREROUTING is %q; want the other agent's rule first, then kpipe's jump", rules)
	}
	return nil
}

// addAgent puts the other agent's chains and rules in place (nat and filter),
// as far as they are missing.
func (e *env) addAgent() {
	e.t.Helper()
	for table, from := range map[string]string{"nat": "PREROUTING", "filter": "INPUT"} {
		rules := e.agentRules(table)
		cmds := [][]string{}
		if !slices.Contains(rules, ":"+agentChain) {
			cmds = append(cmds, []string{"-N", agentChain})
		}
		own := "-A " + agentChain + ` -m comment --comment "` + agentComment + `" -j RETURN`
		if !slices.Contains(rules, own) {
			cmds = append(cmds, []string{"-A", agentChain, "-m", "comment", "--comment", agentComment, "-j", "RETURN"})
		}
		jump := "-A " + from + ` -m comment --comment "` + agentComment + `" -j ` + agentChain
		if !slices.Contains(rules, jump) {
			cmds = append(cmds, []string{"-A", from, "-m", "comment", "--comment", agentComment, "-j", agentChain})
		}
		for _, c := range cmds {
			if out, err := tb.Exec(tb.NodeNS, append([]string{"iptables", "-w", "-t", table}, c...)...); err != nil {
				e.t.Fatalf("add the other agent's rules: %v %s", err, out)
			}
		}
	}
}

// removeAgent deletes the other agent's chains and rules.
func removeAgent(t *testing.T) {
	for table, from := range map[string]string{"nat": "PREROUTING", "filter": "INPUT"} {
		for _, c := range [][]string{
			{"-D", from, "-m", "comment", "--comment", agentComment, "-j", agentChain},
			{"-F", agentChain}, {"-X", agentChain},
		} {
			_, _ = tb.Exec(tb.NodeNS, append([]string{"iptables", "-w", "-t", table}, c...)...)
		}
	}
}
