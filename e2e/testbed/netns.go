package testbed

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/vishvananda/netns"
)

// NamePrefix starts the name of every network namespace the test bed makes.
const NamePrefix = "kpe2e-"

// nsHandles caches open handles of the namespaces the test bed dials from.
type nsHandles struct {
	mu sync.Mutex
	m  map[string]netns.NsHandle
}

func (h *nsHandles) get(name string) (netns.NsHandle, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if fd, ok := h.m[name]; ok {
		return fd, nil
	}
	fd, err := netns.GetFromName(name)
	if err != nil {
		return netns.None(), fmt.Errorf("open network namespace %s: %w", name, err)
	}
	if h.m == nil {
		h.m = map[string]netns.NsHandle{}
	}
	h.m[name] = fd
	return fd, nil
}

// drop closes the cached handle of namespace name, if any.
func (h *nsHandles) drop(name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if fd, ok := h.m[name]; ok {
		fd.Close()
		delete(h.m, name)
	}
}

func (h *nsHandles) closeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for name, fd := range h.m {
		fd.Close()
		delete(h.m, name)
	}
}

// InNamespace runs fn on an OS thread that is inside the network namespace ns.
// Sockets fn creates belong to ns for good, so fn can dial and return the
// connection for use anywhere. fn must not start goroutines that create sockets.
func (tb *Testbed) InNamespace(ns string, fn func() error) error {
	target, err := tb.handles.get(ns)
	if err != nil {
		return err
	}
	return inNamespace(target, fn)
}

// InNetNSPath is InNamespace for a namespace named by a path, such as a
// container's /proc/PID/ns/net.
func InNetNSPath(path string, fn func() error) error {
	target, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open network namespace %s: %w", path, err)
	}
	defer target.Close()
	return inNamespace(target, fn)
}

func inNamespace(target netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("get current network namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter network namespace: %w", err)
			return
		}
		var ferr error
		func() {
			defer func() {
				if r := recover(); r != nil {
					ferr = fmt.Errorf("panic in namespace: %v", r)
				}
			}()
			ferr = fn()
		}()
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: when this goroutine ends the runtime
			// throws the thread away instead of reusing it in the wrong namespace.
			errc <- fmt.Errorf("return to original network namespace: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// DialContext dials network/address from inside namespace ns.
func (tb *Testbed) DialContext(ctx context.Context, ns, network, address string) (net.Conn, error) {
	var conn net.Conn
	err := tb.InNamespace(ns, func() error {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, address)
		conn = c
		return err
	})
	return conn, err
}

// Dialer returns a dial function for namespace ns, in the shape net/http and
// client-go want.
func (tb *Testbed) Dialer(ns string) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		return tb.DialContext(ctx, ns, network, address)
	}
}

// Exec runs argv inside network namespace ns (ip netns exec) and returns its
// standard output. Arguments are passed as a list, never through a shell.
func (tb *Testbed) Exec(ns string, argv ...string) (string, error) {
	return Run(append([]string{"ip", "netns", "exec", ns}, argv...)...)
}

// ---- namespace lifecycle ----

func listNamespaces() ([]string, error) {
	out, err := Run("ip", "netns", "list")
	if err != nil {
		return nil, err
	}
	var names []string
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) > 0 {
			names = append(names, f[0])
		}
	}
	return names, nil
}

// namespacePIDs lists the processes living in namespace ns.
func namespacePIDs(ns string) []int {
	out, err := Run("ip", "netns", "pids", ns)
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(out) {
		if pid, err := strconv.Atoi(f); err == nil && pid != os.Getpid() {
			pids = append(pids, pid)
		}
	}
	return pids
}

// deleteNamespace kills whatever still runs in ns (only ever a namespace this
// test bed, or an earlier run of it, created) and deletes it.
func deleteNamespace(ns string) error {
	if !strings.HasPrefix(ns, NamePrefix) {
		return fmt.Errorf("refusing to delete namespace %q: not ours", ns)
	}
	for _, pid := range namespacePIDs(ns) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	_, err := Run("ip", "netns", "del", ns)
	return err
}
