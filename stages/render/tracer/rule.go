package tracer

import (
	"errors"
	"fmt"

	nf "github.com/kpipe/kpipe/netfilter"
)

// rule is one rule of a chain as netfilter.ParseRule reads it, with its line
// for traces.
type rule struct {
	nf.Rule
	line string
	// opaque says why the tracer cannot evaluate the rule (another agent's,
	// on a node); "" for a rule it evaluates.
	opaque string
}

// parseOrOpaque parses one rule of a node's chain: one the tracer cannot
// follow (a match or target kpipe does not write, a target that is no chain
// of the table, such as LOG) is kept as opaque, with the reason.
func parseOrOpaque(chain, line string, chains map[string]*nf.SavedChain) *rule {
	r, err := parseLine(chain, line)
	if err != nil {
		return &rule{Rule: nf.Rule{Chain: chain}, line: line, opaque: err.Error()}
	}
	if to := r.Target.JumpsTo(); to != "" {
		if _, ok := chains[to]; !ok {
			return &rule{Rule: nf.Rule{Chain: chain}, line: line, opaque: "target " + to + ", which is no chain of the table"}
		}
	}
	return r
}

// parseRule parses one rule line of chain, which the tracer must be able to
// follow.
func parseRule(chain, line string) (*rule, error) {
	r, err := parseLine(chain, line)
	if err != nil {
		return nil, fmt.Errorf("%q: %w", line, err)
	}
	return r, nil
}

func parseLine(chain, line string) (*rule, error) {
	r, err := nf.ParseRule(line)
	switch {
	case err != nil:
	case r.Chain != chain:
		err = fmt.Errorf("not an -A %s rule", chain)
	default:
		err = traceable(&r)
	}
	if err != nil {
		return nil, err
	}
	return &rule{Rule: r, line: line}, nil
}

// traceable refuses what the rule language holds but the tracer does not
// evaluate (kpipe does not write it): an error, never a guess.
func traceable(r *nf.Rule) error {
	switch {
	case r.Out.Name != "":
		return errors.New("-o, which the tracer does not evaluate")
	case r.Src.Prefix != r.Src.Prefix.Masked() || r.Dst.Prefix != r.Dst.Prefix.Masked():
		return errors.New("an address with host bits set")
	case r.Target.Kind == nf.TargetDNAT && r.Target.To.Port() == 0:
		return errors.New("DNAT without a port")
	case r.Target.Kind == nf.TargetMark && r.Target.MarkOp == nf.MarkAnd:
		return errors.New("MARK --and-mark, which the tracer does not evaluate")
	}
	for _, m := range r.Matches {
		switch {
		case m.Kind == nf.MatchAddrType && (m.SrcType|m.DstType)&^nf.AddrTypeLocal != 0:
			return errors.New("an address type other than LOCAL")
		case m.Kind == nf.MatchRecent && m.Recent == nf.RecentRemove:
			return errors.New("-m recent --remove, which the tracer does not evaluate")
		}
	}
	return nil
}

// comment is the rule's -m comment, "" when it has none.
func (r *rule) comment() string {
	for _, m := range r.Matches {
		if m.Kind == nf.MatchComment {
			return m.Text
		}
	}
	return ""
}
