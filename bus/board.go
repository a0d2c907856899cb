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
	// PendingServices and PendingEndpoints count the pending changes of a
	// service and of its endpoints (coalesce).
	PendingServices, PendingEndpoints int
	// LastSync is when the last successful commit finished, LastFullSync the last
	// successful full one, Generation the snapshot it wrote, LastSyncDuration
	// how long it took from the start of its render (commit).
	LastSync         time.Time
	LastFullSync     time.Time
	Generation       uint64
	LastSyncDuration time.Duration
	// Unserved names the service ports the last commit left without endpoints
	// (commit, from the plan). Never modified once published.
	Unserved *Unserved
	// LastQueued is when the last change was queued (coalesce, watch).
	LastQueued time.Time
	// NodeDeleting: this node's Node is being deleted (watch).
	NodeDeleting bool
	// Errors counts the stage's failures, LastError and LastErrorAt are the latest
	// (written by the stage itself or by its supervisor on a restart).
	Errors      uint64
	LastError   string
	LastErrorAt time.Time
}

// Board collects the latest Report of every stage, by name. It is the status
// channel of the pipeline: stages write their own entry, health reads.
type Board struct {
	mu      sync.Mutex
	reports map[StageName]Report
}

// NewBoard makes an empty board.
func NewBoard() *Board { return &Board{reports: map[StageName]Report{}} }

// Publish replaces the report of stage.
func (b *Board) Publish(stage StageName, r Report) {
	b.mu.Lock()
	b.reports[stage] = r
	b.mu.Unlock()
}

// Update changes the report of stage in place.
func (b *Board) Update(stage StageName, change func(*Report)) {
	b.mu.Lock()
	r := b.reports[stage]
	change(&r)
	b.reports[stage] = r
	b.mu.Unlock()
}

// Read returns a copy of every report.
func (b *Board) Read() map[StageName]Report {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[StageName]Report, len(b.reports))
	for k, v := range b.reports {
		out[k] = v
	}
	return out
}

// Reporter is the writer of one stage's entry on the board.
func (b *Board) Reporter(stage StageName) Reporter { return Reporter{board: b, stage: stage} }

// Reporter writes one stage's Report.
type Reporter struct {
	board *Board
	stage StageName
}

// Update changes the report in place.
func (r Reporter) Update(change func(*Report)) { r.board.Update(r.stage, change) }

// Of is the reporter of the same board's entry for family f of this stage (see
// StageName.Of): coalesce reports each family's progress there.
func (r Reporter) Of(f Family) Reporter { return r.board.Reporter(r.stage.Of(f)) }

// Failed counts a failure of the stage at at.
func (r Reporter) Failed(err error, at time.Time) {
	r.Update(func(rep *Report) { rep.Errors++; rep.LastError, rep.LastErrorAt = err.Error(), at })
}
