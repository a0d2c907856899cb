// Package netnstest gives tests a throwaway network namespace, so they can run the
// real iptables and conntrack without touching the host's.
package netnstest

import (
	"os"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"
)

// Namespace is a new, empty network namespace, gone when the test ends.
type Namespace struct{ handle netns.NsHandle }

// New makes a namespace, or skips the test when it cannot (not root).
func New(tb testing.TB) *Namespace {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root for a network namespace")
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		tb.Fatal(err)
	}
	defer orig.Close()
	h, err := netns.New() // switches this thread into the new namespace
	if err != nil {
		tb.Skipf("cannot make a network namespace: %v", err)
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
