package netfilter

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"

	"github.com/kpipe/kpipe/bus"
)

// Tool runs the iptables tools of one IP family.
type Tool struct {
	Family bus.Family
}

func (t Tool) binary(name string) string {
	if t.Family == bus.IPv6 {
		return "ip6tables" + name
	}
	return "iptables" + name
}

// Restore feeds payload to iptables-restore without flushing the tables: only the
// chains the payload declares are replaced, and each table is replaced atomically.
func (t Tool) Restore(ctx context.Context, payload []byte) error {
	cmd := exec.CommandContext(ctx, t.binary("-restore"), "-w", "5", "--noflush", "--counters")
	cmd.Stdin = bytes.NewReader(payload)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w: %s", t.binary("-restore"), err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// Chains lists the chains that exist in table.
func (t Tool) Chains(ctx context.Context, table string) ([]string, error) {
	cmd := exec.CommandContext(ctx, t.binary("-save"), "-t", table)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s -t %s: %w: %s", t.binary("-save"), table, err, strings.TrimSpace(stderr.String()))
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

// IsOwned says whether a chain is a per-service chain of kpipe (or kube-proxy).
func IsOwned(chain string) bool {
	for _, p := range OwnedPrefixes {
		if strings.HasPrefix(chain, p) {
			return true
		}
	}
	return false
}

// RuleCount counts the rules of one chain (iptables -S CHAIN, which reads only that
// chain); -1 when the chain does not exist or cannot be read.
func (t Tool) RuleCount(ctx context.Context, table, chain string) int {
	out, err := exec.CommandContext(ctx, t.binary(""), "-w", "5", "-t", table, "-S", chain).Output()
	if err != nil {
		return -1
	}
	n := 0
	for _, line := range bytes.Split(out, []byte("\n")) {
		if bytes.HasPrefix(line, []byte("-A ")) {
			n++
		}
	}
	return n
}
