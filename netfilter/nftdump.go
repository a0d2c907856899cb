package netfilter

import (
	"context"
	"fmt"
)

// ChainExpressions lists the rules of one chain as the kernel holds them, each
// as its expressions ("name hex-of-data"): what two rule sets differ in when
// their digests differ, for tests and debugging. nf_tables backend only.
func (t Tool) ChainExpressions(ctx context.Context, table, chain string) ([][]string, error) {
	n, done, err := t.openReader(ctx, table)
	if err != nil {
		return nil, err
	}
	defer done()
	var out [][]string
	err = n.dumpRules(chain, func(a []byte) error {
		r, err := decodeRule(a)
		if err != nil {
			return err
		}
		var exprs []string
		err = forEachAttr(r.exprs, func(_ uint16, elem []byte) error {
			var e string
			err := forEachAttr(elem, func(typ uint16, v []byte) error {
				switch typ {
				case nftaExprName:
					e = string(cString(v)) + e
				case nftaExprData:
					e += fmt.Sprintf(" %x", v)
				}
				return nil
			})
			exprs = append(exprs, e)
			return err
		})
		out = append(out, exprs)
		return err
	})
	return out, err
}
