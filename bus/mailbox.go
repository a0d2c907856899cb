package bus

import (
	"context"
	"sync"
)

// Mailbox holds at most one value: a Put replaces a value not yet taken (latest
// wins), so a slow consumer never blocks its producer and never works on stale
// state. A Mailbox outlives the stages on either side of it: a restarted consumer
// picks up whatever was put while it was down.
type Mailbox[T any] struct {
	mu    sync.Mutex
	value T
	full  bool
	merge func(old, new T) T
	ready chan struct{} // holds a token while full
}

// NewMailbox makes a latest-wins mailbox.
func NewMailbox[T any]() *Mailbox[T] {
	return &Mailbox[T]{ready: make(chan struct{}, 1)}
}

// NewMergingMailbox makes a mailbox that folds a new value into one not yet taken
// with merge, for messages that must not be lost (such as flows to clear).
func NewMergingMailbox[T any](merge func(old, new T) T) *Mailbox[T] {
	m := NewMailbox[T]()
	m.merge = merge
	return m
}

// Put stores v, replacing (or merging with) a value not yet taken.
func (m *Mailbox[T]) Put(v T) {
	m.mu.Lock()
	if m.full && m.merge != nil {
		v = m.merge(m.value, v)
	}
	m.value, m.full = v, true
	m.mu.Unlock()
	m.signal()
}

// Requeue puts back a value the consumer took and could not finish, as the OLDER
// value: one put since is newer and wins (a merging mailbox stores
// merge(v, waiting); a latest-wins one keeps the waiting value).
func (m *Mailbox[T]) Requeue(v T) {
	m.mu.Lock()
	switch {
	case !m.full:
		m.value, m.full = v, true
	case m.merge != nil:
		m.value = m.merge(v, m.value)
	}
	m.mu.Unlock()
	m.signal()
}

// signal wakes a consumer waiting in Take.
func (m *Mailbox[T]) signal() {
	select {
	case m.ready <- struct{}{}:
	default:
	}
}

// Ready is signalled when a value may be waiting; follow it with TryTake.
func (m *Mailbox[T]) Ready() <-chan struct{} { return m.ready }

// TryTake takes the value if there is one.
func (m *Mailbox[T]) TryTake() (T, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.value, m.full
	var zero T
	m.value, m.full = zero, false
	return v, ok
}

// Take waits for a value or for ctx to end.
func (m *Mailbox[T]) Take(ctx context.Context) (T, error) {
	for {
		if v, ok := m.TryTake(); ok {
			return v, nil
		}
		select {
		case <-ctx.Done():
			var zero T
			return zero, ctx.Err()
		case <-m.ready:
		}
	}
}
