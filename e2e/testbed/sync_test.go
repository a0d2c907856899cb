package testbed

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// syncAnswer is a GET /sync answer and what syncedFrom should make of it.
type syncAnswer struct {
	name   string
	code   int
	body   string
	synced bool
	state  string // part of what syncedFrom says is missing
}

// syncAnswers are GET /sync answers in the order a starting kpipe gives them.
var syncAnswers = []syncAnswer{
	{"not listening yet", http.StatusNotFound, "404 page not found\n", false, "HTTP 404"},
	{"no family", 200, `{}`, false, "no IP family"},
	{"not synced", 200, `{"IPv4":{"generation":0,"lastSync":"0001-01-01T00:00:00Z"},"IPv6":{"generation":0,"lastSync":"0001-01-01T00:00:00Z"}}`, false, "[IPv4 IPv6]"},
	{"one family synced", 200, `{"IPv4":{"generation":1,"lastSync":"2026-05-01T10:00:00.123456789Z","lastFullSync":"2026-05-01T10:00:00.123456789Z"},"IPv6":{"generation":0,"lastSync":"0001-01-01T00:00:00Z"}}`, false, "[IPv6]"},
	{"both synced", 200, `{"IPv4":{"generation":2,"lastSync":"2026-05-01T10:00:01Z","lastFullSync":"2026-05-01T10:00:00.123456789Z"},"IPv6":{"generation":1,"lastSync":"2026-05-01T10:00:00.2Z","lastFullSync":"2026-05-01T10:00:00.2Z"}}`, true, ""},
}

func TestSyncedFrom(t *testing.T) {
	cases := append(syncAnswers[:len(syncAnswers):len(syncAnswers)],
		syncAnswer{"single-stack synced", 200, `{"IPv6":{"generation":1,"lastSync":"2026-05-01T10:00:00Z","lastFullSync":"2026-05-01T10:00:00Z"}}`, true, ""},
		syncAnswer{"not JSON", 200, `generation 12`, false, "unreadable"},
	)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			synced, state := syncedFrom(tc.code, []byte(tc.body), nil)
			if synced != tc.synced || !strings.Contains(state, tc.state) {
				t.Errorf("syncedFrom = %v, %q; want %v and a state containing %q", synced, state, tc.synced, tc.state)
			}
		})
	}
	if synced, state := syncedFrom(0, nil, errors.New("connection refused")); synced || !strings.Contains(state, "connection refused") {
		t.Errorf("syncedFrom(error) = %v, %q; want not synced, naming the error", synced, state)
	}
}

func TestParseSync(t *testing.T) {
	st, err := parseSync(200, []byte(syncAnswers[3].body))
	if err != nil {
		t.Fatal(err)
	}
	v4, v6 := st["IPv4"], st["IPv6"]
	want := time.Date(2026, 5, 1, 10, 0, 0, 123456789, time.UTC)
	if len(st) != 2 || v4.Generation != 1 || !v4.LastSync.Equal(want) || !v4.LastFullSync.Equal(want) || !v6.LastFullSync.IsZero() {
		t.Errorf("parseSync = %+v", st)
	}
}

// syncServer serves the answers of syncAnswers in turn, one step further on each
// request, staying on the last one.
func syncServer(t *testing.T, answers int) (get func() (int, []byte, error), requests *atomic.Int32) {
	requests = &atomic.Int32{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet || r.URL.Path != "/sync" {
			http.NotFound(w, r)
			return
		}
		i := min(int(requests.Add(1))-1, answers-1)
		a := syncAnswers[i]
		w.WriteHeader(a.code)
		io.WriteString(w, a.body)
	}))
	t.Cleanup(srv.Close)
	get = func() (int, []byte, error) {
		resp, err := http.Get(srv.URL + "/sync")
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return resp.StatusCode, body, err
	}
	return get, requests
}

func notExited() error { return nil }

// TestWaitSyncedPollsUntilEveryFamilyFullySynced: waitSynced returns only once
// the endpoint shows a full sync of every family, not at the first 200.
func TestWaitSyncedPollsUntilEveryFamilyFullySynced(t *testing.T) {
	get, requests := syncServer(t, len(syncAnswers))
	if err := waitSynced(get, notExited, 10*time.Second, time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if n := int(requests.Load()); n != len(syncAnswers) {
		t.Errorf("waitSynced returned after %d requests, want %d (at the first answer with every family synced)", n, len(syncAnswers))
	}
}

// TestWaitSyncedTimesOutNamingTheMissingFamily: a family that never makes a full
// sync keeps waitSynced waiting, every time it asks, until the timeout, and the
// error names the family.
func TestWaitSyncedTimesOutNamingTheMissingFamily(t *testing.T) {
	get, requests := syncServer(t, 4) // stays at "one family synced"
	const timeout = 300 * time.Millisecond
	start := time.Now()
	err := waitSynced(get, notExited, timeout, time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "[IPv6]") {
		t.Errorf("waitSynced = %v, want a timeout naming IPv6", err)
	}
	// Counts, not rates: a loaded CI machine may answer only a few requests in
	// the window, but a waitSynced that gave up early or stopped asking fails.
	if waited := time.Since(start); waited < timeout {
		t.Errorf("waitSynced gave up after %v, before its %v timeout", waited, timeout)
	}
	if n := requests.Load(); n < 3 {
		t.Errorf("only %d requests before the timeout: waitSynced did not keep polling", n)
	}
}

func TestWaitSyncedStopsWhenKpipeExits(t *testing.T) {
	get, _ := syncServer(t, 1)
	gone := errors.New("kpipe exited during start-up: exit status 1")
	err := waitSynced(get, func() error { return gone }, 10*time.Second, time.Millisecond)
	if !errors.Is(err, gone) {
		t.Errorf("waitSynced = %v, want the exit error", err)
	}
}
