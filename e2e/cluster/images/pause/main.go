// Command pause is the single-node cluster's sandbox image
// (localhost/pause:3.10, containerd's sandbox_image): the first process of
// every pod, holding its namespaces. As upstream's pause.c it sleeps until
// SIGINT or SIGTERM and then exits 0, and reaps every child re-parented to it
// (it is the pod's PID 1 when the pod shares its PID namespace).
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

const version = "3.10"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Printf("pause.go v%s\n", version)
		return
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "Warning: pause should be the first process")
	}
	signals := make(chan os.Signal, 16)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			reapChildren()
			continue
		}
		fmt.Fprintf(os.Stderr, "Shutting down, got signal: %v\n", sig)
		os.Exit(0)
	}
}

// reapChildren waits for every exited child without blocking: one SIGCHLD
// may stand for several.
func reapChildren() {
	for {
		pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
