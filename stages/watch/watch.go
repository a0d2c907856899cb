// Package watch turns the apiserver's Services, EndpointSlices and this node's Node
// (and the host's addresses) into change events for coalesce.
package watch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/supervise"
)

// Selector is kube-proxy's: services handled by another proxy, and headless
// services' slices, are not ours.
const Selector = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"

// Stage runs the informers and queues every change, and a full replay when
// coalesce asks for one, on out. Queuing never blocks (out keeps the latest
// change per object), so the informers' handlers never stall.
type Stage struct {
	client     kubernetes.Interface
	conv       Converter
	out        *bus.ChangeQueue
	replay     *bus.ReplayFlag
	status     bus.Reporter
	metrics    *metrics.Metrics
	log        *slog.Logger
	watchAddrs bool

	// subscribe starts the netlink address watch; tests replace it.
	subscribe func(done <-chan struct{}) (<-chan netlink.AddrUpdate, error)
	// probe asks the apiserver whether it answers and returns its current
	// resourceVersion; probeBackoff spaces the probes while it does not (see
	// lostServer); tests replace them.
	probe        func(context.Context) (resourceVersion string, err error)
	probeBackoff supervise.Backoff
	// beforeSend, when set, sees every change just before it is sent; tests use it
	// to fail inside a handler or a replay.
	beforeSend func(bus.Change)

	// sendMu orders handler sends against replays: a replay is read from the informer
	// caches and sent under it, so no older event can follow a newer replay.
	sendMu sync.Mutex
	// lastNode is the Node last sent (guarded by sendMu): the kubelet updates its
	// Node every few seconds, and most updates change nothing kpipe uses.
	lastNode *bus.Node
}

// Params wire the watch stage.
type Params struct {
	Client   kubernetes.Interface
	NodeName string
	Out      *bus.ChangeQueue
	Replay   *bus.ReplayFlag // coalesce asks for the whole state
	// WatchAddrs turns on the netlink address watch (needed for --nodeport-addresses).
	WatchAddrs bool
	Env        bus.Env
}

// NewStage makes the watch stage.
func NewStage(p Params) *Stage {
	return &Stage{client: p.Client, conv: Converter{NodeName: p.NodeName}, out: p.Out, replay: p.Replay, status: p.Env.Status,
		metrics: p.Env.Metrics, log: p.Env.Log, watchAddrs: p.WatchAddrs, subscribe: nf.SubscribeAddrs,
		probe: func(ctx context.Context) (string, error) {
			// This node's Node, read as an informer's list does (consistent):
			// a small answer that carries the apiserver's resourceVersion.
			l, err := p.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + p.NodeName})
			if err != nil {
				return "", err
			}
			return l.ResourceVersion, nil
		},
		// From 1 s to 5 s: soon after the apiserver is back, without thousands of
		// nodes hammering it while it is away.
		probeBackoff: supervise.Backoff{Initial: time.Second, Max: 5 * time.Second}}
}

type informerSet struct {
	services, slices, nodes cache.SharedIndexInformer
}

// Run watches until ctx ends (then it returns nil) or something fails: the address
// watch closes, or a handler or a replay panics. Then it returns the error, so the
// supervisor restarts it, and the restart replays. When the apiserver was lost
// and answers again with resourceVersions older than the informers hold (etcd
// restored from a snapshot), Run lists everything anew and replays it itself.
func (s *Stage) Run(ctx context.Context) error {
	// run ends the informers whenever Run returns; ctx may still be live.
	run, stop := context.WithCancel(ctx)
	defer stop()
	failed := make(chan error, 1)
	fail := func(err error) {
		select {
		case failed <- err:
		default: // the first failure is the one reported
		}
		stop()
	}
	// ended is Run's result once run is done: the failure, or nil when ctx ended.
	ended := func() error {
		select {
		case err := <-failed:
			return err
		default:
			return nil
		}
	}
	addrs, err := s.subscribeAddrs(run)
	if err != nil {
		return err
	}
	for {
		again, err := s.watchOnce(run, addrs, fail)
		if err != nil {
			return err
		}
		if !again {
			return ended()
		}
		s.log.Warn("apiserver answers again with older resourceVersions than kpipe saw (etcd restored?); listing everything anew")
	}
}

// watchOnce runs one set of informers: it waits for their caches, replays, and
// sends their events until run ends (false) or the apiserver, lost by the
// informers, answers again from an earlier point in time (true): their watches
// would wait, silent, until the restored store passed the resourceVersions
// they hold. New informers list what it holds now. A relist writes nothing to
// the kernel that is already there.
func (s *Stage) watchOnce(run context.Context, addrs <-chan struct{}, fail func(error)) (again bool, err error) {
	gen, cancel := context.WithCancel(run)
	back := make(chan struct{}, 1)
	lost := &lostServer{ctx: gen, probe: s.probe, backoff: s.probeBackoff, wentBack: back}
	inf := s.informers(lost)
	lost.held = inf.resourceVersions
	synced := false // guarded by sendMu: events before the first replay are redundant
	handler := func(toChange func(obj any, deleted bool) (bus.Change, bool)) cache.ResourceEventHandlerFuncs {
		send := func(obj any, deleted bool) {
			err := s.catch("event handler", func() {
				s.sendMu.Lock()
				defer s.sendMu.Unlock()
				if !synced {
					return
				}
				if c, ok := toChange(obj, deleted); ok {
					s.send(c)
				}
			})
			if err != nil {
				fail(err)
			}
		}
		return cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { send(obj, false) },
			UpdateFunc: func(_, obj any) { send(obj, false) },
			DeleteFunc: func(obj any) {
				if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
					obj = t.Obj
				}
				send(obj, true)
			},
		}
	}
	var running sync.WaitGroup
	// Runs last: the informers (and any send their handlers block in) end with gen.
	defer running.Wait()
	defer cancel()
	for _, reg := range []struct {
		inf cache.SharedIndexInformer
		fn  func(obj any, deleted bool) (bus.Change, bool)
	}{{inf.services, s.serviceChange}, {inf.slices, s.sliceChange}, {inf.nodes, s.nodeChange}} {
		if _, err := reg.inf.AddEventHandler(handler(reg.fn)); err != nil {
			return false, fmt.Errorf("watch: add event handler: %w", err)
		}
		running.Add(1)
		go func() {
			defer running.Done()
			reg.inf.RunWithContext(gen)
		}()
	}

	if !s.waitForCaches(gen, back, inf) {
		return gen.Err() == nil, nil // back: the apiserver answers again
	}
	s.log.Info("informer caches synced")
	s.sendMu.Lock()
	synced = true
	s.sendMu.Unlock()
	if err := s.catch("replay", func() { s.sendReplay(inf) }); err != nil {
		return false, err
	}
	s.replay.Lower() // the replay just sent answers any request made before it
	for {
		select {
		case <-gen.Done():
			return false, nil
		case <-back:
			return true, nil
		case <-s.replay.C():
			if err := s.catch("replay", func() { s.sendReplay(inf) }); err != nil {
				return false, err
			}
		case _, ok := <-addrs:
			if !ok {
				if run.Err() != nil {
					// closed because Run is ending (the subscription follows run:
					// its cancellation reaches gen only after run's Done closes)
					return false, nil
				}
				return false, fmt.Errorf("watch: netlink address subscription closed")
			}
			if err := s.catch("address update", func() { s.sendAddrs() }); err != nil {
				return false, err
			}
		}
	}
}

// waitForCaches waits until the informers' caches synced (true), ctx ends or
// the apiserver answers again from an earlier point in time (false). It asks
// every 10 ms, not client-go's 100: the first sync starts that much sooner.
func (s *Stage) waitForCaches(ctx context.Context, back <-chan struct{}, inf informerSet) bool {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if inf.services.HasSynced() && inf.slices.HasSynced() && inf.nodes.HasSynced() {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-back:
			return false
		case <-tick.C:
		}
	}
}

// informers makes the Service, EndpointSlice and Node informers (kube-proxy's
// selectors), each list and watch made through lost.
func (s *Stage) informers(lost *lostServer) informerSet {
	services, slices, nodes := s.client.CoreV1().Services(""), s.client.DiscoveryV1().EndpointSlices(""), s.client.CoreV1().Nodes()
	proxied := func(o *metav1.ListOptions) { o.LabelSelector = Selector }
	thisNode := func(o *metav1.ListOptions) { o.FieldSelector = "metadata.name=" + s.conv.NodeName }
	return informerSet{
		services: informer(&corev1.Service{}, proxied, lost, s.conv.convertForStore, services.List, services.Watch),
		slices:   informer(&discoveryv1.EndpointSlice{}, proxied, lost, s.conv.convertForStore, slices.List, slices.Watch),
		nodes:    informer(&corev1.Node{}, thisNode, lost, s.conv.convertForStore, nodes.List, nodes.Watch),
	}
}

// resourceVersions are the informers' last resourceVersions.
func (inf informerSet) resourceVersions() []string {
	return []string{inf.services.LastSyncResourceVersion(), inf.slices.LastSyncResourceVersion(), inf.nodes.LastSyncResourceVersion()}
}

// informer makes an informer over list and watch (with tweak applied to their
// options, each call made through lost) that keeps what transform makes of
// each object.
func informer[L runtime.Object](obj runtime.Object, tweak func(*metav1.ListOptions), lost *lostServer, transform cache.TransformFunc,
	list func(context.Context, metav1.ListOptions) (L, error),
	watch func(context.Context, metav1.ListOptions) (k8swatch.Interface, error)) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			tweak(&o)
			return untilAnswered(ctx, lost, func() (runtime.Object, error) { return list(ctx, o) })
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (k8swatch.Interface, error) {
			tweak(&o)
			return untilAnswered(ctx, lost, func() (k8swatch.Interface, error) { return watch(ctx, o) })
		},
	}
	inf := cache.NewSharedIndexInformer(lw, obj, 0, cache.Indexers{})
	_ = inf.SetTransform(transform) // fails only once the informer has started
	return inf
}

// lostServer notices when the informers cannot reach the apiserver and then
// holds their list and watch calls while it probes the apiserver, with a
// backoff, until it answers. Without it, client-go's reflectors would retry on
// their own backoff, which reaches 30 s (a minute with jitter), so a change
// made just after an outage could wait that long; and a call that failed
// otherwise than refused would make them list everything again. Held, they
// resume as soon as the apiserver answers, from the resourceVersions they
// hold, as kube-proxy's informers do: an apiserver restart costs no list of
// Services or EndpointSlices (whatever the apiserver cannot resume it answers
// with 410 Gone, and the reflector lists again, as client-go does). Only an
// apiserver whose resourceVersion went back (etcd restored from a snapshot)
// is not resumed from: then it signals wentBack (once), for new informers.
type lostServer struct {
	ctx      context.Context // the informers': probes end with them
	probe    func(context.Context) (string, error)
	backoff  supervise.Backoff
	held     func() []string // the informers' resourceVersions
	wentBack chan<- struct{}

	mu sync.Mutex
	// answered is closed when the apiserver answers again; nil while it is
	// not known to be lost.
	answered chan struct{}
}

// untilAnswered makes call, and again each time it fails without an answer
// from the apiserver, once the apiserver answers again: its caller (the
// reflector) sees only the apiserver's answers, or ctx's end.
func untilAnswered[T any](ctx context.Context, l *lostServer, call func() (T, error)) (T, error) {
	for {
		if err := l.wait(ctx); err != nil {
			var none T
			return none, err
		}
		out, err := call()
		if err == nil || !unreachable(err) || ctx.Err() != nil {
			return out, err
		}
		l.lost()
	}
}

// wait waits while the apiserver is lost, until it answers or ctx ends.
func (l *lostServer) wait(ctx context.Context) error {
	l.mu.Lock()
	answered := l.answered
	l.mu.Unlock()
	if answered == nil {
		return nil
	}
	select {
	case <-answered:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// lost starts the probes, unless they run.
func (l *lostServer) lost() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.answered != nil {
		return
	}
	l.answered = make(chan struct{})
	go l.probeUntilAnswered(l.answered)
}

// probeUntilAnswered probes until the apiserver answers. Then it releases the
// held calls or, when the apiserver's resourceVersion is older than one the
// informers hold, signals wentBack and holds them until l.ctx ends.
func (l *lostServer) probeUntilAnswered(answered chan struct{}) {
	for n := 1; ; n++ {
		select {
		case <-l.ctx.Done():
			return
		case <-time.After(l.backoff.Delay(n, nil)):
		}
		rv, err := l.probe(l.ctx)
		if err != nil {
			continue
		}
		if olderThanAny(rv, l.held()) {
			l.wentBack <- struct{}{} // buffered: the only send
			return
		}
		l.mu.Lock()
		l.answered = nil
		l.mu.Unlock()
		close(answered)
		return
	}
}

// olderThanAny says whether resourceVersion rv is older than one of held.
// resourceVersions are opaque to clients, but kube-apiserver's are etcd's
// revisions, which go back only when etcd is restored from a snapshot; ones
// that are not numbers are not compared.
func olderThanAny(rv string, held []string) bool {
	now, err := strconv.ParseUint(rv, 10, 64)
	if err != nil {
		return false
	}
	for _, h := range held {
		if v, err := strconv.ParseUint(h, 10, 64); err == nil && v > now {
			return true
		}
	}
	return false
}

// unreachable says whether a list or watch failed without an answer from the
// apiserver (an answer, such as 429 or 410, is the reflector's to handle).
func unreachable(err error) bool {
	var status apierrors.APIStatus
	return !errors.As(err, &status) && !errors.Is(err, context.Canceled)
}

// catch runs f and turns a panic in it into an error, logged with its stack: on
// client-go's goroutines a panic would bypass the supervisor and end the process.
func (s *Stage) catch(where string, f func()) (err error) {
	defer func() {
		if v := recover(); v != nil {
			s.log.Error("watch panicked", "in", where, "panic", v, "stack", string(debug.Stack()))
			err = fmt.Errorf("watch: panic in %s: %v", where, v)
		}
	}()
	f()
	return nil
}

func (s *Stage) subscribeAddrs(ctx context.Context) (<-chan struct{}, error) {
	if !s.watchAddrs {
		return nil, nil
	}
	updates, err := s.subscribe(ctx.Done())
	if err != nil {
		return nil, err
	}
	// Collapse bursts of updates into one signal. It ends with ctx, whether or
	// not the subscription closes its channel then.
	signal := make(chan struct{}, 1)
	go func() {
		defer close(signal)
		for {
			select {
			case <-ctx.Done():
				return
			case _, ok := <-updates:
				if !ok {
					return
				}
				select {
				case signal <- struct{}{}:
				default:
				}
			}
		}
	}()
	return signal, nil
}

func (s *Stage) sendAddrs() {
	addrs, err := nf.LocalAddrs()
	if err != nil {
		s.log.Error("read local addresses", "err", err)
		return
	}
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	s.send(bus.Change{Kind: bus.LocalAddrsChanged, Addrs: addrs})
}

// send queues c for coalesce; it never blocks. Every Service and EndpointSlice
// update is counted here, as kube-proxy counts them in its change trackers,
// though the queue may fold several into one.
func (s *Stage) send(c bus.Change) {
	if s.beforeSend != nil {
		s.beforeSend(c)
	}
	switch c.Kind {
	case bus.ServiceChanged:
		s.metrics.ServiceChanges.Inc()
	case bus.SliceChanged:
		s.metrics.EndpointChanges.Inc()
	}
	s.out.Put(c)
}

func (s *Stage) sendReplay(inf informerSet) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	st := &bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}}
	for _, obj := range inf.services.GetStore().List() {
		if svc := s.converted(obj).service; svc != nil {
			st.Services[svc.ServiceKey] = svc
		}
	}
	for _, obj := range inf.slices.GetStore().List() {
		if sl := s.converted(obj).slice; sl != nil {
			if st.Slices[sl.Service] == nil {
				st.Slices[sl.Service] = map[string]*bus.EndpointSlice{}
			}
			st.Slices[sl.Service][sl.Name] = sl
		}
	}
	for _, obj := range inf.nodes.GetStore().List() {
		st.Node = s.node(s.converted(obj).node)
	}
	s.lastNode = st.Node
	if s.watchAddrs {
		if addrs, err := nf.LocalAddrs(); err == nil {
			st.LocalAddrs = addrs
		} else {
			s.log.Error("read local addresses", "err", err)
		}
	}
	s.log.Debug("replaying state", "services", len(st.Services), "slices", len(inf.slices.GetStore().ListKeys()))
	s.send(bus.Change{Kind: bus.Replayed, Replay: st})
}

func (s *Stage) serviceChange(obj any, deleted bool) (bus.Change, bool) {
	st, ok := obj.(*stored)
	if !ok {
		return bus.Change{}, false
	}
	c := bus.Change{Kind: bus.ServiceChanged, Key: bus.ServiceKey{Namespace: st.namespace, Name: st.name}}
	if !deleted {
		c.Service = s.converted(st).service
	}
	return c, true
}

func (s *Stage) sliceChange(obj any, deleted bool) (bus.Change, bool) {
	st, ok := obj.(*stored)
	if !ok {
		return bus.Change{}, false
	}
	if st.sliceService == "" {
		s.reportSkips(st.namespace+"/"+st.name, []skip{{"EndpointSlice", "no-service-name", "label " + discoveryv1.LabelServiceName + " missing"}})
		return bus.Change{}, false
	}
	c := bus.Change{Kind: bus.SliceChanged, Key: bus.ServiceKey{Namespace: st.namespace, Name: st.sliceService}, SliceName: st.name}
	if !deleted {
		c.Slice = s.converted(st).slice
	}
	return c, true
}

func (s *Stage) nodeChange(obj any, deleted bool) (bus.Change, bool) {
	st, ok := obj.(*stored)
	if !ok {
		return bus.Change{}, false
	}
	node := s.node(s.converted(st).node)
	if deleted {
		gone := *node // the stored value is shared: never changed
		gone.Deleting = true
		node = &gone
	}
	if sameNode(node, s.lastNode) {
		return bus.Change{}, false
	}
	s.lastNode = node
	return bus.Change{Kind: bus.NodeChanged, Node: node}, true
}

// sameNode says whether a and b hold the same values (nil only equals nil).
func sameNode(a, b *bus.Node) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Name == b.Name && a.Zone == b.Zone && a.Deleting == b.Deleting &&
		slices.Equal(a.Addrs, b.Addrs) && slices.Equal(a.PodCIDRs, b.PodCIDRs)
}

// converted is what the informers keep of obj (a *stored), its skips reported
// as it is sent. A conversion that panicked panics again here, inside catch.
func (s *Stage) converted(obj any) *stored {
	st := obj.(*stored)
	if st.panicked != nil {
		panic(st.panicked)
	}
	s.reportSkips(st.namespace+"/"+st.name, st.skips)
	return st
}

func (s *Stage) node(node *bus.Node) *bus.Node {
	s.status.Update(func(r *bus.Report) { r.NodeDeleting = node.Deleting; r.LastQueued = time.Now() })
	return node
}

func (s *Stage) reportSkips(object string, skips []skip) {
	for _, sk := range skips {
		s.metrics.Skipped.WithLabelValues(sk.kind, sk.reason).Inc()
		s.log.Warn("skipping invalid part of object", "kind", sk.kind, "object", object, "reason", sk.reason, "detail", sk.detail)
	}
}
