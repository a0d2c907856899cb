package nftables

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// TableName is the table kube-proxy's nftables mode owns, one per family.
const TableName = nf.NFTablesTable

// Table is the whole table of one family: its chains and its sets and maps, each
// in the order a fresh node creates them.
type Table struct {
	Family  bus.Family
	Comment string
	Chains  []*Chain
	Sets    []*Set // sets and maps
}

// Chain is a chain and its rules. A base chain has a Type, Hook and Priority.
type Chain struct {
	Name     string
	Type     string // "filter", "nat"; "" for a regular chain
	Hook     string
	Priority int // as kube-proxy writes it: a number
	Comment  string
	Rules    []Rule
}

// Base says the chain is attached to a hook.
func (c *Chain) Base() bool { return c.Hook != "" }

// Rule is one rule, its text as kube-proxy writes it (before nft normalises it).
type Rule struct {
	Chain   string
	Text    string
	Comment string
}

// Set is a set or, with Map, a verdict map.
type Set struct {
	Name     string
	Map      bool
	Type     string // "ipv4_addr", "ipv4_addr . inet_proto . inet_service : verdict"
	Flags    []string
	Timeout  time.Duration
	Comment  string
	Elements []Element
}

// Element is one element of a set or map.
type Element struct {
	Key     []string
	Value   string // a verdict map's verdict ("goto CHAIN", "drop"); "" in a set
	Comment string
}

// Chain returns the named chain, nil if there is none.
func (t *Table) Chain(name string) *Chain {
	i := slices.IndexFunc(t.Chains, func(c *Chain) bool { return c.Name == name })
	if i < 0 {
		return nil
	}
	return t.Chains[i]
}

// Set returns the named set or map, nil if there is none.
func (t *Table) Set(name string) *Set {
	i := slices.IndexFunc(t.Sets, func(s *Set) bool { return s.Name == name })
	if i < 0 {
		return nil
	}
	return t.Sets[i]
}

// Dump prints the table as `add` commands in the form of knftables' Fake.Dump,
// sorted as kube-proxy's tests sort a dump before comparing it
// (helpers_test.go sortNFTablesTransaction): by object kind (table, chains,
// rules, sets, maps, elements), then by object name; a chain's rules keep
// their order, other lines of one object sort as text. So Dump equals
// upstream's expected output for the same objects, byte for byte.
func (t *Table) Dump() string {
	var lines []dumpLine
	add := func(kind, name, text string) {
		lines = append(lines, dumpLine{kindOrder[kind], name, kind == "rule", text})
	}
	prefix := func(kind, name string) string {
		return fmt.Sprintf("add %s %s %s %s", kind, nf.NFTFamily(t.Family), TableName, name)
	}
	table := fmt.Sprintf("add table %s %s", nf.NFTFamily(t.Family), TableName)
	if t.Comment != "" {
		table += fmt.Sprintf(" { comment %q ; }", t.Comment)
	}
	add("table", "", table)
	for _, c := range t.Chains {
		add("chain", c.Name, prefix("chain", c.Name)+c.properties())
		for _, r := range c.Rules {
			add("rule", c.Name, prefix("rule", c.Name)+" "+r.text())
		}
	}
	for _, s := range t.Sets {
		kind := s.kind()
		add(kind, s.Name, prefix(kind, s.Name)+s.properties())
		for _, e := range s.Elements {
			add("element", s.Name, prefix("element", s.Name)+" "+e.text())
		}
	}
	slices.SortStableFunc(lines, compareDumpLines)
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(l.text)
		b.WriteByte('\n')
	}
	return b.String()
}

// kindOrder ranks the kinds of lines in a sorted dump, first first.
var kindOrder = map[string]int{"table": 0, "chain": 1, "rule": 2, "set": 3, "map": 4, "element": 5}

type dumpLine struct {
	kind int
	name string
	rule bool
	text string
}

func compareDumpLines(a, b dumpLine) int {
	if c := cmp.Compare(a.kind, b.kind); c != 0 {
		return c
	}
	if c := cmp.Compare(a.name, b.name); c != 0 {
		return c
	}
	if a.rule {
		return 0 // a chain's rules stay in order
	}
	return cmp.Compare(a.text, b.text)
}

func (c *Chain) properties() string {
	var p []string
	if c.Base() {
		p = append(p, fmt.Sprintf("type %s hook %s priority %d ;", c.Type, c.Hook, c.Priority))
	}
	if c.Comment != "" {
		p = append(p, fmt.Sprintf("comment %q ;", c.Comment))
	}
	if len(p) == 0 {
		return ""
	}
	return " { " + strings.Join(p, " ") + " }"
}

func (r Rule) text() string {
	if r.Comment == "" {
		return r.Text
	}
	return fmt.Sprintf("%s comment %q", r.Text, r.Comment)
}

func (s *Set) kind() string {
	if s.Map {
		return "map"
	}
	return "set"
}

func (s *Set) properties() string {
	p := []string{fmt.Sprintf("type %s ;", s.Type)}
	if len(s.Flags) > 0 {
		p = append(p, fmt.Sprintf("flags %s ;", strings.Join(s.Flags, ",")))
	}
	if s.Timeout > 0 {
		p = append(p, fmt.Sprintf("timeout %ds ;", int64(s.Timeout.Seconds())))
	}
	if s.Comment != "" {
		p = append(p, fmt.Sprintf("comment %q ;", s.Comment))
	}
	return " { " + strings.Join(p, " ") + " }"
}

func (e Element) text() string {
	t := "{ " + strings.Join(e.Key, " . ")
	if e.Comment != "" {
		t += fmt.Sprintf(" comment %q", e.Comment)
	}
	if e.Value != "" {
		t += " : " + e.Value
	}
	return t + " }"
}
