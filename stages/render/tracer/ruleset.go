package tracer

import (
	"bufio"
	"bytes"
	"fmt"
	"strings"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Ruleset is one family's nat and filter tables as a node holds them: what
// iptables-save prints, built-in chains and other agents' rules included.
type Ruleset struct {
	Family bus.Family
	Tables map[string]*Table // nf.TableNAT, nf.TableFilter
}

// Table is one table of a Ruleset.
type Table struct {
	// Chains are the table's chains with their "-A" lines, in order.
	Chains map[string][]string
	// Policy is each built-in chain's policy (ACCEPT or DROP).
	Policy map[string]string
}

// familyHeader starts one family's section in `kpipe render`'s output; plain
// iptables-save output has none and is one family.
const familyHeader = "# kpipe render "

// ParseSave reads family's nat and filter tables from text: iptables-save's
// output (of one family), or `kpipe render`'s (one section per family, each
// headed "# kpipe render IPv4" or "IPv6"). Other tables are left out.
func ParseSave(text []byte, family bus.Family) (*Ruleset, error) {
	rs := &Ruleset{Family: family, Tables: map[string]*Table{}}
	sections := strings.Contains(string(text), "\n"+familyHeader) || bytes.HasPrefix(text, []byte(familyHeader))
	inFamily := !sections
	var table *Table // nil outside a table, or in a table left out
	inTable := false
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		bad := func(format string, args ...any) error {
			return fmt.Errorf("line %d: %s: %q", n, fmt.Sprintf(format, args...), line)
		}
		switch {
		case strings.HasPrefix(line, familyHeader):
			if inTable {
				return nil, bad("a family's header inside a table")
			}
			inFamily = strings.TrimSpace(strings.TrimPrefix(line, familyHeader)) == family.String()
		case line == "" || strings.HasPrefix(line, "#") || !inFamily:
		case strings.HasPrefix(line, "*"):
			if inTable {
				return nil, bad("a table begins before the last one's COMMIT")
			}
			inTable, table = true, nil
			if name := line[1:]; name == nf.TableNAT || name == nf.TableFilter {
				if rs.Tables[name] != nil {
					return nil, bad("table %s twice", name)
				}
				table = &Table{Chains: map[string][]string{}, Policy: map[string]string{}}
				rs.Tables[name] = table
			}
		case !inTable:
			return nil, bad("outside a table (no *nat or *filter line before it)")
		case line == "COMMIT":
			inTable = false
		case table == nil:
		case strings.HasPrefix(line, ":"):
			fields := strings.Fields(line[1:])
			if len(fields) < 2 {
				return nil, bad("a chain declaration without a policy")
			}
			if _, ok := table.Chains[fields[0]]; !ok {
				table.Chains[fields[0]] = []string{}
			}
			if fields[1] != "-" {
				table.Policy[fields[0]] = fields[1]
			}
		case strings.HasPrefix(line, "-A "):
			chain, _, _ := strings.Cut(line[3:], " ")
			if _, ok := table.Chains[chain]; !ok {
				return nil, bad("a rule of chain %s, which was not declared", chain)
			}
			table.Chains[chain] = append(table.Chains[chain], line)
		default:
			return nil, bad("not a line of iptables-save's output")
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if inTable {
		return nil, fmt.Errorf("the last table has no COMMIT")
	}
	for _, name := range []string{nf.TableNAT, nf.TableFilter} {
		if rs.Tables[name] == nil {
			if sections && len(rs.Tables) == 0 {
				return nil, fmt.Errorf("no %s section (%s%s)", family, familyHeader, family)
			}
			return nil, fmt.Errorf("no %s table for %s", name, family)
		}
	}
	return rs, nil
}
