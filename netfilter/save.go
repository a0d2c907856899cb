package netfilter

import (
	"bufio"
	"bytes"
	"context"
	"strings"
)

// Save lists every chain of table with its rules ("-A ..." lines), as iptables-save
// prints them. (iptables-save takes no lock, so it has no -w.)
func (t Tool) Save(ctx context.Context, table string) (map[string][]string, error) {
	out, err := t.SaveText(ctx, table)
	if err != nil {
		return nil, err
	}
	chains := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, ":"):
			if name, _, ok := strings.Cut(line[1:], " "); ok {
				if _, seen := chains[name]; !seen {
					chains[name] = nil
				}
			}
		case strings.HasPrefix(line, "-A "):
			name, _, _ := strings.Cut(line[3:], " ")
			chains[name] = append(chains[name], line)
		}
	}
	return chains, sc.Err()
}

// SaveText is what iptables-save prints for table.
func (t Tool) SaveText(ctx context.Context, table string) ([]byte, error) {
	return t.runTool(ctx, t.binary("-save"), nil, "-t", table)
}

// WriteSysctl sets a sysctl (see the package function WriteSysctl).
func (t Tool) WriteSysctl(name, value string) error { return WriteSysctl(name, value) }
