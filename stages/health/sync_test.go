package health

import (
	"net/http"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// TestSyncEndpoint: GET /sync on the metrics listener (without debug handlers)
// answers, per family kpipe runs, the generation of the last successful commit,
// when it finished and when the last full one finished, as commit reports them; a
// family that has not committed yet has generation 0 and no times.
func TestSyncEndpoint(t *testing.T) {
	hs := newHarness(t, Config{MetricsAddr: "127.0.0.1:0", Families: []bus.Family{bus.IPv4, bus.IPv6}}, nil)
	full := time.Date(2025, 1, 2, 3, 4, 5, 600000000, time.UTC)
	last := full.Add(90 * time.Second)
	hs.run(t)
	base := "http://" + hs.addr(t, metricsListener)

	r := get(t, base+"/sync")
	checkJSONHeaders(t, r)
	if want := `{"IPv4":{"generation":0},"IPv6":{"generation":0}}`; r.code != http.StatusOK || r.body != want {
		t.Errorf("/sync before any commit = %d %s; want 200 %s", r.code, r.body, want)
	}

	hs.board.Update(bus.Commit.Of(bus.IPv4), func(r *bus.Report) { r.Generation, r.LastSync, r.LastFullSync = 12, last, full })
	hs.board.Update(bus.Commit.Of(bus.IPv6), func(r *bus.Report) { r.Generation, r.LastSync, r.LastFullSync = 3, full, full })
	hs.board.Update(bus.Coalesce.Of(bus.IPv4), func(r *bus.Report) { r.LastSync = time.Now() }) // not commit's: not shown
	r = get(t, base+"/sync")
	want := `{"IPv4":{"generation":12,"lastSync":"2025-01-02T03:05:35.6Z","lastFullSync":"2025-01-02T03:04:05.6Z"},` +
		`"IPv6":{"generation":3,"lastSync":"2025-01-02T03:04:05.6Z","lastFullSync":"2025-01-02T03:04:05.6Z"}}`
	if r.code != http.StatusOK || r.body != want {
		t.Errorf("/sync = %d %s; want 200 %s", r.code, r.body, want)
	}
	if r := do(t, http.MethodPost, base+"/sync"); r.code != http.StatusMethodNotAllowed {
		t.Errorf("POST /sync = %d; want 405", r.code)
	}
}
