// Package watch turns the apiserver's Services, EndpointSlices and this node's Node
// (and the host's addresses) into change events for coalesce.
package watch

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	nf "github.com/kpipe/kpipe/netfilter"
)

// selector is kube-proxy's: services handled by another proxy, and headless
// services' slices, are not ours.
const selector = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"

// Stage runs the informers and sends every change, and a full replay when coalesce
// asks for one, on out.
type Stage struct {
	client     kubernetes.Interface
	conv       Converter
	out        chan<- bus.Change
	replay     *bus.ReplayFlag
	status     bus.Reporter
	metrics    *metrics.Metrics
	log        *slog.Logger
	watchAddrs bool

	// subscribe starts the netlink address watch; tests replace it.
	subscribe func(done <-chan struct{}) (<-chan netlink.AddrUpdate, error)
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
	Out      chan<- bus.Change
	Replay   *bus.ReplayFlag // coalesce asks for the whole state
	// WatchAddrs turns on the netlink address watch (needed for --nodeport-addresses).
	WatchAddrs bool
	Env        bus.Env
}

// NewStage makes the watch stage.
func NewStage(p Params) *Stage {
	return &Stage{client: p.Client, conv: Converter{NodeName: p.NodeName}, out: p.Out, replay: p.Replay, status: p.Env.Status,
		metrics: p.Env.Metrics, log: p.Env.Log, watchAddrs: p.WatchAddrs, subscribe: nf.SubscribeAddrs}
}

type informerSet struct {
	services, slices, nodes cache.SharedIndexInformer
}

// Run watches until ctx ends (then it returns nil) or something fails: the address
// watch closes, or a handler or a replay panics. Then it returns the error, so the
// supervisor restarts it, and the restart replays.
func (s *Stage) Run(ctx context.Context) error {
	// run ends the informers, and any send their handlers block in, whenever Run
	// returns: Shutdown waits for them, and ctx may still be live.
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

	factory := informers.NewSharedInformerFactoryWithOptions(s.client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }))
	nodeFactory := informers.NewSharedInformerFactoryWithOptions(s.client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = "metadata.name=" + s.conv.NodeName }))
	inf := informerSet{
		services: factory.Core().V1().Services().Informer(),
		slices:   factory.Discovery().V1().EndpointSlices().Informer(),
		nodes:    nodeFactory.Core().V1().Nodes().Informer(),
	}
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
					s.send(run, c)
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
	for _, reg := range []struct {
		inf cache.SharedIndexInformer
		fn  func(obj any, deleted bool) (bus.Change, bool)
	}{{inf.services, s.serviceChange}, {inf.slices, s.sliceChange}, {inf.nodes, s.nodeChange}} {
		if _, err := reg.inf.AddEventHandler(handler(reg.fn)); err != nil {
			return fmt.Errorf("watch: add event handler: %w", err)
		}
	}
	factory.Start(run.Done())
	nodeFactory.Start(run.Done())
	// Deferred after stop, so they run after it: Shutdown returns once run is done.
	defer factory.Shutdown()
	defer nodeFactory.Shutdown()
	defer stop()

	addrs, err := s.subscribeAddrs(run)
	if err != nil {
		return err
	}
	if !cache.WaitForCacheSync(run.Done(), inf.services.HasSynced, inf.slices.HasSynced, inf.nodes.HasSynced) {
		return ended()
	}
	s.log.Info("informer caches synced")
	s.sendMu.Lock()
	synced = true
	s.sendMu.Unlock()
	if err := s.catch("replay", func() { s.sendReplay(run, inf) }); err != nil {
		return err
	}
	s.replay.Lower() // the replay just sent answers any request made before it
	for {
		select {
		case <-run.Done():
			return ended()
		case <-s.replay.C():
			if err := s.catch("replay", func() { s.sendReplay(run, inf) }); err != nil {
				return err
			}
		case _, ok := <-addrs:
			if !ok {
				return fmt.Errorf("watch: netlink address subscription closed")
			}
			if err := s.catch("address update", func() { s.sendAddrs(run) }); err != nil {
				return err
			}
		}
	}
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
	// Collapse bursts of updates into one signal.
	signal := make(chan struct{}, 1)
	go func() {
		defer close(signal)
		for range updates {
			select {
			case signal <- struct{}{}:
			default:
			}
		}
	}()
	return signal, nil
}

func (s *Stage) sendAddrs(ctx context.Context) {
	addrs, err := nf.LocalAddrs()
	if err != nil {
		s.log.Error("read local addresses", "err", err)
		return
	}
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	s.send(ctx, bus.Change{Kind: bus.LocalAddrsChanged, Addrs: addrs})
}

// send blocks until coalesce takes the change or ctx ends.
func (s *Stage) send(ctx context.Context, c bus.Change) {
	if s.beforeSend != nil {
		s.beforeSend(c)
	}
	select {
	case s.out <- c:
	case <-ctx.Done():
	}
}

func (s *Stage) sendReplay(ctx context.Context, inf informerSet) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	st := &bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}}
	for _, obj := range inf.services.GetStore().List() {
		if svc := s.service(obj.(*corev1.Service)); svc != nil {
			st.Services[svc.ServiceKey] = svc
		}
	}
	for _, obj := range inf.slices.GetStore().List() {
		if sl := s.slice(obj.(*discoveryv1.EndpointSlice)); sl != nil {
			if st.Slices[sl.Service] == nil {
				st.Slices[sl.Service] = map[string]*bus.EndpointSlice{}
			}
			st.Slices[sl.Service][sl.Name] = sl
		}
	}
	for _, obj := range inf.nodes.GetStore().List() {
		st.Node = s.node(obj.(*corev1.Node))
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
	s.send(ctx, bus.Change{Kind: bus.Replayed, Replay: st})
}

func (s *Stage) serviceChange(obj any, deleted bool) (bus.Change, bool) {
	svc, ok := obj.(*corev1.Service)
	if !ok {
		return bus.Change{}, false
	}
	c := bus.Change{Kind: bus.ServiceChanged, Key: bus.ServiceKey{Namespace: svc.Namespace, Name: svc.Name}}
	if !deleted {
		c.Service = s.service(svc)
	}
	return c, true
}

func (s *Stage) sliceChange(obj any, deleted bool) (bus.Change, bool) {
	sl, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return bus.Change{}, false
	}
	name := sl.Labels[discoveryv1.LabelServiceName]
	if name == "" {
		s.reportSkips(sl.Namespace+"/"+sl.Name, []skip{{"EndpointSlice", "no-service-name", "label " + discoveryv1.LabelServiceName + " missing"}})
		return bus.Change{}, false
	}
	c := bus.Change{Kind: bus.SliceChanged, Key: bus.ServiceKey{Namespace: sl.Namespace, Name: name}, SliceName: sl.Name}
	if !deleted {
		c.Slice = s.slice(sl)
	}
	return c, true
}

func (s *Stage) nodeChange(obj any, deleted bool) (bus.Change, bool) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return bus.Change{}, false
	}
	node := s.node(n)
	if deleted {
		node.Deleting = true
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

func (s *Stage) service(svc *corev1.Service) *bus.Service {
	out, skips := s.conv.Service(svc)
	s.reportSkips(svc.Namespace+"/"+svc.Name, skips)
	return out
}

func (s *Stage) slice(sl *discoveryv1.EndpointSlice) *bus.EndpointSlice {
	out, skips := s.conv.Slice(sl)
	s.reportSkips(sl.Namespace+"/"+sl.Name, skips)
	return out
}

func (s *Stage) node(n *corev1.Node) *bus.Node {
	node := s.conv.Node(n)
	s.status.Update(func(r *bus.Report) { r.NodeDeleting = node.Deleting; r.LastQueued = time.Now() })
	return node
}

func (s *Stage) reportSkips(object string, skips []skip) {
	for _, sk := range skips {
		s.metrics.Skipped.WithLabelValues(sk.kind, sk.reason).Inc()
		s.log.Warn("skipping invalid part of object", "kind", sk.kind, "object", object, "reason", sk.reason, "detail", sk.detail)
	}
}
