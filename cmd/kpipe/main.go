// Command kpipe is a Kubernetes node service proxy: a drop-in replacement for
// kube-proxy's iptables mode, built as a supervised pipeline of stages.
//
//	watch ─► coalesce ─► render ─► commit ─► conntrack     (one render→commit→conntrack per IP family)
//	canary (flushed tables → full resync)    health (/healthz, /metrics, healthCheckNodePorts, /debug)
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	tuneGC(os.LookupEnv)
	os.Exit(run(os.Args[1:]))
}

// gcPercent is the collector's target when GOGC is not set: collect at 1.5
// times the live heap, not twice. kpipe's heap is mostly long-lived (the
// rules' text, the informers' objects) and peaks during a full sync; at 10k
// services this takes peak RSS from 224-244 to 181-187 MiB for the same CPU
// seconds (docs/architecture.md, section 7).
const gcPercent = 50

// tuneGC sets gcPercent unless the operator set GOGC: theirs wins.
func tuneGC(lookup func(string) (string, bool)) {
	if _, set := lookup("GOGC"); !set {
		debug.SetGCPercent(gcPercent)
	}
}

// run executes the command line and returns the exit code: 1 for any error, a
// bad flag or configuration as a proxy that stops on an error it could not
// recover from, as kube-proxy (component-base's cli.Run) exits.
func run(args []string) int { return runWith(args, serve) }

// runWith is run with the proxy itself given: tests pass a fake to see the
// options kpipe would run with.
func runWith(args []string, serve func(context.Context, *Options) error) int {
	opts := defaultOptions()
	opts.args = args
	cmd := &cobra.Command{
		Use:           "kpipe",
		Short:         "Kubernetes node service proxy (kube-proxy iptables mode, as a supervised pipeline)",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return fmt.Errorf("unexpected arguments %q: kpipe takes only flags", args)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if text := opts.version.text(); text != "" {
				_, err := fmt.Fprintln(cmd.OutOrStdout(), text)
				return err
			}
			if err := opts.finish(cmd.Flags()); err != nil {
				return err
			}
			if opts.WriteConfigTo != "" {
				return opts.writeConfig(opts.WriteConfigTo)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return serve(ctx, opts)
		},
	}
	opts.addFlags(cmd.Flags())
	cmd.CompletionOptions.DisableDefaultCmd = true
	cmd.AddCommand(operatorCommands()...)
	cmd.SetArgs(args)
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		var code exitCode
		if errors.As(err, &code) {
			return int(code)
		}
		if !errors.As(err, new(loggedError)) {
			// One line: a tool's stderr inside the error may have several.
			fmt.Fprintln(os.Stderr, "kpipe:", strings.ReplaceAll(strings.TrimSpace(err.Error()), "\n", "; "))
		}
		return 1
	}
	return 0
}

// exitCode ends a command with that exit code, printing nothing: an outcome
// that is no error but that a script must tell apart (render --diff's
// differences). Errors are exit code 1.
type exitCode int

func (c exitCode) Error() string { return fmt.Sprintf("exit status %d", int(c)) }
