package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/spf13/pflag"
	k8sevents "k8s.io/client-go/tools/events"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/stages/events"
	"github.com/kpipe/kpipe/stages/health"
	"github.com/kpipe/kpipe/supervise"
)

// Where kube-proxy exits when its config file changes (and its pod restarts),
// kpipe rebuilds its tree in place: the rules stay in the kernel and keep
// serving while the new tree takes them over, as a restarted process would.

const (
	// settleDelay lets an edit finish (an editor's several writes, a ConfigMap's
	// symlink swap) before the file is read.
	settleDelay = 200 * time.Millisecond
	// pollInterval rereads the file even without a notification: a watch on a
	// directory that was replaced (a remounted volume) notices nothing more.
	pollInterval = 10 * time.Second
)

// watchConfigFile sends on the returned channel whenever the content of path
// differs from what it last read. It watches path's directory, not path itself:
// a ConfigMap volume updates by swapping the ..data symlink, which leaves a
// watch on the old file's inode silent. It stops when ctx ends; path "" gives
// a channel that never sends.
func watchConfigFile(ctx context.Context, path string, log *slog.Logger) <-chan struct{} {
	changed := make(chan struct{}, 1)
	if path == "" {
		return changed
	}
	last, _ := os.ReadFile(path)
	events := make(<-chan fsnotify.Event)
	w, err := fsnotify.NewWatcher()
	if err == nil {
		err = w.Add(filepath.Dir(path))
	}
	if err != nil {
		log.Warn("cannot watch the config file; rereading it every "+pollInterval.String(), "path", path, "err", err)
	} else {
		events = w.Events
	}
	go func() {
		if w != nil {
			defer w.Close()
		}
		poll := time.NewTicker(pollInterval)
		defer poll.Stop()
		var settle <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case <-events:
				settle = time.After(settleDelay)
				continue
			case <-poll.C:
			case <-settle:
				settle = nil
			}
			now, err := os.ReadFile(path)
			if err != nil || bytes.Equal(now, last) {
				continue // a missing file mid-swap is read again at the next event or poll
			}
			last = now
			select {
			case changed <- struct{}{}:
			default: // one wake-up is pending already; it rereads the file
			}
		}
	}()
	return changed
}

// reread parses the command line again over the config file as it is now: the
// options a restarted kpipe would run with.
func (o *Options) reread() (*Options, error) {
	n := defaultOptions()
	n.args = o.args
	fs := pflag.NewFlagSet("kpipe", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	n.addFlags(fs)
	if err := fs.Parse(o.args); err != nil {
		return nil, err
	}
	if err := n.finish(fs); err != nil {
		return nil, err
	}
	return n, nil
}

// sameAs says whether o and p run the same configuration: the fields a
// lenient decoding left out of the file do not count.
func (o *Options) sameAs(p *Options) bool {
	a, b := *o, *p
	a.lenientDecode, b.lenientDecode = nil, nil
	a.gate, b.gate = nil, nil // made from FeatureGates, which are compared
	return reflect.DeepEqual(&a, &b)
}

// runReloading runs a tree built from o and d until ctx ends or the tree gives
// up. Each time the config file changes into valid options that differ, it
// makes the deps for them (reconfigure: a new apiserver client, the node set up
// again), stops the tree, leaving the rules in place, and runs one built from
// the new options. A change that does not parse, check or connect is rejected
// and the running tree carries on.
func runReloading(ctx context.Context, o *Options, d deps, changed <-chan struct{},
	reconfigure func(*Options, deps) (deps, error)) error {
	var afterSyncDone atomic.Bool
	pending := newPendingWork() // outlives the trees: a reload carries their work over
	if d.reloads == nil {
		d.reloads = &health.Reloads{} // outlives the trees too
	}
	for {
		d.log.Info("kpipe starting", "node", o.HostnameOverride, "families", fmt.Sprint(d.families()), "mode", "iptables")
		d.board, d.pending, d.fatal = bus.NewBoard(), pending, make(chan error, 1)
		treeCtx, stopTree := context.WithCancel(ctx)
		if d.afterSync != nil && !afterSyncDone.Load() {
			go func(board *bus.Board, families []bus.Family, afterSync func(context.Context, *slog.Logger), log *slog.Logger) {
				if waitFullSyncs(treeCtx, board, families) {
					afterSync(treeCtx, log)
					afterSyncDone.Store(true)
				}
			}(d.board, d.families(), d.afterSync, d.log)
		}
		next, nextDeps, err := runUntilReload(treeCtx, buildTree(o, d), o, d, changed, reconfigure)
		stopTree()
		d.broadcaster.Shutdown() // the stopped tree's events
		if err != nil {
			return err // serve logs it
		}
		if next == nil {
			d.log.Info("kpipe stopped; rules left in place")
			return nil
		}
		o, d = next, nextDeps
	}
}

// runUntilReload runs root until ctx ends, root gives up or a stage sends
// d.fatal (the error), or until the config file changes into options that
// differ from o and whose deps can be made: then it stops root and returns them.
func runUntilReload(ctx context.Context, root *supervise.Supervisor, o *Options, d deps, changed <-chan struct{},
	reconfigure func(*Options, deps) (deps, error)) (*Options, deps, error) {
	treeCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- root.Run(treeCtx) }()
	report := d.reloadReporter(o)
	for {
		select {
		case err := <-done:
			return nil, deps{}, err
		case err := <-d.fatal:
			d.recordFatal(o.HostnameOverride, err)
			return nil, deps{}, err
		case <-changed:
			n, err := o.reread()
			if err == nil {
				n.logLenientDecode(d.log)
			}
			if err == nil && n.sameAs(o) {
				report.accepted(true)
				continue
			}
			var nd deps
			if err == nil {
				nd, err = reconfigure(n, d)
			}
			if err != nil {
				report.rejected(err)
				continue
			}
			report.accepted(false)
			stop()
			if err := <-done; err != nil {
				return nil, deps{}, err
			}
			return n, nd, nil
		}
	}
}

// eventWriteTimeout bounds how long a stopping kpipe waits for its last event
// to reach the apiserver.
const eventWriteTimeout = 5 * time.Second

// recordFatal records kube-proxy's Warning on the Node for err, a port
// bindAddressHardFail requires (health.BindError), and waits for it to be
// written, as kpipe exits next. Starting is written first: kube-proxy records it
// before this Warning, and the events stage sends only once it has started.
func (d deps) recordFatal(node string, err error) {
	var bindErr *health.BindError
	if !errors.As(err, &bindErr) {
		return
	}
	reason := events.ReasonHealthzFailed
	if bindErr.Metrics {
		reason = events.ReasonMetricsFailed
	}
	ctx, cancel := context.WithTimeout(context.Background(), eventWriteTimeout)
	defer cancel()
	d.written.Wait(ctx, events.ReasonStarting)
	events.RecordServerFailure(d.recorder, node, reason, err)
	if !d.written.Wait(ctx, reason) {
		d.log.Warn("the event could not be written before stopping", "reason", reason, "timeout", eventWriteTimeout)
	}
}

// reloadReporter tells of each change of the config file: a log line, kpipe's
// reload metrics and, for a rejected one, a Warning event on the Node.
type reloadReporter struct {
	path     string
	node     string
	log      *slog.Logger
	metrics  *metrics.Metrics
	recorder k8sevents.EventRecorder
	reloads  *health.Reloads // nil: not kept
}

func (r reloadReporter) rejected(err error) {
	r.log.Error("config file rejected; still running on the previous configuration", "path", r.path, "err", err)
	r.metrics.ConfigReloads.WithLabelValues(metrics.ReloadFailure).Inc()
	r.metrics.ConfigReloadSuccessful.Set(0)
	events.RecordReloadFailure(r.recorder, r.node, r.path, err)
	r.reloads.Record(time.Now(), err)
}

func (r reloadReporter) accepted(same bool) {
	r.metrics.ConfigReloads.WithLabelValues(metrics.ReloadSuccess).Inc()
	r.metrics.ConfigReloadSuccessful.Set(1)
	r.reloads.Record(time.Now(), nil)
	if same {
		r.log.Info("config file changed; the effective configuration is the same", "path", r.path)
		return
	}
	r.log.Info("config file changed; rebuilding the pipeline with the new configuration", "path", r.path)
}
