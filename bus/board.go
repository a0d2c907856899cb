package bus

import (
	"sync"
	"time"
)

// Report is what a stage publishes about its own progress; health reads them all.
type Report struct {
	// PendingSince is when the oldest change not yet committed was queued (coalesce),
	// zero when nothing is pending.
	PendingSince time.Time
	// LastSync is when the last successful commit finished (commit).
	LastSync time.Time
	// LastQueued is when the last change was queued (coalesce).
	LastQueued time.Time
	// Errors counts the stage's failures, LastError and LastErrorAt are the latest
	// (written by the stage itself or by its supervisor on a restart).
	Errors      uint64
	LastError   string
	LastErrorAt time.Time
	Detail      string
}

// Board collects the latest Report of every stage, by name. It is the status
// channel of the pipeline: stages write their own entry, health reads.
type Board struct {
	mu      sync.Mutex
	reports map[string]Report
}

// NewBoard makes an empty board.
func NewBoard() *Board { return &Board{reports: map[string]Report{}} }

// Publish replaces the report of stage.
func (b *Board) Publish(stage string, r Report) {
	b.mu.Lock()
	b.reports[stage] = r
	b.mu.Unlock()
}

// Update changes the report of stage in place.
func (b *Board) Update(stage string, change func(*Report)) {
	b.mu.Lock()
	r := b.reports[stage]
	change(&r)
	b.reports[stage] = r
	b.mu.Unlock()
}

// Read returns a copy of every report.
func (b *Board) Read() map[string]Report {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[string]Report, len(b.reports))
	for k, v := range b.reports {
		out[k] = v
	}
	return out
}
