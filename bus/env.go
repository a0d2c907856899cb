package bus

import (
	"log/slog"

	"github.com/kpipe/kpipe/metrics"
)

// StageName names a stage: its supervisor leaf, its log attribute and its key on
// the Board. Stages that run once per family are named with Of.
type StageName string

const (
	Watch     StageName = "watch"
	Coalesce  StageName = "coalesce"
	Render    StageName = "render"
	Commit    StageName = "commit"
	Conntrack StageName = "conntrack"
	Canary    StageName = "canary"
	Health    StageName = "health"
)

// Of is the name of the stage for family f, e.g. "commit-ipv4". Coalesce, one
// stage for every family, reports each family's progress under Coalesce.Of(f).
func (n StageName) Of(f Family) StageName { return n + "-" + StageName(f.Lower()) }

// Env is what a stage gets from the process, derived once from its name.
type Env struct {
	Name    StageName
	Log     *slog.Logger // with "stage"=Name
	Metrics *metrics.Metrics
	Status  Reporter // the stage's entry on the Board
}

// Envs makes each stage's Env from what all stages share.
type Envs struct {
	Log     *slog.Logger
	Metrics *metrics.Metrics
	Board   *Board // required: the one board /healthz and the events stage read
}

// For makes the Env of the stage called name. Without a Board it panics: a
// stage reporting to a board of its own would report to nobody.
func (e Envs) For(name StageName) Env {
	log := e.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return Env{Name: name, Log: log.With("stage", string(name)), Metrics: e.Metrics, Status: MustBoard(e.Board, string(name)).Reporter(name)}
}

// MustBoard is board, or a panic naming who was given none: a nil Board is a
// programming error (the stage's reports would reach no reader), found when
// the stage is made.
func MustBoard(board *Board, who string) *Board {
	if board == nil {
		panic(who + ": no Board: every stage reports to the process's one board (bus.NewBoard)")
	}
	return board
}
