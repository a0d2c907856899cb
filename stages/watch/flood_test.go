package watch

import (
	"context"
	"fmt"
	goruntime "runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	k8swatch "k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kpipe/kpipe/bus"
)

// TestFloodIsBoundedByObjects: 50,000 Service updates in 10 s (100 services, 500
// updates each) through a services watch and the real informers, to a consumer that takes
// only every 100 ms. What waits between watch and coalesce never exceeds the
// number of objects, the live heap does not grow with the updates, and the
// consumer ends with the last update of every service.
func TestFloodIsBoundedByObjects(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s flood")
	}
	const services, rounds, period = 100, 500, 10 * time.Second
	objs := []runtime.Object{node("node-1")}
	for i := range services {
		objs = append(objs, service(fmt.Sprintf("s%d", i), fmt.Sprintf("10.96.1.%d", i), nil))
	}
	// Updates go straight into the services watch (the fake apiserver's tracker
	// costs milliseconds an update): informers, handlers and queue are real.
	updates := k8swatch.NewFakeWithChanSize(1024, false)
	watching := make(chan struct{})
	h := startStageWith(t, func(s *Stage) {
		s.client.(*fake.Clientset).PrependWatchReactor("services", func(k8stesting.Action) (bool, k8swatch.Interface, error) {
			close(watching)
			return true, updates, nil
		})
	}, objs...)
	select {
	case <-watching:
	case <-time.After(within):
		t.Fatal("the services watch did not start")
	}

	// The slow consumer: folds what it takes into the latest port per service.
	ports := map[string]int32{}
	var mu sync.Mutex // guards ports, peakQueued, peakHeap
	peakQueued, peakHeap := 0, uint64(0)
	base := liveHeap()
	ctx, cancel := context.WithCancel(context.Background())
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			n, heap := h.out.Len(), liveHeap()
			cs, _ := h.out.TryTake()
			mu.Lock()
			peakQueued, peakHeap = max(peakQueued, n), max(peakHeap, heap)
			if cs.Replay != nil {
				for k, s := range cs.Replay.Services {
					ports[k.Name] = s.Ports[0].Port
				}
			}
			for _, c := range cs.Objects {
				if c.Kind == bus.ServiceChanged && c.Service != nil {
					ports[c.Key.Name] = c.Service.Ports[0].Port
				}
			}
			mu.Unlock()
		}
	}()
	defer func() { cancel(); <-consumed }()

	start := time.Now()
	for r := range rounds {
		for i := range services {
			s := service(fmt.Sprintf("s%d", i), fmt.Sprintf("10.96.1.%d", i), nil)
			s.ResourceVersion = strconv.Itoa(r*services + i + 1)
			s.Spec.Ports[0].Port = int32(1000 + r)
			updates.Modify(s)
		}
		time.Sleep(time.Until(start.Add(period * time.Duration(r+1) / rounds)))
	}
	took := time.Since(start)

	want := int32(1000 + rounds - 1)
	deadline := time.Now().Add(within)
	for {
		mu.Lock()
		done := len(ports) == services
		for _, p := range ports {
			done = done && p == want
		}
		mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the consumer's ports after the flood are not every service's last (%d): %v", want, ports)
		}
		time.Sleep(50 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	grew := int64(peakHeap) - int64(base)
	t.Logf("%d updates in %v: peak queued %d (objects: %d services, 1 node, 1 replay), live heap %.1f MB before, peak growth %.1f MB",
		services*rounds, took.Round(time.Millisecond), peakQueued, services, float64(base)/1e6, float64(grew)/1e6)
	if peakQueued > services+2 {
		t.Errorf("peak queued %d; want at most the %d objects", peakQueued, services+2)
	}
	if grew > 16<<20 && !raceDetector { // the queue bound above is checked either way

		t.Errorf("live heap grew %.1f MB during the flood; want it bounded by the objects, not the updates", float64(grew)/1e6)
	}
}

// liveHeap is the heap in use after a collection.
func liveHeap() uint64 {
	goruntime.GC()
	var m goruntime.MemStats
	goruntime.ReadMemStats(&m)
	return m.HeapAlloc
}
