package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/health"
)

// statusTimeout bounds each request to the daemon: a wedged daemon must not
// hang the operator's shell.
const statusTimeout = 3 * time.Second

// shownNames is how many service ports of each list the screen shows; --json
// has all the daemon sent (up to bus.MaxNames).
const shownNames = 10

// statusFlags are kpipe status's flags.
type statusFlags struct {
	metricsAddr, healthzAddr, configFile string
	json                                 bool
}

// statusAnswer is what kpipe status read from the daemon: /status and
// /configz from the metrics listener, /healthz from the healthz listener.
type statusAnswer struct {
	Status health.Status   `json:"status"`
	Config *internalConfig `json:"config,omitempty"`
	// Health is nil when the healthz listener did not answer (HealthError).
	Health      *health.ProxyHealth `json:"health,omitempty"`
	HealthError string              `json:"healthError,omitempty"`
}

func statusCommand() *cobra.Command {
	def := defaultOptions()
	f := statusFlags{metricsAddr: dialable(def.MetricsBindAddress), healthzAddr: dialable(def.HealthzBindAddress)}
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the running kpipe's stages, syncs, config and services without endpoints on one screen",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.fromConfigFile(cmd); err != nil {
				return fmt.Errorf("status: %w", err)
			}
			a, err := f.read(cmd.Context())
			if err != nil {
				return fmt.Errorf("status: %w", err)
			}
			if f.json {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(a)
			}
			printStatus(cmd.OutOrStdout(), a, time.Now())
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.metricsAddr, "metrics-address", f.metricsAddr, "The daemon's metrics listener (its --metrics-bind-address)")
	fs.StringVar(&f.healthzAddr, "healthz-address", f.healthzAddr, "The daemon's healthz listener (its --healthz-bind-address)")
	fs.StringVar(&f.configFile, "config", "", "The daemon's config file: its metricsBindAddress and healthzBindAddress are the listeners read, unless given above")
	fs.BoolVar(&f.json, "json", false, "Print the daemon's answers as one JSON object")
	return cmd
}

// fromConfigFile takes the listeners from the daemon's config file, where the
// flags did not name them.
func (f *statusFlags) fromConfigFile(cmd *cobra.Command) error {
	if f.configFile == "" {
		return nil
	}
	c, _, err := loadConfigFile(f.configFile) // unknown fields: the daemon runs on such a file too
	if err != nil {
		return err
	}
	if !cmd.Flags().Changed("metrics-address") {
		f.metricsAddr = dialable(c.MetricsBindAddress)
	}
	if !cmd.Flags().Changed("healthz-address") {
		f.healthzAddr = dialable(c.HealthzBindAddress)
	}
	return nil
}

// dialable is a bind address as a client reaches it: a wildcard host is this
// host's loopback.
func dialable(bind string) string {
	host, port, err := net.SplitHostPort(bind)
	if err != nil {
		return bind
	}
	if a, err := netip.ParseAddr(host); err == nil && a.IsUnspecified() {
		host = "127.0.0.1"
		if a.Is6() {
			host = "::1"
		}
	}
	return net.JoinHostPort(host, port)
}

// read asks the daemon. The metrics listener must answer; the healthz one
// may not (disabled, or another port): the screen says so.
func (f *statusFlags) read(ctx context.Context) (*statusAnswer, error) {
	a := &statusAnswer{}
	if err := getJSON(ctx, f.metricsAddr, "/status", &a.Status); err != nil {
		return nil, err
	}
	var configz map[string]*internalConfig
	if err := getJSON(ctx, f.metricsAddr, "/configz", &configz); err != nil {
		return nil, err
	}
	a.Config = configz[health.ConfigzKey]
	var ph health.ProxyHealth
	if err := getJSON(ctx, f.healthzAddr, "/healthz", &ph); err != nil {
		a.HealthError = err.Error()
	} else {
		a.Health = &ph
	}
	return a, nil
}

// getJSON decodes the JSON answer of GET http://addr+path into v, whatever
// its code: a 503 from /healthz still carries the health.
func getJSON(ctx context.Context, addr, path string, v any) error {
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return fmt.Errorf("bad address %q: %v", addr, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("no kpipe answers at %s: %s", addr, why(err))
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return fmt.Errorf("%s at %s: 404: not a kpipe that serves it (kube-proxy, or an older kpipe?)", path, addr)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(v); err != nil {
		return fmt.Errorf("%s at %s: HTTP %d, not kpipe's JSON: %v", path, addr, resp.StatusCode, err)
	}
	return nil
}

// why is the short reason a request got no answer: "connection refused",
// not the whole chain of wrapped errors.
func why(err error) string {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("no answer within %s", statusTimeout)
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Err != nil {
		return opErr.Err.Error()
	}
	return err.Error()
}

// printStatus writes the one screen: health, stages, syncs, config, reload and
// the service ports without endpoints. Ages are from now.
func printStatus(w io.Writer, a *statusAnswer, now time.Time) {
	fmt.Fprintln(w, healthLine(a))
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STAGE\tSTATE\tRESTARTS\tLAST ERROR")
	for _, s := range a.Status.Stages {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", s.Name, s.State, s.Restarts, lastError(s, now))
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(tw, "FAMILY\tLAST SYNC\tTOOK\tLAST FULL SYNC\tPENDING")
	for _, f := range a.Status.Families {
		took := "-"
		if !f.LastSync.IsZero() {
			took = (time.Duration(f.LastSyncSeconds * float64(time.Second))).Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", f.Family, ago(f.LastSync, now, "never")+generation(f), took,
			ago(f.LastFullSync, now, "never"), pending(f, now))
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(w, "config:", configLine(a.Config))
	fmt.Fprintln(w, "last reload:", reloadLine(a.Status.LastReload, now))
	for _, f := range a.Status.Families {
		printNames(w, f.Family+" services without endpoints", f.Unserved.NoEndpoints)
		printNames(w, f.Family+" services without local endpoints (traffic policy Local)", f.Unserved.NoLocalEndpoints)
	}
}

// healthLine is the header: the healthz listener's verdict and why.
func healthLine(a *statusAnswer) string {
	node := a.Status.Node
	ph := a.Health
	if ph == nil {
		return fmt.Sprintf("node %s: health unknown: %s", node, a.HealthError)
	}
	var why []string
	for _, f := range a.Status.Families {
		if s, ok := ph.Status[f.Family]; ok && !s.Healthy {
			why = append(why, f.Family+" has had changes pending longer than the health timeout")
		}
	}
	if ph.NodeEligible != nil && !*ph.NodeEligible {
		why = append(why, "the node is being deleted")
	}
	line := fmt.Sprintf("node %s: healthy", node)
	if !ph.Healthy || len(why) > 0 {
		line = fmt.Sprintf("node %s: NOT healthy: %s", node, strings.Join(why, "; "))
	}
	if len(ph.Degraded) > 0 {
		line += fmt.Sprintf(" (degraded: %s failed recently)", strings.Join(ph.Degraded, ", "))
	}
	return line
}

func lastError(s health.StageStatus, now time.Time) string {
	if s.LastError == "" {
		return "-"
	}
	if s.LastErrorAt.IsZero() {
		return s.LastError
	}
	return s.LastError + " (" + ago(s.LastErrorAt, now, "") + ")"
}

func generation(f health.FamilyStatus) string {
	if f.LastSync.IsZero() {
		return ""
	}
	return fmt.Sprintf(" (generation %d)", f.Generation)
}

func pending(f health.FamilyStatus, now time.Time) string {
	if f.PendingSince.IsZero() {
		return "none"
	}
	return fmt.Sprintf("%d service, %d endpoint changes, oldest %s", f.PendingServices, f.PendingEndpoints, ago(f.PendingSince, now, ""))
}

// ago is how long before now t was, "3s ago"; never when t is zero.
func ago(t, now time.Time, never string) string {
	if t.IsZero() {
		return never
	}
	d := now.Sub(t)
	switch {
	case d < time.Second:
		d = d.Round(time.Millisecond)
	case d < time.Minute:
		d = d.Round(100 * time.Millisecond)
	default:
		d = d.Round(time.Second)
	}
	return d.String() + " ago"
}

// configLine is the config in force, the fields operators ask about first.
func configLine(c *internalConfig) string {
	if c == nil {
		return "not served"
	}
	nodePorts := "all"
	if len(c.NodePortAddresses) > 0 {
		nodePorts = strings.Join(c.NodePortAddresses, ",")
	}
	clusterCIDR := "none"
	if len(c.DetectLocal.ClusterCIDRs) > 0 {
		clusterCIDR = strings.Join(c.DetectLocal.ClusterCIDRs, ",")
	}
	return fmt.Sprintf("mode %s, clusterCIDR %s, detectLocalMode %s, masqueradeAll %t, nodePortAddresses %s, syncPeriod %s, minSyncPeriod %s",
		cmp.Or(string(c.Mode), "iptables"), clusterCIDR, cmp.Or(string(c.DetectLocalMode), "ClusterCIDR"), c.Linux.MasqueradeAll,
		nodePorts, c.SyncPeriod.Duration, c.MinSyncPeriod.Duration)
}

func reloadLine(r *health.Reload, now time.Time) string {
	switch {
	case r == nil:
		return "none since start"
	case r.OK:
		return "succeeded " + ago(r.At, now, "")
	default:
		return "FAILED " + ago(r.At, now, "") + ", the previous configuration kept: " + r.Error
	}
}

// printNames lists names under title, shownNames of them, with how many more
// there are; nothing when there are none.
func printNames(w io.Writer, title string, n bus.Names) {
	if n.Total == 0 {
		return
	}
	fmt.Fprintf(w, "\n%s (%d):\n", title, n.Total)
	shown := n.First[:min(len(n.First), shownNames)]
	for _, name := range shown {
		fmt.Fprintln(w, "  "+name)
	}
	if more := n.Total - len(shown); more > 0 {
		fmt.Fprintf(w, "  and %d more\n", more)
	}
}
