// Package e2e runs kpipe against a real kube-apiserver and etcd and the real
// kernel, in network namespaces (see package testbed), and checks what a user
// would see. It needs root. Run with:
//
//	go test -count=1 -v -timeout 30m ./e2e/
//
// The first run on a machine builds kube-apiserver and etcd (several minutes;
// cached in $KPIPE_E2E_CACHE or ~/.cache/kpipe-e2e/bin).
// KPIPE_E2E_KEEP=1 keeps the run's temp dir (logs) after the run.
package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

const (
	// endpointPods are the pods tests use as endpoints: 1..endpointPods.
	endpointPods = 10
	// clientPod is the pod tests connect from; it is never an endpoint.
	clientPod = endpointPods + 1
)

var (
	tb *testbed.Testbed
	// kpipeErr is why kpipe could not be built or started; every test that
	// needs kpipe fails with it.
	kpipeErr error
)

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	flag.Parse()
	logf := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "e2e: "+format+"\n", args...)
	}
	if code, unavailable := netnstest.MainUnavailable(); unavailable {
		return code
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var err error
	setupStart := time.Now()
	tb, err = testbed.New(ctx, testbed.Config{
		Pods:    clientPod,
		Logf:    logf,
		KeepDir: os.Getenv("KPIPE_E2E_KEEP") != "",
	})
	if err != nil {
		logf("test bed: %v", err)
		return 1
	}
	defer func() {
		if err := tb.Close(); err != nil {
			logf("cleanup: %v", err)
		}
	}()
	if os.Getenv("KPIPE_E2E_KEEP") != "" {
		logf("keeping %s", tb.Dir)
	}

	// Interrupted, terminated or about to be killed by go test's timeout: clean
	// up first. (Children die with this process anyway; namespaces would be
	// left for the next run to remove.)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT)
	go func() {
		s := <-sigs
		if s == syscall.SIGQUIT {
			buf := make([]byte, 1<<20)
			os.Stderr.Write(buf[:runtime.Stack(buf, true)])
		}
		logf("got %v: cleaning up", s)
		if err := tb.Close(); err != nil {
			logf("cleanup: %v", err)
		}
		os.Exit(2)
	}()
	if d := testTimeout(); d > 0 {
		// go test's own timeout panics without running deferred calls; beat it.
		grace := min(20*time.Second, d/4)
		{
			t := time.AfterFunc(d-grace, func() {
				buf := make([]byte, 1<<20)
				os.Stderr.Write(buf[:runtime.Stack(buf, true)])
				logf("test timeout (%v) nearly reached: cleaning up", d)
				if err := tb.Close(); err != nil {
					logf("cleanup: %v", err)
				}
				os.Exit(2)
			})
			defer t.Stop()
		}
	}

	k, err := tb.BuildKpipe()
	if err != nil {
		kpipeErr = fmt.Errorf("build kpipe: %w", err)
	} else if err := k.Start(); err != nil {
		kpipeErr = fmt.Errorf("start kpipe: %w", err)
	}
	if kpipeErr != nil {
		logf("%v", kpipeErr)
	}
	logf("set-up took %v", time.Since(setupStart).Round(time.Millisecond))
	code := m.Run()
	logf("kpipe explain agreed with the packets on %d request series (%d not put to it: fake dialers, other namespaces)", explained.Load(), unexplained.Load())
	return code
}

func testTimeout() time.Duration {
	f := flag.Lookup("test.timeout")
	if f == nil {
		return 0
	}
	g, ok := f.Value.(flag.Getter)
	if !ok {
		return 0
	}
	d, _ := g.Get().(time.Duration)
	return d
}
