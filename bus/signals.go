package bus

// The pipeline's control edges are flags, each of its own type so that one cannot
// be wired where another is wanted: swapping two would compile and deadlock.

// ResendFlag: a restarted render or commit lost the snapshot in flight; coalesce
// sends the state again (render, commit → coalesce).
type ResendFlag struct{ Flag }

// ResyncFlag: the tables were flushed; coalesce sends a full sync (canary → coalesce).
type ResyncFlag struct{ Flag }

// ReplayFlag: coalesce (re)started and wants the whole state (coalesce → watch).
type ReplayFlag struct{ Flag }

// NewResendFlag makes a lowered ResendFlag.
func NewResendFlag() *ResendFlag { return &ResendFlag{*NewFlag()} }

// NewResyncFlag makes a lowered ResyncFlag.
func NewResyncFlag() *ResyncFlag { return &ResyncFlag{*NewFlag()} }

// NewReplayFlag makes a lowered ReplayFlag.
func NewReplayFlag() *ReplayFlag { return &ReplayFlag{*NewFlag()} }
