// Command cluster brings the single-node test cluster up (`up`: build what
// is missing, start it, print the kubeconfig path; it stays running) or
// removes everything it made (`down`). `go tool task cluster` and
// `go tool task cluster-down` run it.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"

	"github.com/kpipe/kpipe/e2e/cluster"
)

func main() {
	if len(os.Args) != 2 || (os.Args[1] != "up" && os.Args[1] != "down") {
		fmt.Fprintln(os.Stderr, "usage: cluster up|down")
		os.Exit(2)
	}
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "cluster: "+format+"\n", args...) }
	if os.Args[1] == "down" {
		if errs := cluster.Down(); len(errs) > 0 {
			fmt.Fprintln(os.Stderr, "cluster down:", errors.Join(errs...))
			os.Exit(1)
		}
		logf("down: nothing of the cluster is left")
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	c, err := cluster.Up(ctx, logf)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cluster up:", err)
		os.Exit(1)
	}
	fmt.Printf("export KUBECONFIG=%s\n", c.Kubeconfig)
}
