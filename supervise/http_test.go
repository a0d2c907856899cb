package supervise

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus/bustest"
)

func serve(h http.Handler, method, path string) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(method, path, nil))
	return w
}

func TestHandlerListsStages(t *testing.T) {
	s := Tree("kpipe", fast(OneForOne),
		Tree("pipeline", fast(RestForOne), Leaf("render", block)),
		Leaf("health", block),
	)
	runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")

	w := serve(Handler(s), http.MethodGet, "/debug/stages")
	if w.Code != http.StatusOK || w.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("GET /debug/stages: %d %q", w.Code, w.Header().Get("Content-Type"))
	}
	var got []Status
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Path != "kpipe/pipeline/render" || got[1].Path != "kpipe/health" ||
		got[0].State != stateRunning {
		t.Errorf("stages = %+v", got)
	}
	if !strings.Contains(w.Body.String(), `"lastStart"`) || strings.Contains(w.Body.String(), `"lastError"`) {
		t.Errorf("body %s: want lastStart, and no lastError when there is none", w.Body)
	}
}

func TestHandlerKill(t *testing.T) {
	o := fast(OneForOne)
	o.Backoff = Backoff{Initial: time.Hour, Max: 2 * time.Hour} // stays in backoff once killed
	s := Tree("kpipe", o, Leaf("render", block), Leaf("health", block))
	runTree(t, s)
	bustest.Eventually(t, func() bool { return running(s) }, "all running")
	h := Handler(s)

	w := serve(h, http.MethodPost, "/debug/stages/render/kill")
	if w.Code != http.StatusOK {
		t.Fatalf("kill render: %d %s", w.Code, w.Body)
	}
	var body map[string]string
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || body["killed"] != "render" {
		t.Errorf("kill render body = %s (%v), want {\"killed\":\"render\"}", w.Body, err)
	}
	bustest.Eventually(t, func() bool { return statusOf(t, s, "render").State == stateBackoff }, "render in backoff")
	if st := statusOf(t, s, "render"); st.LastError != "killed" {
		t.Errorf("render LastError = %q, want killed", st.LastError)
	}

	for _, tc := range []struct {
		method, path string
		want         int
	}{
		{http.MethodPost, "/debug/stages/nope/kill", http.StatusNotFound},
		{http.MethodPost, "/debug/stages/render/kill", http.StatusConflict}, // waiting out its backoff
		{http.MethodGet, "/debug/stages/health/kill", http.StatusMethodNotAllowed},
		{http.MethodPost, "/debug/stages", http.StatusMethodNotAllowed},
		{http.MethodDelete, "/debug/stages", http.StatusMethodNotAllowed},
	} {
		if w := serve(h, tc.method, tc.path); w.Code != tc.want {
			t.Errorf("%s %s = %d, want %d", tc.method, tc.path, w.Code, tc.want)
		}
	}
	if st := statusOf(t, s, "health"); st.Restarts != 0 || st.State != stateRunning {
		t.Errorf("health = %+v, want untouched by the rejected requests", st)
	}
}
