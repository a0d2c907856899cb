package bus

import (
	"sync"
	"time"
)

// ChangeQueue carries watch's changes to coalesce, holding at most one Change
// per object: a Put for an object already queued replaces its change (the
// latest state wins), and a replay replaces everything queued (it carries it).
// So what waits is bounded by the number of distinct objects, however fast
// they change and however slow coalesce is, and Put never blocks: the
// informers' handlers never stall, so client-go never buffers their
// notifications. Like a Mailbox it outlives the stages on either side.
type ChangeQueue struct {
	mu      sync.Mutex
	replay  *State
	keys    []ObjectKey // queued objects, in the order first queued
	changes map[ObjectKey]Change
	ready   *Flag
}

// ObjectKey names the object a Change is about: one per Service, per
// EndpointSlice, and one each for the Node and the local addresses.
type ObjectKey struct {
	Kind      ChangeKind
	Key       ServiceKey
	SliceName string
}

// KeyOf is the object c is about (not meaningful for a replay).
func KeyOf(c Change) ObjectKey {
	switch c.Kind {
	case ServiceChanged:
		return ObjectKey{Kind: c.Kind, Key: c.Key}
	case SliceChanged:
		return ObjectKey{Kind: c.Kind, Key: c.Key, SliceName: c.SliceName}
	}
	return ObjectKey{Kind: c.Kind}
}

// Changes is what a TryTake returns: a replay (when one was queued, applied
// first) and the latest change of each object queued after it.
type Changes struct {
	Replay  *State
	Objects []Change
}

// NewChangeQueue makes an empty queue.
func NewChangeQueue() *ChangeQueue {
	return &ChangeQueue{changes: map[ObjectKey]Change{}, ready: NewFlag()}
}

// Put queues c: a replay drops every change queued before it; any other change
// replaces the one queued for the same object. For an EndpointSlice the
// earliest trigger time of the changes replaced is kept in EarlierTrigger, so
// the network programming latency still counts from the first.
func (q *ChangeQueue) Put(c Change) {
	q.mu.Lock()
	if c.Kind == Replayed {
		q.replay, q.keys = c.Replay, q.keys[:0]
		clear(q.changes)
	} else {
		k := KeyOf(c)
		old, queued := q.changes[k]
		if !queued {
			q.keys = append(q.keys, k)
		} else if c.Kind == SliceChanged {
			c.EarlierTrigger = earliest(old.EarlierTrigger, old.triggerTime())
		}
		q.changes[k] = c
	}
	q.mu.Unlock()
	q.ready.Raise()
}

func (c Change) triggerTime() time.Time {
	if c.Slice == nil {
		return time.Time{}
	}
	return c.Slice.TriggerTime
}

// earliest is the earlier of two times, zero standing for none.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// Ready is signalled when changes may be waiting; follow it with TryTake.
func (q *ChangeQueue) Ready() <-chan struct{} { return q.ready.C() }

// TryTake takes everything queued, if anything is.
func (q *ChangeQueue) TryTake() (Changes, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.replay == nil && len(q.keys) == 0 {
		return Changes{}, false
	}
	out := Changes{Replay: q.replay, Objects: make([]Change, 0, len(q.keys))}
	for _, k := range q.keys {
		out.Objects = append(out.Objects, q.changes[k])
	}
	q.replay, q.keys = nil, nil
	clear(q.changes)
	return out, true
}

// Len is how many objects' changes are queued (a replay counts as one).
func (q *ChangeQueue) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := len(q.keys)
	if q.replay != nil {
		n++
	}
	return n
}
