package netfilter

import (
	"bufio"
	"bytes"
	"context"
	"strings"
)

// Restore feeds payload to iptables-restore without flushing the tables: only the
// chains the payload declares are replaced, and each table is replaced atomically.
func (t Tool) Restore(ctx context.Context, payload []byte) error {
	_, err := t.runTool(ctx, t.binary("-restore"), payload, "-w", lockWait, "--noflush", "--counters")
	return err
}

// Chains lists the chains that exist in table. (iptables-save takes no lock, so it
// has no -w.)
func (t Tool) Chains(ctx context.Context, table string) ([]string, error) {
	out, err := t.runTool(ctx, t.binary("-save"), nil, "-t", table)
	if err != nil {
		return nil, err
	}
	var chains []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, ":") {
			if name, _, ok := strings.Cut(line[1:], " "); ok {
				chains = append(chains, name)
			}
		}
	}
	return chains, sc.Err()
}
