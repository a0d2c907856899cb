// Package netnstest gives tests a throwaway network namespace, so they can run the
// real iptables and conntrack without touching the host's, and decides which
// tests may use root and the kernel at all: none under -short (the fast inner
// loop, `go tool task unit-fast`, which any user can run in seconds).
package netnstest

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/vishvananda/netns"
)

// Namespace is a new, empty network namespace, gone when the test ends.
type Namespace struct{ handle netns.NsHandle }

// Unavailable ends a test that cannot have what it needs (root, a network
// namespace, a tool). In CI (CI=true), where all of it is set up, that is a broken
// set-up and the test fails; a developer who is not root gets a skip.
func Unavailable(tb testing.TB, reason string) {
	tb.Helper()
	if inCI() {
		tb.Fatalf("%s", ciFailure(reason))
		return
	}
	tb.Skip(reason + " (set CI=true to make this a failure)")
}

func ciFailure(reason string) string {
	return reason + ": CI=true, so this test must run; fix the CI set-up"
}

// inCI says whether the CI environment variable is true.
func inCI() bool {
	ci, err := strconv.ParseBool(os.Getenv("CI"))
	return err == nil && ci
}

// RequireRoot ends a test that needs root and the kernel (namespaces,
// netfilter, conntrack, containerd) where it cannot have them: under -short
// with a skip, without root as Unavailable says.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	switch reason, short := unmet(); {
	case reason == "":
	case short:
		tb.Skip(reason)
	default:
		Unavailable(tb, reason)
	}
}

// MainUnavailable is RequireRoot for a TestMain whose every test needs root
// and the kernel. It returns false when they can run; otherwise it has printed
// why none runs, and code is the exit status: 1 when CI=true and root is
// missing, else 0 (all skipped).
func MainUnavailable() (code int, unavailable bool) {
	if !flag.Parsed() {
		flag.Parse() // testing.Short reads the flags
	}
	reason, short := unmet()
	switch {
	case reason == "":
		return 0, false
	case short || !inCI():
		fmt.Println("skipping every test:", reason)
		return 0, true
	}
	fmt.Println(ciFailure(reason))
	return 1, true
}

// unmet says why tests that need root and the kernel cannot run here, and
// whether that is -short's choice; "" when they can run.
func unmet() (reason string, short bool) {
	switch {
	case testing.Short():
		return "needs root and the kernel, which -short leaves out", true
	case os.Geteuid() != 0:
		return "needs root for network namespaces and the kernel's netfilter", false
	}
	return "", false
}

// New makes a namespace; under -short, without root or namespaces, the test
// ends as RequireRoot says (a skip, or a failure in CI).
func New(tb testing.TB) *Namespace {
	tb.Helper()
	RequireRoot(tb)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		tb.Fatal(err)
	}
	defer orig.Close()
	h, err := netns.New() // switches this thread into the new namespace
	if err != nil {
		Unavailable(tb, fmt.Sprintf("cannot make a network namespace: %v", err))
	}
	if err := netns.Set(orig); err != nil {
		panic(err) // the thread must not go back to the pool in the wrong namespace
	}
	tb.Cleanup(func() { h.Close() })
	return &Namespace{handle: h}
}

// Run runs f on a thread switched into the namespace: sockets it opens and tools
// it starts (forked from that thread) live there.
func (n *Namespace) Run(tb testing.TB, f func() error) {
	tb.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		tb.Fatal(err)
	}
	defer orig.Close()
	if err := netns.Set(n.handle); err != nil {
		tb.Fatal(err)
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			panic(err)
		}
	}()
	if err := f(); err != nil {
		tb.Fatal(err)
	}
}

// Output runs the command name in the namespace with stdin as its input and
// returns what it printed (stdout and stderr) and how it ended.
func (n *Namespace) Output(tb testing.TB, stdin, name string, args ...string) (out string, err error) {
	tb.Helper()
	n.Run(tb, func() error {
		cmd := exec.Command(name, args...)
		cmd.Stdin = strings.NewReader(stdin)
		b, runErr := cmd.CombinedOutput()
		out, err = string(b), runErr
		return nil
	})
	return out, err
}
