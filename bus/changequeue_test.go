package bus_test

import (
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

func serviceChange(name string) bus.Change {
	k := bus.ServiceKey{Namespace: "ns", Name: name}
	return bus.Change{Kind: bus.ServiceChanged, Key: k, Service: &bus.Service{ServiceKey: k}}
}

func sliceChange(name string, trigger time.Time) bus.Change {
	k := bus.ServiceKey{Namespace: "ns", Name: "web"}
	return bus.Change{Kind: bus.SliceChanged, Key: k, SliceName: name,
		Slice: &bus.EndpointSlice{Service: k, Name: name, TriggerTime: trigger}}
}

// One change per object, the latest, in the order the objects were first
// queued; a replay drops what was queued before it and comes first.
func TestChangeQueueKeepsTheLatestPerObject(t *testing.T) {
	q := bus.NewChangeQueue()
	if _, ok := q.TryTake(); ok {
		t.Fatal("TryTake on an empty queue took something")
	}
	a1, b, a2 := serviceChange("a"), serviceChange("b"), serviceChange("a")
	q.Put(a1)
	q.Put(b)
	q.Put(a2)
	if q.Len() != 2 {
		t.Errorf("Len = %d after 3 changes of 2 objects; want 2", q.Len())
	}
	cs, ok := q.TryTake()
	if !ok || cs.Replay != nil || len(cs.Objects) != 2 || cs.Objects[0].Service != a2.Service || cs.Objects[1].Service != b.Service {
		t.Fatalf("took %+v; want a's latest change, then b's", cs)
	}
	if _, ok := q.TryTake(); ok || q.Len() != 0 {
		t.Fatal("the queue is not empty after a TryTake")
	}

	q.Put(a1)
	replay := &bus.State{}
	q.Put(bus.Change{Kind: bus.Replayed, Replay: replay})
	q.Put(b)
	select {
	case <-q.Ready():
	default:
		t.Fatal("Ready not signalled with changes queued")
	}
	cs, _ = q.TryTake()
	if cs.Replay != replay || len(cs.Objects) != 1 || cs.Objects[0].Service != b.Service {
		t.Fatalf("took %+v; want the replay, then only b (a, queued before the replay, is in it)", cs)
	}
}

// Folding an EndpointSlice's changes keeps the earliest trigger time among them,
// so the network programming latency counts from the first change.
func TestChangeQueueKeepsTheEarliestTrigger(t *testing.T) {
	q := bus.NewChangeQueue()
	t0 := time.Now()
	q.Put(sliceChange("web-1", t0.Add(time.Second)))
	q.Put(sliceChange("web-1", t0))
	q.Put(sliceChange("web-1", time.Time{})) // a deletion carries no trigger
	q.Put(sliceChange("web-1", t0.Add(2*time.Second)))
	cs, _ := q.TryTake()
	if len(cs.Objects) != 1 {
		t.Fatalf("took %d changes of one slice; want 1", len(cs.Objects))
	}
	if c := cs.Objects[0]; !c.EarlierTrigger.Equal(t0) || !c.Slice.TriggerTime.Equal(t0.Add(2*time.Second)) {
		t.Errorf("folded change: earlier trigger %v, trigger %v; want %v and the latest, %v",
			c.EarlierTrigger, c.Slice.TriggerTime, t0, t0.Add(2*time.Second))
	}
}

// A merged repair asks for everything either asked for, since the earliest change.
func TestMergeRepairs(t *testing.T) {
	t0 := time.Now()
	old := bus.Repair{Chains: map[string]map[string]bool{"nat": {"A": true}}, Jumps: map[string]bool{"nat": true}, Since: t0.Add(time.Second)}
	newer := bus.Repair{Chains: map[string]map[string]bool{"nat": {"B": true}, "filter": {"C": true}}, Lost: true, Since: t0}
	m := bus.MergeRepairs(old, newer)
	if !m.Chains["nat"]["A"] || !m.Chains["nat"]["B"] || !m.Chains["filter"]["C"] || !m.Jumps["nat"] || !m.Lost || !m.Since.Equal(t0) {
		t.Errorf("merged %+v; want chains A, B, C, the nat jumps, lost, since %v", m, t0)
	}
	if len(old.Chains["nat"]) != 1 {
		t.Errorf("merging changed the older request: %v", old.Chains)
	}
	if m := bus.MergeRepairs(bus.Repair{}, old); !m.Since.Equal(old.Since) {
		t.Errorf("merged into an empty request: since %v; want %v", m.Since, old.Since)
	}
}
