package render

import (
	"hash/fnv"
	"strings"

	nf "github.com/kpipe/kpipe/netfilter"
)

// table collects the chains of one table in the order they are first written.
type table struct {
	name   string
	order  []string
	chains map[string]*chainText
}

// chainText is one chain's rules: built here, or adopted whole (with its hash)
// from a cached service.
type chainText struct {
	b      strings.Builder
	count  int
	hash   uint64
	hashed bool
}

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

// sum returns the chain's hash, computing it once.
func (c *chainText) sum() uint64 {
	if !c.hashed {
		h := fnv.New64a()
		h.Write([]byte(c.b.String()))
		c.hash, c.hashed = h.Sum64(), true
	}
	return c.hash
}

// merge appends another table's chains: shared chains (top-level ones, buckets)
// get the other table's rules appended, per-service chains are taken over whole.
func (t *table) merge(o *table) {
	for _, name := range o.order {
		oc := o.chains[name]
		if nf.KindOf(name).PerService() {
			if _, dup := t.chains[name]; !dup {
				t.order = append(t.order, name)
			}
			oc.sum()
			t.chains[name] = oc
			continue
		}
		c := t.declare(name)
		c.b.WriteString(oc.b.String())
		c.count += oc.count
	}
}
