package nftables

import (
	"fmt"
	"slices"

	nf "github.com/kpipe/kpipe/netfilter"
)

// NFTTable is t's table as the netlink writer takes it.
func (t *Table) NFTTable() nf.NFTTable {
	return nf.NFTTable{Family: t.Family, Name: TableName, Comment: t.Comment}
}

// AddObjects adds t's table, chains, sets and maps and their elements to x.
// The rules are not added: writing them over netlink is issue 26's next step.
func (t *Table) AddObjects(x *nf.NFTTransaction) error {
	if err := x.AddTable(); err != nil {
		return err
	}
	for _, c := range t.Chains {
		if err := x.AddChain(nf.NFTChain{Name: c.Name, Comment: c.Comment, Type: c.Type, Hook: c.Hook, Priority: int32(c.Priority)}); err != nil {
			return err
		}
	}
	sets := make([]nf.NFTSet, len(t.Sets))
	for i, s := range t.Sets {
		set, err := s.nftSet()
		if err != nil {
			return err
		}
		if err := x.AddSet(set); err != nil {
			return err
		}
		sets[i] = set
	}
	for i, s := range t.Sets { // after every chain: elements go to chains
		if len(s.Elements) == 0 {
			continue
		}
		elems := make([]nf.NFTElement, len(s.Elements))
		for j, e := range s.Elements {
			elems[j] = nf.NFTElement{Key: e.Key, Value: e.Value, Comment: e.Comment}
		}
		if err := x.AddElements(sets[i], elems); err != nil {
			return err
		}
	}
	return nil
}

// nftSet is s as the writer takes it: of the flags, kube-proxy's sets have
// only dynamic and timeout (the latter with s.Timeout).
func (s *Set) nftSet() (nf.NFTSet, error) {
	for _, f := range s.Flags {
		if f != "dynamic" && f != "timeout" {
			return nf.NFTSet{}, fmt.Errorf("set %s: flag %q", s.Name, f)
		}
	}
	return nf.NFTSet{Name: s.Name, Type: s.Type, Dynamic: slices.Contains(s.Flags, "dynamic"), Timeout: s.Timeout, Comment: s.Comment}, nil
}
