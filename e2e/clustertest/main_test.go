// Package clustertest checks kpipe where operators meet it: its image, run by
// a kubelet from kubeadm's DaemonSet or deploy/, in a real single-node
// cluster (e2e/cluster) with a CNI, CoreDNS and pods whose EndpointSlices the
// controller manager writes. With KPIPE_CLUSTER_SMOKE=1 (`go tool task
// e2e-cluster-smoke`, part of `go tool task test`) only the smoke subset runs:
// the drop-in image, pods reaching the apiserver and DNS, one swap and
// rollback under traffic. Under -short (no root, no kernel) none runs.
//
// A cluster already running (`go tool task cluster`) is used and left
// running; otherwise one is brought up for the run and taken down after it.
package clustertest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/kpipe/kpipe/e2e/cluster"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

var c *cluster.Cluster

func TestMain(m *testing.M) {
	if code, unavailable := netnstest.MainUnavailable(); unavailable {
		os.Exit(code)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Minute)
	wasRunning := cluster.Running()
	var err error
	c, err = cluster.Up(ctx, func(f string, a ...any) { fmt.Printf("cluster: "+f+"\n", a...) })
	cancel()
	code := 1
	if err != nil {
		fmt.Println("cluster up:", err)
	} else {
		code = m.Run()
	}
	if !wasRunning && os.Getenv("KPIPE_CLUSTER_KEEP") == "" {
		if errs := cluster.Down(); len(errs) > 0 {
			fmt.Println("cluster down:", errors.Join(errs...))
			code = 1
		}
	}
	os.Exit(code)
}

// fullOnly skips a test in the smoke run.
func fullOnly(t *testing.T) {
	if cluster.SmokeOnly() {
		t.Skip("not in the smoke subset: go tool task e2e-cluster")
	}
}
