package health

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/kpipe/kpipe/bus"
)

// ProxierHealth is one family's health, as kube-proxy's ProxierHealth.
type ProxierHealth struct {
	LastUpdated time.Time `json:"lastUpdated"`
	Healthy     bool      `json:"healthy"`
}

// ProxyHealth is the body of /healthz and /livez, field for field kube-proxy's
// ProxyHealth (pkg/proxy/healthcheck), so it marshals to the same JSON.
type ProxyHealth struct {
	LastUpdated  time.Time                `json:"lastUpdated"`
	CurrentTime  time.Time                `json:"currentTime"`
	NodeEligible *bool                    `json:"nodeEligible,omitempty"`
	Healthy      bool                     `json:"healthy"`
	Status       map[string]ProxierHealth `json:"status,omitempty"` // by "IPv4" / "IPv6"
	// Degraded is kpipe's own: the names of side stages that failed recently. Never
	// their errors: this port is reachable from every pod, and stage errors carry
	// iptables and conntrack output (they stay on the debug listener's
	// /debug/stages and in the log). It never decides the answer's code.
	Degraded []string `json:"degraded,omitempty"`
}

// decide is kube-proxy's ProxyHealthServer.Health over the board's reports: a family
// is unhealthy when a change has been pending (coalesce's PendingSince) for timeout
// or longer; a family that has never committed counts as updated at started (kube-
// proxy marks each proxier updated when its sync loop starts). LastUpdated is the
// newest over the families. It ignores the node (see nodeEligible).
func decide(reports map[bus.StageName]bus.Report, families []bus.Family, started, now time.Time, timeout time.Duration) ProxyHealth {
	ph := ProxyHealth{CurrentTime: now, Healthy: true, Status: make(map[string]ProxierHealth, len(families))}
	for _, f := range families {
		last := reports[bus.Commit.Of(f)].LastSync
		if last.IsZero() {
			last = started
		}
		if last.After(ph.LastUpdated) {
			ph.LastUpdated = last
		}
		healthy := true
		if pending := reports[bus.Coalesce.Of(f)].PendingSince; !pending.IsZero() && now.Sub(pending) >= timeout {
			healthy = false
			ph.Healthy = false
		}
		ph.Status[f.String()] = ProxierHealth{LastUpdated: last, Healthy: healthy}
	}
	return ph
}

// nodeEligible is false once watch reports this node's deletion (kube-proxy's
// nodeEligible); true while starting, before watch has seen the node.
func nodeEligible(reports map[bus.StageName]bus.Report) bool {
	return !reports[bus.Watch].NodeDeleting
}

// degraded names the side stages whose last failure is younger than timeout, in
// side's order; nil when there are none.
func degraded(reports map[bus.StageName]bus.Report, side []bus.StageName, now time.Time, timeout time.Duration) []string {
	var out []string
	for _, name := range side {
		at := reports[name].LastErrorAt
		if !at.IsZero() && now.Sub(at) < timeout {
			out = append(out, string(name))
		}
	}
	return out
}

// proxyHealth is the current health, without the node check.
func (h *Health) proxyHealth() ProxyHealth {
	return decide(h.board.Read(), h.families, h.started, h.now(), h.timeout)
}

// healthzMux serves the healthz listener: /healthz and /livez, any method.
func (h *Health) healthzMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", h.serveHealthz)
	mux.HandleFunc("/livez", h.serveLivez)
	return mux
}

func (h *Health) serveHealthz(w http.ResponseWriter, _ *http.Request) {
	reports := h.board.Read()
	now := h.now()
	ph := decide(reports, h.families, h.started, now, h.timeout)
	ph.Degraded = degraded(reports, h.cfg.SideStages, now, h.timeout)
	eligible := nodeEligible(reports)
	ph.NodeEligible = &eligible
	h.answer(w, ph, ph.Healthy && eligible, now, "healthz")
}

func (h *Health) serveLivez(w http.ResponseWriter, _ *http.Request) {
	reports := h.board.Read()
	now := h.now()
	ph := decide(reports, h.families, h.started, now, h.timeout)
	ph.Degraded = degraded(reports, h.cfg.SideStages, now, h.timeout)
	h.answer(w, ph, ph.Healthy, now, "livez")
}

func (h *Health) answer(w http.ResponseWriter, ph ProxyHealth, healthy bool, now time.Time, which string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	code := http.StatusServiceUnavailable
	if healthy {
		code = http.StatusOK
		// As kube-proxy: a healthy answer reports lastUpdated as now, the meaning it
		// had in older releases; the metrics carry the real sync times.
		ph.LastUpdated = now
	}
	h.count(which, code)
	w.WriteHeader(code)
	out, err := json.Marshal(ph)
	if err != nil { // cannot happen: times within range, plain types
		h.log.Error("marshal health", "err", err)
		return
	}
	_, _ = w.Write(out)
}

func (h *Health) count(which string, code int) {
	if h.metrics == nil {
		return
	}
	label := "503"
	if code == http.StatusOK {
		label = "200"
	}
	if which == "healthz" {
		h.metrics.HealthzTotal.WithLabelValues(label).Inc()
	} else {
		h.metrics.LivezTotal.WithLabelValues(label).Inc()
	}
}
