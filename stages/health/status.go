package health

import (
	"net/http"
	"sync"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/supervise"
)

// Status is the answer of GET /status on the metrics listener, what `kpipe
// status` shows: the stages as their supervisors see them, each family's
// syncs, pending changes and service ports without endpoints, and the last
// config reload. It only reads: the stages' kill handler stays on the debug
// listener.
type Status struct {
	Node       string         `json:"node"`
	Stages     []StageStatus  `json:"stages"`
	Families   []FamilyStatus `json:"families"`
	LastReload *Reload        `json:"lastReload,omitempty"`
}

// StageStatus is one supervised stage as its supervisor sees it, with when
// its last error happened (from the board).
type StageStatus struct {
	supervise.Status
	LastErrorAt time.Time `json:"lastErrorAt,omitzero"`
}

// FamilyStatus is one family's progress: its last commit (generation, when,
// how long from the start of its render), its last full one, what coalesce
// holds pending and the service ports the committed rules leave without
// endpoints.
type FamilyStatus struct {
	Family           string       `json:"family"` // "IPv4", "IPv6"
	Generation       uint64       `json:"generation"`
	LastSync         time.Time    `json:"lastSync,omitzero"`
	LastSyncSeconds  float64      `json:"lastSyncSeconds,omitempty"`
	LastFullSync     time.Time    `json:"lastFullSync,omitzero"`
	PendingSince     time.Time    `json:"pendingSince,omitzero"`
	PendingServices  int          `json:"pendingServices"`
	PendingEndpoints int          `json:"pendingEndpoints"`
	Unserved         bus.Unserved `json:"unserved"`
}

// Reload is the outcome of the config file's last change: applied (OK) or
// rejected with Error, the previous configuration kept.
type Reload struct {
	At    time.Time `json:"at"`
	OK    bool      `json:"ok"`
	Error string    `json:"error,omitempty"`
}

// Reloads keeps the last Reload. It outlives the trees a reload replaces, so
// the new tree's /status tells of the reload that made it.
type Reloads struct {
	mu   sync.Mutex
	last *Reload
}

// Record keeps the outcome of a reload at at: err nil is a success. A nil r
// keeps nothing.
func (r *Reloads) Record(at time.Time, err error) {
	if r == nil {
		return
	}
	rl := &Reload{At: at, OK: err == nil}
	if err != nil {
		rl.Error = err.Error()
	}
	r.mu.Lock()
	r.last = rl
	r.mu.Unlock()
}

// Last is the last reload, nil when the file has not changed (or r is nil).
func (r *Reloads) Last() *Reload {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// status gathers the Status from the supervisor, the board and the reloads.
func (h *Health) status() Status {
	reports := h.board.Read()
	out := Status{Node: h.cfg.NodeName, Stages: []StageStatus{}, LastReload: h.reloads.Last()}
	if h.stageStatus != nil {
		for _, s := range h.stageStatus() {
			out.Stages = append(out.Stages, stageStatus(s, reports[bus.StageName(s.Name)]))
		}
	}
	for _, f := range h.families {
		out.Families = append(out.Families, familyStatus(f, reports[bus.Commit.Of(f)], reports[bus.Coalesce.Of(f)]))
	}
	return out
}

// stageStatus is s with its last error's time from its report; an error the
// stage reported itself, without failing, when its supervisor has none.
func stageStatus(s supervise.Status, r bus.Report) StageStatus {
	out := StageStatus{Status: s, LastErrorAt: r.LastErrorAt}
	if out.LastError == "" {
		out.LastError = r.LastError
	}
	return out
}

func familyStatus(f bus.Family, commit, coalesce bus.Report) FamilyStatus {
	out := FamilyStatus{Family: f.String(), Generation: commit.Generation, LastSync: commit.LastSync,
		LastSyncSeconds: commit.LastSyncDuration.Seconds(), LastFullSync: commit.LastFullSync,
		PendingSince: coalesce.PendingSince, PendingServices: coalesce.PendingServices, PendingEndpoints: coalesce.PendingEndpoints}
	if commit.Unserved != nil {
		out.Unserved = *commit.Unserved
	}
	return out
}

// serveStatus answers GET /status with the Status as JSON.
func (h *Health) serveStatus(w http.ResponseWriter, _ *http.Request) {
	h.writeJSON(w, "status", h.status())
}
