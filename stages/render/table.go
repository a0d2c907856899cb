package render

import (
	"strings"
)

// table collects the chains of one table in the order they are first written.
type table struct {
	name   string
	order  []string
	chains map[string]*chainText
}

// chainText is one chain's rules.
type chainText struct {
	b      strings.Builder
	count  int
	hash   uint64
	hashed bool
}

// String is the chain's rules.
func (c *chainText) String() string { return c.b.String() }

func newTable(name string) *table {
	return &table{name: name, chains: map[string]*chainText{}}
}

func (t *table) declare(chain string) *chainText {
	c, ok := t.chains[chain]
	if !ok {
		c = &chainText{}
		t.order = append(t.order, chain)
		t.chains[chain] = c
	}
	return c
}

// add appends "-A chain args..." to chain.
func (t *table) add(chain string, args ...string) { t.rule(chain, args) }

// rule appends "-A chain" and every part's words to chain.
func (t *table) rule(chain string, parts ...[]string) {
	c := t.declare(chain)
	c.b.WriteString("-A ")
	c.b.WriteString(chain)
	for _, p := range parts {
		for _, a := range p {
			c.b.WriteByte(' ')
			c.b.WriteString(a)
		}
	}
	c.b.WriteByte('\n')
	c.count++
}

// sum returns the chain's hash (64-bit FNV-1a), computing it once.
func (c *chainText) sum() uint64 {
	if !c.hashed {
		c.hash, c.hashed = fnv64a(c.String()), true
	}
	return c.hash
}

// fnv64a is hash/fnv's New64a over s, without copying s to bytes.
func fnv64a(s string) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= prime
	}
	return h
}

// parts is the table's chains as a cached service keeps them, each chain's
// text copied to exactly its size (a builder leaves room to grow).
func (t *table) parts() []part {
	out := make([]part, 0, len(t.order))
	for _, name := range t.order {
		c := t.chains[name]
		p := part{name: name, rules: strings.Clone(c.String()), count: int32(c.count), rank: rankOf(name)}
		if p.rank.perService() {
			p.hash = c.sum()
		}
		out = append(out, p)
	}
	return out
}
