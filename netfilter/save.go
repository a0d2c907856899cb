package netfilter

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
)

// ErrNoChain: the chain asked for does not exist.
var ErrNoChain = errors.New("no such chain")

// Save lists every chain of table with its rules ("-A ..." lines), as iptables-save
// prints them.
func (t Tool) Save(ctx context.Context, table string) (map[string][]string, error) {
	cmd := exec.CommandContext(ctx, t.binary("-save"), "-t", table)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s -t %s: %w: %s", t.binary("-save"), table, err, strings.TrimSpace(stderr.String()))
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

// ListChain lists one chain's rules ("-A ..." lines) with iptables -S, which reads
// only that chain.
func (t Tool) ListChain(ctx context.Context, table, chain string) ([]string, error) {
	cmd := exec.CommandContext(ctx, t.binary(""), "-w", "5", "-t", table, "-S", chain)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if strings.Contains(msg, "No chain/target/match") || strings.Contains(msg, "incompatible") || strings.Contains(msg, "does not exist") {
			return nil, fmt.Errorf("%s/%s: %w", table, chain, ErrNoChain)
		}
		return nil, fmt.Errorf("%s -t %s -S %s: %w: %s", t.binary(""), table, chain, err, msg)
	}
	var rules []string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "-A ") {
			rules = append(rules, line)
		}
	}
	return rules, nil
}

// WriteSysctl sets a sysctl (see the package function).
func (t Tool) WriteSysctl(name, value string) error { return WriteSysctl(name, value) }

// EnsureJumps puts back any missing jump from a built-in chain.
func (t Tool) EnsureJumps(ctx context.Context, js []Jump) error {
	r, err := NewRules(t.Family)
	if err != nil {
		return err
	}
	return r.EnsureJumps(js)
}
