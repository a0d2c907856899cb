package health

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/supervise"
)

// TestStatusEndpoint: GET /status on the metrics listener (without debug
// handlers) answers the supervisor's stages with their last error's time from
// the board, each family's last sync, its duration and last full sync, what is
// pending, the service ports without (local) endpoints the last commit left,
// and the last config reload; other methods are refused.
func TestStatusEndpoint(t *testing.T) {
	hs := newHarness(t, Config{MetricsAddr: "127.0.0.1:0", NodeName: "node-a", Families: []bus.Family{bus.IPv4, bus.IPv6}}, nil)
	full := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	failed := full.Add(time.Minute)
	hs.h.stageStatus = func() []supervise.Status {
		return []supervise.Status{
			{Name: "watch", Path: "kpipe/pipeline/watch", State: "running"},
			{Name: "render-ipv4", Path: "kpipe/pipeline/families/ipv4/render-ipv4", State: "backoff", Restarts: 2, LastError: "killed"},
		}
	}
	hs.h.reloads = &Reloads{}
	hs.run(t)
	base := "http://" + hs.addr(t, metricsListener)

	r := get(t, base+"/status")
	checkJSONHeaders(t, r)
	want := `{"node":"node-a","stages":[{"name":"watch","path":"kpipe/pipeline/watch","state":"running","restarts":0,"lastStart":"0001-01-01T00:00:00Z"},` +
		`{"name":"render-ipv4","path":"kpipe/pipeline/families/ipv4/render-ipv4","state":"backoff","restarts":2,"lastError":"killed","lastStart":"0001-01-01T00:00:00Z"}],` +
		`"families":[{"family":"IPv4","generation":0,"pendingServices":0,"pendingEndpoints":0,"unserved":{"noEndpoints":{"total":0},"noLocalEndpoints":{"total":0}}},` +
		`{"family":"IPv6","generation":0,"pendingServices":0,"pendingEndpoints":0,"unserved":{"noEndpoints":{"total":0},"noLocalEndpoints":{"total":0}}}]}`
	if r.code != http.StatusOK || r.body != want {
		t.Errorf("/status before any report = %d %s\nwant 200 %s", r.code, r.body, want)
	}

	hs.board.Update(bus.Commit.Of(bus.IPv4), func(r *bus.Report) {
		r.Generation, r.LastSync, r.LastFullSync, r.LastSyncDuration = 7, full.Add(90*time.Second), full, 250*time.Millisecond
		r.Unserved = &bus.Unserved{NoEndpoints: bus.Names{First: []string{"ns/empty:http"}, Total: 1},
			NoLocalEndpoints: bus.Names{First: []string{"ns/lb:http"}, Total: 3}}
	})
	hs.board.Update(bus.Coalesce.Of(bus.IPv4), func(r *bus.Report) { r.PendingSince, r.PendingServices, r.PendingEndpoints = failed, 1, 2 })
	hs.board.Reporter(bus.Render.Of(bus.IPv4)).Failed(errors.New("killed"), failed)
	hs.h.reloads.Record(failed, errors.New("config file: unknown field"))
	r = get(t, base+"/status")
	want = `{"node":"node-a","stages":[{"name":"watch","path":"kpipe/pipeline/watch","state":"running","restarts":0,"lastStart":"0001-01-01T00:00:00Z"},` +
		`{"name":"render-ipv4","path":"kpipe/pipeline/families/ipv4/render-ipv4","state":"backoff","restarts":2,"lastError":"killed","lastStart":"0001-01-01T00:00:00Z","lastErrorAt":"2025-01-02T03:05:05Z"}],` +
		`"families":[{"family":"IPv4","generation":7,"lastSync":"2025-01-02T03:05:35Z","lastSyncSeconds":0.25,"lastFullSync":"2025-01-02T03:04:05Z",` +
		`"pendingSince":"2025-01-02T03:05:05Z","pendingServices":1,"pendingEndpoints":2,` +
		`"unserved":{"noEndpoints":{"first":["ns/empty:http"],"total":1},"noLocalEndpoints":{"first":["ns/lb:http"],"total":3}}},` +
		`{"family":"IPv6","generation":0,"pendingServices":0,"pendingEndpoints":0,"unserved":{"noEndpoints":{"total":0},"noLocalEndpoints":{"total":0}}}],` +
		`"lastReload":{"at":"2025-01-02T03:05:05Z","ok":false,"error":"config file: unknown field"}}`
	if r.code != http.StatusOK || r.body != want {
		t.Errorf("/status = %d %s\nwant 200 %s", r.code, r.body, want)
	}
	if r := do(t, http.MethodPost, base+"/status"); r.code != http.StatusMethodNotAllowed {
		t.Errorf("POST /status = %d; want 405", r.code)
	}
}
