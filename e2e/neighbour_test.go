package e2e

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// hookAgent is another agent on the node that insists on being first, as
// Calico's iptables dataplane does with its hooks: every interval it looks at
// the built-in chains kpipe jumps from and, where its own jump is not the
// first rule, moves it there (one iptables-restore per table). It runs
// iptables as xtables-nft-multi, so `nft monitor` names its transactions
// apart from kpipe's.
type hookAgent struct {
	t        *testing.T
	interval time.Duration
	// kpipeJumps are kpipe's jumps in each chain before the agent began.
	kpipeJumps map[hookChain][]string
	stop, done chan struct{}

	mu       sync.Mutex
	cycles   int
	moves    int      // cycles in which the agent had to move its rule back in front
	problems []string // kpipe's jumps missing, at a look
}

type hookChain struct{ table, chain string }

// hookChains are the built-in chains kube-proxy (and kpipe) jump from.
var hookChains = []hookChain{{"nat", "PREROUTING"}, {"nat", "OUTPUT"}, {"nat", "POSTROUTING"},
	{"filter", "INPUT"}, {"filter", "FORWARD"}, {"filter", "OUTPUT"}}

const (
	hookAgentChain   = "KPE2E-HOOK"
	hookAgentComment = "kpe2e hook agent"
	// hookAgentProcess is how nft monitor names the agent's writes (the
	// kernel's 15-character comm of xtables-nft-multi).
	hookAgentProcess = "(xtables-nft-mul)"
)

func (c hookChain) agentRule() string {
	return "-A " + c.chain + ` -m comment --comment "` + hookAgentComment + `" -j ` + hookAgentChain
}

// chainRules is `iptables -S chain` in the node namespace, its rules only.
func chainRules(table, chain string) ([]string, error) {
	out, err := tb.Exec(tb.NodeNS, "iptables", "-w", "-t", table, "-S", chain)
	if err != nil {
		return nil, fmt.Errorf("iptables -t %s -S %s: %w %s", table, chain, err, out)
	}
	var rules []string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "-A ") {
			rules = append(rules, l)
		}
	}
	return rules, nil
}

// listChain is chainRules, failing the test on an error (the test's goroutine only).
func listChain(t *testing.T, table, chain string) []string {
	t.Helper()
	rules, err := chainRules(table, chain)
	if err != nil {
		t.Fatal(err)
	}
	return rules
}

// startHookAgent makes the agent's chains (each a RETURN: it lets everything
// through, so traffic is kpipe's to answer) and starts its loop.
func startHookAgent(t *testing.T, interval time.Duration) *hookAgent {
	a := &hookAgent{t: t, interval: interval, kpipeJumps: map[hookChain][]string{}, stop: make(chan struct{}), done: make(chan struct{})}
	for _, c := range hookChains {
		for _, r := range listChain(t, c.table, c.chain) {
			if strings.Contains(r, " -j KUBE-") {
				a.kpipeJumps[c] = append(a.kpipeJumps[c], r)
			}
		}
		if len(a.kpipeJumps[c]) == 0 {
			t.Fatalf("no kpipe jump in %s %s before the agent starts", c.table, c.chain)
		}
	}
	for _, table := range []string{"nat", "filter"} {
		a.restore(table, fmt.Sprintf(":%s - [0:0]\n-A %s -j RETURN\n", hookAgentChain, hookAgentChain))
	}
	go a.run()
	t.Cleanup(a.remove)
	return a
}

func (a *hookAgent) restore(table, lines string) {
	script := fmt.Sprintf("printf '%%s' '*%s\n%sCOMMIT\n' | xtables-nft-multi iptables-restore -w 5 --noflush", table, lines)
	if out, err := tb.Exec(tb.NodeNS, "sh", "-c", script); err != nil {
		a.t.Errorf("hook agent: %v %s", err, out)
	}
}

func (a *hookAgent) run() {
	defer close(a.done)
	for {
		a.cycle()
		select {
		case <-a.stop:
			return
		case <-time.After(a.interval):
		}
	}
}

// cycle looks at each chain, notes any of kpipe's jumps missing, and puts the
// agent's rule first where it is not.
func (a *hookAgent) cycle() {
	fix := map[string]string{}
	var problems []string
	for _, c := range hookChains {
		rules, err := chainRules(c.table, c.chain)
		if err != nil {
			a.t.Errorf("hook agent: %v", err) // not Fatal: the agent's goroutine is not the test's
			continue
		}
		for _, j := range a.kpipeJumps[c] {
			if !slices.Contains(rules, j) {
				problems = append(problems, fmt.Sprintf("%s: %s %s lacks kpipe's %q", time.Now().Format("15:04:05.000"), c.table, c.chain, j))
			}
		}
		if len(rules) > 0 && rules[0] == c.agentRule() {
			continue
		}
		rule := strings.TrimPrefix(c.agentRule(), "-A "+c.chain)
		if slices.Contains(rules, c.agentRule()) {
			fix[c.table] += "-D " + c.chain + rule + "\n"
		}
		fix[c.table] += "-I " + c.chain + " 1" + rule + "\n"
	}
	for table, lines := range fix {
		a.restore(table, lines)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.cycles++
	if len(fix) > 0 {
		a.moves++
	}
	a.problems = append(a.problems, problems...)
}

// finish stops the loop; it returns the cycles, how many of them had to move
// the agent's rule back in front, and kpipe's jumps seen missing.
func (a *hookAgent) finish() (cycles, moves int, problems []string) {
	select {
	case <-a.stop:
	default:
		close(a.stop)
	}
	<-a.done
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.cycles, a.moves, a.problems
}

// remove stops the agent and deletes its rules and chains.
func (a *hookAgent) remove() {
	a.finish()
	for _, c := range hookChains {
		_, _ = tb.Exec(tb.NodeNS, "iptables", "-w", "-t", c.table, "-D", c.chain, "-m", "comment", "--comment", hookAgentComment, "-j", hookAgentChain)
	}
	for _, table := range []string{"nat", "filter"} {
		_, _ = tb.Exec(tb.NodeNS, "iptables", "-w", "-t", table, "-F", hookAgentChain)
		_, _ = tb.Exec(tb.NodeNS, "iptables", "-w", "-t", table, "-X", hookAgentChain)
	}
}

// kpipeTransactions are the monitor's transaction lines not made by the hook
// agent: kpipe's own (its netlink writer, or iptables tools it runs).
func kpipeTransactions(w testbed.Writes) []string {
	var out []string
	for _, l := range w.TransactionLines {
		if !strings.HasSuffix(l, hookAgentProcess) {
			out = append(out, l)
		}
	}
	return out
}

// TestAnotherAgentKeepsItsHookFirst: another agent keeps its own jump first in
// nat PREROUTING, OUTPUT, POSTROUTING and filter INPUT, FORWARD, OUTPUT,
// re-asserting every 500 ms for 60 s, while clients connect through a
// ClusterIP and a NodePort. kpipe leaves it there, as kube-proxy does (it
// only puts back a jump of its own that is missing): after the first seconds
// kpipe writes nothing, the agent never has to move its rule back, kpipe's
// jumps stay in every chain and no connection fails. Then kpipe's PREROUTING
// jump deleted by hand is back within a second, behind the agent's.
func TestAnotherAgentKeepsItsHookFirst(t *testing.T) {
	e := setup(t)
	svc := e.echoNodePort("hooked")
	tr := newTraffic(t, 10*time.Millisecond, podIPs(1, 2), nodePortTargets(svc)...)
	tr.start(podIPs(1, 2))
	mon, err := tb.MonitorRuleset()
	if err != nil {
		t.Fatal(err)
	}
	defer mon.Stop()

	const interval, settle, run = 500 * time.Millisecond, 5 * time.Second, 60 * time.Second
	a := startHookAgent(t, interval)
	time.Sleep(settle)
	movesSettling := a.movesSoFar()
	early := kpipeTransactions(mon.Writes())
	time.Sleep(run - settle)
	later := kpipeTransactions(mon.Writes())[len(early):]
	cycles, moves, missing := a.finish()
	tr.endPhase("another agent keeps its hook first")
	t.Logf("over %v: the agent looked %d times and moved its rule back in front in %d (%d in the first %v); kpipe wrote %d transactions in the first %v and %d after",
		run, cycles, moves, movesSettling, settle, len(early), settle, len(later))
	if len(later) > 0 {
		t.Errorf("kpipe wrote %d transactions after the first %v, fighting the other agent:\n%s", len(later), settle, strings.Join(later, "\n"))
	}
	if moves > 1 {
		t.Errorf("the agent had to put its rule back in front %d times (once is its first insert): kpipe moved its jumps in front of it", moves)
	}
	if len(missing) > 0 {
		t.Errorf("kpipe's jumps missing while the agent ran:\n%s", strings.Join(missing, "\n"))
	}
	for _, c := range hookChains {
		if rules := listChain(t, c.table, c.chain); len(rules) == 0 || rules[0] != c.agentRule() {
			t.Errorf("%s %s is %q; want the agent's rule first", c.table, c.chain, rules)
		}
	}

	// A jump of kpipe's deleted by hand comes back, and only it is written.
	pre := hookChains[0]
	jump := a.kpipeJumps[pre][0]
	deleted := time.Now()
	at := slices.Index(listChain(t, pre.table, pre.chain), jump) + 1 // iptables numbers rules from 1
	if out, err := tb.Exec(tb.NodeNS, "iptables", "-w", "-t", pre.table, "-D", pre.chain, strconv.Itoa(at)); at == 0 || err != nil {
		t.Fatalf("delete %q: %v %s", jump, err, out)
	}
	testbed.Eventually(t, 5*time.Second, func() error {
		if rules := listChain(t, pre.table, pre.chain); !slices.Contains(rules, jump) {
			return fmt.Errorf("%s %s is %q, without kpipe's %q", pre.table, pre.chain, rules, jump)
		}
		return nil
	})
	back := time.Since(deleted)
	t.Logf("kpipe's jump %q deleted by hand: back after %v", jump, back.Round(time.Millisecond))
	if back > time.Second {
		t.Errorf("kpipe's jump back %v after it was deleted; want at most 1s", back.Round(time.Millisecond))
	}
	// Requests that began before the jump was back may fail: the test broke
	// the node's rules itself (a ClusterIP SYN then made a conntrack entry
	// without DNAT, which its retries follow until the dial times out); any
	// that began later fails the test. Wait out those dials first, so that
	// they are counted in this phase.
	time.Sleep(2*time.Second + 500*time.Millisecond) // the loops dial with a 2 s timeout (tcp2, udp2)
	tr.endPhaseTolerating("kpipe's jump deleted by hand and put back", deleted.Add(back))
	tr.finish()
}

// movesSoFar is how many of the agent's looks so far moved its rule back in front.
func (a *hookAgent) movesSoFar() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.moves
}
