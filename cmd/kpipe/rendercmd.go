package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/spf13/cobra"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/render"
)

// diffExitCode is render --diff's exit code when the node's rules differ from
// the rendering, as terraform plan -detailed-exitcode's: errors stay 1, as
// every kpipe command's.
const diffExitCode = 2

// listTimeout bounds listing the objects from the apiserver.
const listTimeout = 30 * time.Second

const renderLong = `Render the rules kpipe writes, with the daemon's flags and --config file, for
the cluster's objects (--kubeconfig, or in-cluster as the daemon) or for a
directory of manifests (--manifests DIR), without touching the kernel.

Without --diff it prints, per IP family the daemon programs here, an
iptables-save style document ("# kpipe render IPv4" starts a family; then
*nat and *filter with every chain, kpipe's jumps in the built-in chains, and
COMMIT), which "kpipe explain --rules FILE" reads.

--manifests DIR reads every *.yaml, *.yml and *.json file in DIR (not its
subdirectories): Services, EndpointSlices and Nodes, one or several to a file
("---"), or in a List, as "kubectl get svc,endpointslices,node -o yaml" writes
them. A file that does not parse, or that holds any other kind of object, is
an error naming it. Only the Node named as the daemon names its node
(--hostname-override, or the host name) is used. Invalid parts of objects are
dropped as the daemon drops them (a count is printed on stderr).

The IP families, and what the rules depend on of the host (MASQUERADE
--random-fully, the nfacct objects, nf_conntrack_tcp_be_liberal), are read
from this host as the daemon reads them, writing nothing.

--diff compares the rendering with the node's rules (iptables-save, nat and
filter) chain by chain: kpipe's chains, and the jumps it ensures in the
built-in chains (a missing one shows); never other agents' chains or rules,
nor what kpipe leaves in place. It prints a unified diff by chain of what a
sync would change: "--- live" and "+++ rendered" per family, "@@ table CHAIN @@"
per chain, rules with - and + (a chain only one side has: its ":CHAIN -"
declaration first). Rules are compared as kpipe reads them, so iptables-save's
spelling of a rule equals render's.

Exit codes: 0 rendered (with --diff: no difference, nothing printed);
2 with --diff: the rules differ; 1 an error.`

// renderCommand is `kpipe render`.
func renderCommand() *cobra.Command {
	opts := defaultOptions()
	var manifests string
	var diff bool
	cmd := &cobra.Command{
		Use:   "render",
		Short: "Print the rules kpipe would write (or --diff them against the node's), writing nothing",
		Long:  renderLong,
		RunE: func(cmd *cobra.Command, args []string) error {
			err := runRender(cmd, args, opts, manifests, diff)
			var code exitCode
			if err != nil && !errors.As(err, &code) {
				return fmt.Errorf("render: %w", err)
			}
			return err
		},
	}
	opts.addFlags(cmd.Flags())
	cmd.Flags().StringVar(&manifests, "manifests", "", "Render for the Service, EndpointSlice and Node manifests in this directory instead of the apiserver's objects.")
	cmd.Flags().BoolVar(&diff, "diff", false, "Print how the node's rules differ from the rendering (exit 2 when they do).")
	return cmd
}

// runRender renders for opts' objects and prints the rules or the diff.
func runRender(cmd *cobra.Command, args []string, opts *Options, manifests string, diff bool) error {
	if len(args) > 0 {
		return fmt.Errorf("unexpected arguments %q: render takes only flags", args)
	}
	fs := cmd.Flags()
	if manifests != "" && (fs.Changed("kubeconfig") || fs.Changed("master")) {
		return errors.New("--manifests and --kubeconfig (or --master): give one source of objects")
	}
	if err := opts.finish(fs); err != nil {
		return err
	}
	objs, err := renderObjects(cmd.Context(), opts, manifests)
	if err != nil {
		return err
	}
	warn := cmd.ErrOrStderr()
	if objs.skipped > 0 {
		fmt.Fprintf(warn, "kpipe render: %d invalid parts of objects skipped, as the daemon skips them\n", objs.skipped)
	}
	if objs.state.Node == nil {
		fmt.Fprintf(warn, "kpipe render: no Node %q: rendered as the daemon renders before it sees its Node\n", opts.HostnameOverride)
	}
	if len(opts.nodePortCIDRs) > 0 { // the daemon reads them then (watch.Params.WatchAddrs)
		if objs.state.LocalAddrs, err = nf.LocalAddrs(); err != nil {
			return err
		}
	}
	sets := renderRulesets(opts, &objs.state)
	if !diff {
		return nf.WriteRulesets(cmd.OutOrStdout(), sets)
	}
	return diffWithNode(cmd.Context(), cmd.OutOrStdout(), sets)
}

// renderObjects are the objects to render for: the manifests', or the
// apiserver's.
func renderObjects(ctx context.Context, opts *Options, manifests string) (*objects, error) {
	if manifests != "" {
		return readManifests(manifests, opts.HostnameOverride)
	}
	client, err := newClient(opts)
	if err != nil {
		if opts.Kubeconfig == "" && opts.Master == "" {
			return nil, fmt.Errorf("give --kubeconfig or --manifests (%v)", err)
		}
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	return listObjects(ctx, client, opts.HostnameOverride)
}

// renderRulesets renders state for every family the daemon programs on this
// host, as its render stage renders a full sync, with the jumps its commit
// stage ensures.
func renderRulesets(opts *Options, state *bus.State) []nf.Ruleset {
	quiet := slog.New(slog.DiscardHandler)
	host := observeHost(quiet)
	var sets []nf.Ruleset
	for _, f := range hostFamilies(quiet) {
		fo := opts.forFamily(f, host)
		plan := render.Render(fo.render, &bus.Snapshot{State: *state, Full: true})
		sets = append(sets, nf.PlanRuleset(plan, nf.FreshBuiltins(nf.Jumps(fo.localhostNodePorts))))
	}
	return sets
}

// diffWithNode prints how the node's rules differ from sets, family by
// family; differences end the command with diffExitCode.
func diffWithNode(ctx context.Context, out io.Writer, sets []nf.Ruleset) error {
	differ := false
	for _, rs := range sets {
		live, err := nf.Tool{Family: rs.Family}.SavedRuleset(ctx)
		if err != nil {
			return err
		}
		diffs := diffRuleset(*live, rs)
		if err := writeDiff(out, rs.Family.String(), diffs); err != nil {
			return err
		}
		differ = differ || len(diffs) > 0
	}
	if differ {
		return exitCode(diffExitCode)
	}
	return nil
}
