package netfilter

import (
	"context"
	"errors"
	"fmt"
	"syscall"
)

// Rules deleted by handle: a transaction that only deletes rules does not make
// the kernel validate the table (nft_table_validate walks every chain reachable
// from the base chains, ~250 ms at 10k services, only when a transaction adds
// a rule with a verdict, a target or a validated match), so it costs the
// transaction alone, about 10 ms. Commit uses it to take an endpoint that went
// away out of its service chains before the walked write of the rest.

// ErrNoRuleHandles says that rules cannot be listed and deleted by handle
// here: the legacy backend, or the iptables-restore writer.
var ErrNoRuleHandles = errors.New("rules are not deleted by handle on this backend")

// RuleRef names one rule of a table by its chain and handle.
type RuleRef struct {
	Chain  string
	Handle uint64
}

// ChainRules is one chain's rules as the kernel holds them: each rule's
// handle, in the kernel's order, and the chain's digest as Digests gives it.
type ChainRules struct {
	Handles []uint64
	Digest  uint64
}

// RuleHandles lists the rules of the chains of table named, over one netlink
// socket, each of one state of that chain. A chain that is not there, or
// that changed while it was read, is left out: the caller does without it.
func (t Tool) RuleHandles(ctx context.Context, table string, chains []string) (map[string]ChainRules, error) {
	if err := t.deletesByHandle(ctx); err != nil {
		return nil, err
	}
	n, done, err := t.openReader(ctx, table)
	if err != nil {
		return nil, err
	}
	defer done()
	out := make(map[string]ChainRules, len(chains))
	for _, chain := range chains {
		rules, err := n.chainRules(chain)
		if errors.Is(err, errChanged) || errors.Is(err, ErrNoChain) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("nf_tables rules of %s %s: %w", table, chain, err)
		}
		out[chain] = rules
	}
	return out, nil
}

// chainRules reads one chain's handles and digest while the ruleset stands
// still (errChanged otherwise); ErrNoChain when it is not there.
func (n *nftReader) chainRules(chain string) (ChainRules, error) {
	start, err := n.generation()
	if err != nil {
		return ChainRules{}, err
	}
	// A dump of a chain that is not there answers as an empty chain would.
	if chains, err := n.chains([]string{chain}); err != nil || len(chains) == 0 {
		if err == nil {
			err = ErrNoChain
		}
		return ChainRules{}, err
	}
	var out ChainRules
	d := newDigest()
	err = n.eachRule(chain, map[uint64]struct{}{}, func(r rule) error {
		if string(r.chain) != chain {
			return nil
		}
		out.Handles = append(out.Handles, r.handle)
		return r.hashInto(d)
	})
	if errors.Is(err, syscall.ENOENT) { // gone since it was listed
		err = ErrNoChain
	}
	if err == nil {
		err = n.still(start)
	}
	out.Digest = uint64(*d)
	return out, err
}

// DeleteRules deletes rules of table by handle in one nf_tables transaction,
// all or none: a rule no longer there (ENOENT) undoes the whole batch. It
// never deletes anything it is not named, so a chain's other rules, kpipe's or
// another agent's, stay as they are.
func (t Tool) DeleteRules(ctx context.Context, table string, rules []RuleRef) error {
	if len(rules) == 0 {
		return nil
	}
	if err := t.deletesByHandle(ctx); err != nil {
		return err
	}
	return t.writeBatches(ctx, []nftSection{deleteRulesSection(nfproto(t.Family), table, rules)})
}

// deletesByHandle is nil when rules are written over netlink to nf_tables,
// the only writer whose rules commit lists and deletes by handle.
func (t Tool) deletesByHandle(ctx context.Context) error {
	if t.Writer != WriterNetlink {
		return ErrNoRuleHandles
	}
	nft, err := t.onNFTables(ctx)
	if err != nil {
		return err
	}
	if !nft {
		return ErrNoRuleHandles
	}
	return nil
}

// deleteRulesSection is one batch of DELRULE messages, each naming its rule by
// table, chain and handle.
func deleteRulesSection(proto uint8, table string, rules []RuleRef) nftSection {
	s := newNFTSection(table, 64*len(rules)+64)
	for _, r := range rules {
		s.add(nftMsgDelRule, 0, proto, nftWhat{"delete a rule of", r.Chain}, func(n *nlBuf) {
			n.str(nftaRuleTable, table)
			n.str(nftaRuleChain, r.Chain)
			n.u64(nftaRuleHandle, r.Handle)
		})
	}
	return s
}
