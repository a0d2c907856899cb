package testbed

import (
	"net"
	"strconv"
	"time"
)

// TB is the part of testing.TB that Eventually needs (the demo has its own).
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
}

// Eventually calls fn every 100 ms until it returns nil; if timeout passes
// first, it fails t with fn's last error.
func Eventually(t TB, timeout time.Duration, fn func() error) {
	t.Helper()
	EventuallyEvery(t, timeout, 100*time.Millisecond, fn)
}

// EventuallyEvery is Eventually with a chosen interval.
func EventuallyEvery(t TB, timeout, interval time.Duration, fn func() error) {
	t.Helper()
	if err := Poll(timeout, interval, fn); err != nil {
		t.Fatalf("not so after %v: %v", timeout, err)
	}
}

// Poll calls fn every interval until it returns nil (then Poll returns nil)
// or timeout passes (then Poll returns fn's last error).
func Poll(timeout, interval time.Duration, fn func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := fn()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(interval)
	}
}

func joinHostPort(ip string, port int) string {
	return net.JoinHostPort(ip, strconv.Itoa(port))
}
