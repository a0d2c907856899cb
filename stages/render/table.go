package render

import (
	"sync"

	nf "github.com/kpipe/kpipe/netfilter"
)

// table collects the chains of one table in the order they are first written.
type table struct {
	name   string
	order  []string
	chains map[string]*chainText
}

// chainText is one chain's rules. Its buffer comes from, and goes back to,
// chainBuffers: a first render at 10k services writes 10^5 chains, and
// buffers grown from nothing for each were a fifth of its allocations.
type chainText struct {
	b      []byte
	count  int
	hash   uint64
	hashed bool
}

var chainBuffers = sync.Pool{New: func() any { return new(chainText) }}

// String is the chain's rules (a copy: the buffer is reused).
func (c *chainText) String() string { return string(c.b) }

func newTable(name string) *table {
	return &table{name: name, chains: map[string]*chainText{}}
}

func (t *table) declare(chain string) *chainText {
	c, ok := t.chains[chain]
	if !ok {
		c = chainBuffers.Get().(*chainText)
		*c = chainText{b: c.b[:0]}
		t.order = append(t.order, chain)
		t.chains[chain] = c
	}
	return c
}

// release gives the chains' buffers back for other renders: the table is
// not used after.
func (t *table) release() {
	for _, c := range t.chains {
		chainBuffers.Put(c)
	}
	t.chains, t.order = nil, nil
}

// add appends "-A chain args..." to chain.
func (t *table) add(chain string, args ...string) { t.rule(chain, args) }

// rule appends "-A chain" and every part's words to chain.
func (t *table) rule(chain string, parts ...[]string) {
	c := t.declare(chain)
	c.b = append(c.b, "-A "...)
	c.b = append(c.b, chain...)
	for _, p := range parts {
		for _, a := range p {
			c.b = append(c.b, ' ')
			c.b = append(c.b, a...)
		}
	}
	c.b = append(c.b, '\n')
	c.count++
}

// sum returns the chain's hash (64-bit FNV-1a), computing it once.
func (c *chainText) sum() uint64 {
	if !c.hashed {
		c.hash, c.hashed = fnv64a(c.b), true
	}
	return c.hash
}

// fnv64a is hash/fnv's New64a over s, without copying s.
func fnv64a[T string | []byte](s T) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= prime
	}
	return h
}

// parts is the table's chains as a cached service keeps them, each chain's
// text copied to exactly its size.
func (t *table) parts() []part {
	out := make([]part, 0, len(t.order))
	for _, name := range t.order {
		c := t.chains[name]
		p := part{name: name, rules: c.String(), count: int32(c.count), perService: nf.KindOf(name).PerService()}
		if p.perService {
			p.hash, p.rank = c.sum(), rankOf(name)
		}
		out = append(out, p)
	}
	return out
}
