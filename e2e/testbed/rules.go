package testbed

import (
	"fmt"
	"slices"
	"strings"
)

// RuleDump is kpipe's part of a namespace's nat and filter tables, both
// families, normalized so that two namespaces programmed for the same API
// state compare equal (see NormalizeSave).
type RuleDump struct {
	// Chains maps "ipv4 nat KUBE-SERVICES" (family, table, chain) to the
	// chain's rules in order ("-A ..." lines, counters dropped). A KUBE- chain
	// with no rules is present with an empty list: its existence matters.
	Chains map[string][]string
}

// canaryChain is kpipe's flush detector: it exists in every table kpipe
// writes and holds nothing a packet ever hits.
const canaryChain = "KUBE-PROXY-CANARY"

// NormalizeSave adds the output of `iptables-save -t <table>` (or
// ip6tables-save) of one family ("ipv4", "ipv6") to d, keeping what kpipe
// owns: the KUBE- chains (declared, even when empty) with their rules in
// order, and of every other chain only the rules that jump into a KUBE- chain.
// Counters, comments of iptables-save itself and the canary chain are dropped.
func (d *RuleDump) NormalizeSave(family, save string) error {
	if d.Chains == nil {
		d.Chains = map[string][]string{}
	}
	table := ""
	for _, line := range strings.Split(save, "\n") {
		line = dropCounters(strings.TrimSpace(line))
		switch {
		case line == "", strings.HasPrefix(line, "#"), line == "COMMIT":
		case strings.HasPrefix(line, "*"):
			table = line[1:]
		case strings.HasPrefix(line, ":"):
			chain, _, _ := strings.Cut(line[1:], " ")
			if isKpipeChain(chain) {
				key := family + " " + table + " " + chain
				if _, ok := d.Chains[key]; !ok {
					d.Chains[key] = []string{}
				}
			}
		case strings.HasPrefix(line, "-A "):
			chain, _, _ := strings.Cut(line[3:], " ")
			if !isKpipeChain(chain) && !jumpsIntoKpipeChain(line) {
				continue
			}
			key := family + " " + table + " " + chain
			d.Chains[key] = append(d.Chains[key], line)
		default:
			return fmt.Errorf("unexpected iptables-save line %q", line)
		}
	}
	return nil
}

func isKpipeChain(chain string) bool {
	return strings.HasPrefix(chain, "KUBE-") && chain != canaryChain
}

func jumpsIntoKpipeChain(rule string) bool {
	f := strings.Fields(rule)
	for i := 0; i+1 < len(f); i++ {
		if (f[i] == "-j" || f[i] == "-g") && isKpipeChain(f[i+1]) {
			return true
		}
	}
	return false
}

// dropCounters removes the "[packets:bytes] " that iptables-save -c puts
// before a rule.
func dropCounters(line string) string {
	if strings.HasPrefix(line, "[") {
		if _, rest, ok := strings.Cut(line, "] "); ok {
			return rest
		}
	}
	return line
}

// Rules counts the rules of the dump.
func (d RuleDump) Rules() int {
	n := 0
	for _, r := range d.Chains {
		n += len(r)
	}
	return n
}

// Diff describes how got differs from want, chain by chain in sorted order:
// chains only in one of them, and for chains in both a line diff of their
// rules ("-" wanted but missing, "+" present but not wanted). It is "" when
// they are equal.
func Diff(want, got RuleDump, wantName, gotName string) string {
	var b strings.Builder
	keys := map[string]bool{}
	for k := range want.Chains {
		keys[k] = true
	}
	for k := range got.Chains {
		keys[k] = true
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	slices.Sort(sorted)
	for _, k := range sorted {
		w, inWant := want.Chains[k]
		g, inGot := got.Chains[k]
		switch {
		case !inGot:
			fmt.Fprintf(&b, "chain %s: only in %s (%d rules)\n", k, wantName, len(w))
			writePrefixed(&b, "  - ", w)
		case !inWant:
			fmt.Fprintf(&b, "chain %s: only in %s (%d rules)\n", k, gotName, len(g))
			writePrefixed(&b, "  + ", g)
		case !slices.Equal(w, g):
			fmt.Fprintf(&b, "chain %s: rules differ (- only in %s, + only in %s)\n", k, wantName, gotName)
			b.WriteString(lineDiff(w, g))
		}
	}
	return b.String()
}

func writePrefixed(b *strings.Builder, prefix string, lines []string) {
	for _, l := range lines {
		b.WriteString(prefix + l + "\n")
	}
}

// lineDiff is a diff of two rule lists (longest common subsequence), showing
// only the changed lines.
func lineDiff(a, b []string) string {
	// lcs[i][j] is the LCS length of a[i:] and b[j:].
	lcs := make([][]int, len(a)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(b)+1)
	}
	for i := len(a) - 1; i >= 0; i-- {
		for j := len(b) - 1; j >= 0; j-- {
			if a[i] == b[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	var out strings.Builder
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case i < len(a) && j < len(b) && a[i] == b[j]:
			i, j = i+1, j+1
		case j < len(b) && (i == len(a) || lcs[i][j+1] >= lcs[i+1][j]):
			fmt.Fprintf(&out, "  + [%d] %s\n", j+1, b[j])
			j++
		default:
			fmt.Fprintf(&out, "  - [%d] %s\n", i+1, a[i])
			i++
		}
	}
	return out.String()
}
