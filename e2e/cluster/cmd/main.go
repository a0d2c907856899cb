// Command cluster runs the single-node test cluster (e2e/cluster):
//
//	up          build what is missing, start it with kubeadm's kube-proxy
//	            serving (or find it running), print how to reach it
//	kpipe       hand the node to kpipe: deploy/ applied with the image built here
//	kube-proxy  hand it back: the DaemonSet rolled back to its newest revision
//	            with kube-proxy's image, kpipe's role dropped
//	down        remove everything the cluster made
//
// `go tool task cluster`, `cluster-kpipe`, `cluster-kube-proxy` and
// `cluster-down` run it.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"

	"github.com/kpipe/kpipe/e2e/cluster"
	"github.com/kpipe/kpipe/e2e/testbed"
)

func main() {
	if len(os.Args) != 2 {
		usage()
	}
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "cluster: "+format+"\n", args...) }
	if os.Args[1] == "down" {
		if errs := cluster.Down(); len(errs) > 0 {
			fail(errors.Join(errs...))
		}
		logf("down: nothing of the cluster is left")
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	root, err := testbed.RepoRoot()
	if err != nil {
		fail(err)
	}
	c, err := cluster.Up(ctx, logf)
	if err != nil {
		fail(err)
	}
	switch os.Args[1] {
	case "up":
	case "kpipe":
		err = c.DeployKpipe(ctx, root)
	case "kube-proxy":
		err = c.BackToKubeProxy(ctx)
	default:
		usage()
	}
	if err != nil {
		fail(err)
	}
	out, _ := c.Kubectl(ctx, "", "-n", "kube-system", "get", "daemonset", "kube-proxy", "-o", "jsonpath={.spec.template.spec.containers[0].image}")
	logf("the node's proxy: %s", out)
	fmt.Printf("export KUBECONFIG=%s\nexport PATH=%s:$PATH  # kubectl and kubeadm %s\n", c.Kubeconfig, filepath.Dir(c.Bins.Kubectl), c.Bins.Version)
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: cluster up|kpipe|kube-proxy|down")
	os.Exit(2)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "cluster:", err)
	os.Exit(1)
}
