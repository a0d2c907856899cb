package main

import (
	"fmt"
	"io"
	"slices"

	nf "github.com/kpipe/kpipe/netfilter"
)

// chainDiff is how one chain the node holds differs from its rendering: its
// rules only the node has ("-") and only the rendering has ("+").
type chainDiff struct {
	table, chain string
	lines        []string // "-rule" and "+rule", in the chain's order
}

// diffRuleset compares what a sync with rendered would change in live, chain
// by chain: kpipe's chains (what render writes, and the per-service and
// dispatch chains a full sync deletes when the rendering lacks them), and the
// jumps kpipe ensures in the built-in chains (missing ones). Other agents'
// chains and rules are not compared, nor what kpipe leaves in place: its
// top-level chains and jumps the rendering lacks (a flag changed since they
// were written), or where its jumps stand among other agents' rules.
func diffRuleset(live, rendered nf.Ruleset) []chainDiff {
	var out []chainDiff
	add := func(table, chain string, lines []string) {
		if len(lines) > 0 {
			out = append(out, chainDiff{table, chain, lines})
		}
	}
	for _, want := range rendered.Tables {
		have := live.Table(want.Name)
		if have == nil {
			have = &nf.SavedTable{}
		}
		haveByName, wantByName := have.ByName(), want.ByName()
		for _, c := range want.Chains {
			if isBuiltin(c.Policy) {
				add(want.Name, c.Name, missingJumps(haveByName[c.Name], c.Rules))
			} else {
				add(want.Name, c.Name, diffChain(haveByName[c.Name], &c))
			}
		}
		for _, c := range have.Chains {
			if wantByName[c.Name] == nil && nf.KindOf(c.Name).Disposable() {
				add(want.Name, c.Name, diffChain(&c, nil))
			}
		}
	}
	return out
}

// diffChain compares one of kpipe's chains (nil: that side lacks it). A chain
// only one side has starts with its declaration (":NAME -"), so that an
// empty one shows too.
func diffChain(live, rendered *nf.SavedChain) []string {
	var declared []string
	switch {
	case live == nil:
		declared = []string{"+:" + rendered.Name + " -"}
	case rendered == nil:
		declared = []string{"-:" + live.Name + " -"}
	}
	return append(declared, diffRules(rulesOf(live), rulesOf(rendered))...)
}

// isBuiltin says whether a chain of that policy is a built-in one (a user
// chain's policy is "-").
func isBuiltin(policy string) bool { return policy != "-" }

func rulesOf(c *nf.SavedChain) []string {
	if c == nil {
		return nil
	}
	return c.Rules
}

// missingJumps are the jumps ("+") that a built-in chain lacks: kpipe inserts
// those and leaves a present one where it is (EnsureJumps).
func missingJumps(live *nf.SavedChain, jumps []string) []string {
	var lines []string
	for _, j := range jumps {
		if !slices.ContainsFunc(rulesOf(live), func(l string) bool { return sameRule(l, j) }) {
			lines = append(lines, "+"+j)
		}
	}
	return lines
}

// diffRules is a line diff of a chain's rules (in order: rules are tried in
// order), equal rules (sameRule) kept out.
func diffRules(live, rendered []string) []string {
	keys := func(rules []string) []string {
		out := make([]string, len(rules))
		for i, r := range rules {
			out[i] = ruleKey(r)
		}
		return out
	}
	a, b := keys(live), keys(rendered)
	var lines []string
	for _, op := range lcsDiff(a, b) {
		if op.del {
			lines = append(lines, "-"+live[op.i])
		} else {
			lines = append(lines, "+"+rendered[op.i])
		}
	}
	return lines
}

// sameRule says whether two rule lines are the same rule.
func sameRule(a, b string) bool { return ruleKey(a) == ruleKey(b) }

// ruleKey is what two lines of the same rule share: the rule as
// netfilter.ParseRule reads it (so "-d 10.0.0.1" and "-d 10.0.0.1/32", a
// quoted or bare comment, an implicit or explicit "-m tcp", REJECT's default
// named or not are alike), or the
// line itself when kpipe's parser does not read it (another agent's rule).
func ruleKey(line string) string {
	r, err := nf.ParseRule(line)
	if err != nil {
		return line
	}
	for i := range r.Matches {
		r.Matches[i].Implicit = false
	}
	if defaultRejects[r.Target.RejectWith] { // iptables-save names the default
		r.Target.RejectWith = ""
	}
	return fmt.Sprintf("%+v", r)
}

// defaultRejects are REJECT's defaults (IPv4's, IPv6's), which render leaves
// out and iptables-save prints.
var defaultRejects = map[string]bool{"icmp-port-unreachable": true, "icmp6-port-unreachable": true}

// edit is one line of a diff: a deletion of a[i] or an insertion of b[i].
type edit struct {
	del bool
	i   int
}

// lcsDiff is the shortest edit script from a to b (by their longest common
// subsequence), deletions before insertions where both fall at one place.
// The common head and tail are cut first: a changed chain differs in a few
// rules.
func lcsDiff(a, b []string) []edit {
	head := 0
	for head < len(a) && head < len(b) && a[head] == b[head] {
		head++
	}
	tail := 0
	for tail < len(a)-head && tail < len(b)-head && a[len(a)-1-tail] == b[len(b)-1-tail] {
		tail++
	}
	a, b = a[head:len(a)-tail], b[head:len(b)-tail]
	if len(a)*len(b) > maxLCSCells {
		return replaceAll(head, len(a), len(b))
	}
	// common[i][j]: the length of the longest common subsequence of a[i:] and b[j:].
	common := make([][]int, len(a)+1)
	for i := range common {
		common[i] = make([]int, len(b)+1)
	}
	for i := len(a) - 1; i >= 0; i-- {
		for j := len(b) - 1; j >= 0; j-- {
			if a[i] == b[j] {
				common[i][j] = common[i+1][j+1] + 1
			} else {
				common[i][j] = max(common[i+1][j], common[i][j+1])
			}
		}
	}
	var out []edit
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case i < len(a) && j < len(b) && a[i] == b[j]:
			i, j = i+1, j+1
		case j == len(b) || i < len(a) && common[i+1][j] >= common[i][j+1]:
			out = append(out, edit{del: true, i: head + i})
			i++
		default:
			out = append(out, edit{i: head + j})
			j++
		}
	}
	return out
}

// maxLCSCells bounds lcsDiff's table (32 MiB): chains that differ more are
// shown as all their rules out and all in.
const maxLCSCells = 1 << 22

// replaceAll is the edit script that deletes n rules at head and inserts m.
func replaceAll(head, n, m int) []edit {
	var out []edit
	for i := range n {
		out = append(out, edit{del: true, i: head + i})
	}
	for j := range m {
		out = append(out, edit{i: head + j})
	}
	return out
}

// writeDiff prints diffs as a unified diff by chain: "--- live" and
// "+++ rendered" naming the family, then per chain "@@ table chain @@" and its
// lines (a chain only one side has: its declaration and all its rules).
func writeDiff(w io.Writer, family string, diffs []chainDiff) error {
	if len(diffs) == 0 {
		return nil
	}
	if _, err := fmt.Fprintf(w, "--- live %s\n+++ rendered %s\n", family, family); err != nil {
		return err
	}
	for _, d := range diffs {
		if _, err := fmt.Fprintf(w, "@@ %s %s @@\n", d.table, d.chain); err != nil {
			return err
		}
		for _, l := range d.lines {
			if _, err := fmt.Fprintln(w, l); err != nil {
				return err
			}
		}
	}
	return nil
}
