package health

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// familySync is one family's entry in /sync: the last successful commit's
// generation, when it finished, and when the last successful full sync finished.
// Times a family has not reached yet are left out.
type familySync struct {
	Generation   uint64    `json:"generation"`
	LastSync     time.Time `json:"lastSync,omitzero"`
	LastFullSync time.Time `json:"lastFullSync,omitzero"`
}

// serveSync answers GET /sync: one familySync per family, keyed "IPv4" and
// "IPv6", from commit's reports. A test bed polls it to know the rules are in.
func (h *Health) serveSync(w http.ResponseWriter, _ *http.Request) {
	reports := h.board.Read()
	out := make(map[string]familySync, len(h.families))
	for _, f := range h.families {
		r := reports[bus.Commit.Of(f)]
		out[f.String()] = familySync{Generation: r.Generation, LastSync: r.LastSync, LastFullSync: r.LastFullSync}
	}
	h.writeJSON(w, "sync status", out)
}

// writeJSON answers v as JSON; what names it in the log.
func (h *Health) writeJSON(w http.ResponseWriter, what string, v any) {
	body, err := json.Marshal(v)
	if err != nil { // cannot happen: plain types, times within range
		h.log.Error("marshal "+what, "err", err)
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	_, _ = w.Write(body)
}
