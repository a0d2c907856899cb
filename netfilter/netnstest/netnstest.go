// Package netnstest gives tests a throwaway network namespace, so they can run the
// real iptables and conntrack without touching the host's.
package netnstest

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
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
		tb.Fatalf("%s: CI=true, so this test must run; fix the CI set-up", reason)
		return
	}
	tb.Skip(reason + " (set CI=true to make this a failure)")
}

// inCI says whether the CI environment variable is true.
func inCI() bool {
	ci, err := strconv.ParseBool(os.Getenv("CI"))
	return err == nil && ci
}

// RequireRoot ends the test through Unavailable unless it runs as root.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		Unavailable(tb, "needs root for a network namespace")
	}
}

// New makes a namespace; without root or namespaces, the test ends as Unavailable
// says (a skip, or a failure in CI).
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
