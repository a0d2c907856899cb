package health

import (
	"errors"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// TestSLIsOnMetrics: /metrics/slis counts the healthz ping as kube-proxy's
// does (component-base's kubernetes_healthcheck and
// kubernetes_healthchecks_total); an excluded ping is not counted.
func TestSLIsOnMetrics(t *testing.T) {
	hs := newHarness(t, Config{MetricsAddr: "127.0.0.1:0"}, nil)
	hs.run(t)
	base := "http://" + hs.addr(t, metricsListener)
	const gauge = `kubernetes_healthcheck{name="ping",type="healthz"}`
	const total = `kubernetes_healthchecks_total{name="ping",status="success",type="healthz"}`
	before := sample(t, base, total)
	for range 2 {
		get(t, base+"/healthz")
	}
	if got := sample(t, base, gauge); got != 1 {
		t.Errorf("%s = %v, want 1", gauge, got)
	}
	if got := sample(t, base, total); got != before+2 {
		t.Errorf("%s = %v after two GETs, want %v", total, got, before+2)
	}
	get(t, base+"/healthz?exclude=ping")
	if got := sample(t, base, total); got != before+2 {
		t.Errorf("%s = %v after an excluded ping, want %v", total, got, before+2)
	}
}

// sample is the value of series in /metrics/slis, 0 when absent.
func sample(t *testing.T, base, series string) float64 {
	t.Helper()
	r := get(t, base+"/metrics/slis")
	if r.code != http.StatusOK {
		t.Fatalf("/metrics/slis: %d %s", r.code, r.body)
	}
	for _, line := range strings.Split(r.body, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			return f
		}
	}
	return 0
}

// TestDebugFlagsV: with Profiling, a PUT to /debug/flags/v sets the
// verbosity as kube-proxy's does (200 with the setter's answer, 400 with its
// error, 406 for another method); without Profiling it is not served.
func TestDebugFlagsV(t *testing.T) {
	var got []string
	set := func(v string) (string, error) {
		if v == "loud" {
			return "", errors.New("not a number")
		}
		got = append(got, v)
		return "set to " + v, nil
	}
	hs := newHarness(t, Config{MetricsAddr: "127.0.0.1:0", Profiling: true}, nil)
	hs.h.setV = set
	hs.run(t)
	url := "http://" + hs.addr(t, metricsListener) + "/debug/flags/v"
	for _, c := range []struct {
		method, body string
		code         int
		answer       string
	}{
		{http.MethodPut, "4", http.StatusOK, "set to 4\n"},
		{http.MethodPut, "loud", http.StatusBadRequest, "not a number\n"},
		{http.MethodGet, "", http.StatusNotAcceptable, "unsupported http method\n"},
	} {
		if r := doBody(t, c.method, url, c.body); r.code != c.code || r.body != c.answer {
			t.Errorf("%s %q: %d %q, want %d %q", c.method, c.body, r.code, r.body, c.code, c.answer)
		}
	}
	if len(got) != 1 || got[0] != "4" {
		t.Errorf("setter called with %q, want [4]", got)
	}

	off := newHarness(t, Config{MetricsAddr: "127.0.0.1:0"}, nil)
	off.h.setV = set
	off.run(t)
	if r := doBody(t, http.MethodPut, "http://"+off.addr(t, metricsListener)+"/debug/flags/v", "2"); r.code != http.StatusNotFound {
		t.Errorf("PUT /debug/flags/v without Profiling: %d, want 404", r.code)
	}
}
