package netfilter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/coreos/go-iptables/iptables"

	"github.com/kpipe/kpipe/bus"
)

// Tool runs the iptables tools of one IP family. Every run is bounded: it waits
// at most lockWait for the xtables lock and ends with the caller's context.
type Tool struct {
	Family bus.Family
	// backend is "" for the host's default iptables, or "-legacy" (tests use it to
	// reach the xtables lock, which the nf_tables backend does not take).
	backend string
	// Writer is how Restore writes (the zero value: over netlink).
	Writer Writer
}

// lockWait is how long an iptables tool waits for the xtables lock (-w) before it
// gives up, as kube-proxy does.
const lockWait = "5"

// ErrNoChain says that a chain does not exist.
var ErrNoChain = errors.New("no such chain")

// ErrNoTable says that the kernel cannot have the table at all: its module is
// missing (legacy iptables' "Table does not exist (do you need to insmod?)"), or
// the family is not supported (EAFNOSUPPORT). Trying again cannot help.
var ErrNoTable = errors.New("the kernel has no such table")

func (t Tool) binary(name string) string {
	if t.Family == bus.IPv6 {
		return "ip6tables" + t.backend + name
	}
	return "iptables" + t.backend + name
}

// toolError is a failed run of an iptables tool.
type toolError struct {
	command string
	status  int // exit status; -1 when the tool did not exit by itself
	stderr  string
	err     error
}

func (e *toolError) Error() string {
	if e.stderr == "" {
		return fmt.Sprintf("%s: %v", e.command, e.err)
	}
	return fmt.Sprintf("%s: %v: %s", e.command, e.err, e.stderr)
}

func (e *toolError) Unwrap() error { return e.err }

// noTableMessages are what the tools print when the kernel cannot have a table:
// legacy iptables for a table whose module is not there, and any of them for an
// address family the kernel lacks (strerror(EAFNOSUPPORT)). (Legacy
// iptables-restore's "unable to initialize table" gives no cause: not one.)
var noTableMessages = []string{"Table does not exist (do you need to insmod?)", "Address family not supported by protocol"}

// Is makes a run that failed for want of the table ErrNoTable.
func (e *toolError) Is(target error) bool {
	if target != ErrNoTable {
		return false
	}
	return slices.ContainsFunc(noTableMessages, func(m string) bool { return strings.Contains(e.stderr, m) })
}

// toolRoot is "" (the host's iptables), or, in tests only (export_test.go), the
// root filesystem of an image whose iptables every tool runs: chrooted there
// (the network namespace stays the caller's), and straight through its
// xtables-nft-multi (xtables-legacy-multi for the -legacy tools), not the
// image's iptables-wrapper, whose first run would pick a backend.
var toolRoot string

// toolCommand is the command that runs binary with args: the host's, or the
// image's under toolRoot.
func toolCommand(ctx context.Context, binary string, args []string) *exec.Cmd {
	if toolRoot == "" {
		return exec.CommandContext(ctx, binary, args...)
	}
	argv := append([]string{binary}, args...)
	cmd := exec.CommandContext(ctx, "/usr/sbin/xtables-nft-multi", argv...)
	if strings.Contains(binary, "-legacy") {
		cmd = exec.CommandContext(ctx, "/usr/sbin/xtables-legacy-multi", argv...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: toolRoot}
	cmd.Dir = "/" // inside the root: the chroot comes first
	return cmd
}

// runTool runs binary with args under ctx, with stdin (when not nil) as its input,
// and returns what it printed; what it wrote to stderr goes into the error.
func (t Tool) runTool(ctx context.Context, binary string, stdin []byte, args ...string) ([]byte, error) {
	cmd := toolCommand(ctx, binary, args)
	cmd.WaitDelay = time.Second // a killed tool cannot hold Wait up through its pipes
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	out := stdout.Bytes()
	if err == nil {
		return out, nil
	}
	te := &toolError{command: strings.Join(cmd.Args, " "), status: -1, stderr: strings.TrimSpace(stderr.String()), err: err}
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.Exited() {
		te.status = exit.ExitCode()
	}
	if ctx.Err() != nil {
		te.err = fmt.Errorf("%w (%v)", ctx.Err(), err)
	}
	return out, te
}

// iptables runs the family's iptables with args.
func (t Tool) iptables(ctx context.Context, args ...string) ([]byte, error) {
	return t.runTool(ctx, t.binary(""), nil, append([]string{"-w", lockWait}, args...)...)
}

// notThere says whether a failed run means that the chain or rule asked about does
// not exist: iptables exits 1 with a message for it. (iptables-nft 1.8.9 calls a
// missing chain "incompatible".) A held lock, a missing table or kernel module,
// a killed tool: all exit otherwise.
func notThere(err error) bool {
	var te *toolError
	if !errors.As(err, &te) || te.status != 1 {
		return false
	}
	for _, m := range []string{"No chain/target/match by that name", "does a matching rule exist", "does not exist", "is incompatible"} {
		if strings.Contains(te.stderr, m) {
			return true
		}
	}
	return false
}

// ListChain returns the rules of one chain as `iptables -S CHAIN` prints them
// ("-A CHAIN ..." lines; it reads only that chain). The error is ErrNoChain when
// the chain does not exist.
func (t Tool) ListChain(ctx context.Context, table, chain string) ([]string, error) {
	out, err := t.iptables(ctx, "-t", table, "-S", chain)
	if err != nil {
		if notThere(err) {
			return nil, fmt.Errorf("%s/%s: %w (%v)", table, chain, ErrNoChain, err)
		}
		return nil, err
	}
	var rules []string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "-A ") {
			rules = append(rules, line)
		}
	}
	return rules, nil
}

// chainExists says whether chain is in table. It lists at most the chain's first
// rule, so it is cheap however long the chain is.
func (t Tool) chainExists(ctx context.Context, table, chain string) (bool, error) {
	_, err := t.iptables(ctx, "-t", table, "-S", chain, "1")
	switch {
	case err == nil:
		return true, nil
	case notThere(err):
		return false, nil
	}
	return false, err
}

// ensureChain creates chain in table if it does not exist; it never flushes it.
func (t Tool) ensureChain(ctx context.Context, table, chain string) error {
	ok, err := t.chainExists(ctx, table, chain)
	if err != nil || ok {
		return err
	}
	if _, err := t.iptables(ctx, "-t", table, "-N", chain); err != nil {
		// Lost a race with another writer: fine if it exists now.
		if ok, _ := t.chainExists(ctx, table, chain); ok {
			return nil
		}
		return fmt.Errorf("create chain %s/%s: %w", table, chain, err)
	}
	return nil
}

// versionWait bounds how long HasRandomFully waits for `iptables --version`.
var versionWait = 5 * time.Second

// HasRandomFully says whether the host's iptables of family f can write MASQUERADE
// --random-fully (iptables 1.6.2 and later). When iptables does not answer within
// versionWait, it says no: the rule then works, only without fully random ports.
func HasRandomFully(f bus.Family) bool {
	proto := iptables.ProtocolIPv4
	if f == bus.IPv6 {
		proto = iptables.ProtocolIPv6
	}
	answer := make(chan bool, 1)
	go func() {
		// go-iptables runs `iptables --version` (no lock needed) and knows which
		// versions have the option.
		ipt, err := iptables.New(iptables.IPFamily(proto))
		answer <- err == nil && ipt.HasRandomFully()
	}()
	select {
	case ok := <-answer:
		return ok
	case <-time.After(versionWait):
		return false
	}
}
