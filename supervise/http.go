package supervise

import (
	"encoding/json"
	"errors"
	"net/http"
)

// Handler serves the tree's debug endpoints:
//
//	GET  /debug/stages             JSON array of Status
//	POST /debug/stages/{name}/kill Kill the leaf: 200 {"killed":name}, 404 unknown
//	                               stage, 409 stage not running (waiting out a backoff)
//
// Other methods on these paths get 405. Mount it for both "/debug/stages" and
// "/debug/stages/" on the debug server's mux.
func Handler(s *Supervisor) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/stages", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, s.Status())
	})
	mux.HandleFunc("POST /debug/stages/{name}/kill", func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		switch err := s.Kill(name); {
		case errors.Is(err, errUnknown):
			http.Error(w, err.Error(), http.StatusNotFound)
		case errors.Is(err, errNotRunning):
			http.Error(w, err.Error(), http.StatusConflict)
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
		default:
			writeJSON(w, http.StatusOK, map[string]string{"killed": name})
		}
	})
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v) // the client is gone if this fails
}
