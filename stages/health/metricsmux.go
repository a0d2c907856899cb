package health

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/pprof"
	"sort"
	"strings"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/component-base/metrics/prometheus/slis"
)

// proxyMode is what /proxyMode answers: kpipe stands in for kube-proxy's iptables mode.
const proxyMode = "iptables"

// ConfigzKey is the key kube-proxy's configuration is registered under in /configz.
const ConfigzKey = "kubeproxy.config.k8s.io"

// metricsMux serves the metrics listener as kube-proxy's serveMetrics does: /healthz
// (the ping-only apiserver healthz), /metrics/slis (its SLI), /proxyMode, /metrics,
// /configz, kpipe's /sync and /status and, with Profiling, the profiling handlers and
// /debug/flags/v. Never /debug/stages: that is the debug listener's alone.
func (h *Health) metricsMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", servePingHealthz)
	mux.HandleFunc("/healthz/ping", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "ok") })
	slis.SLIMetricsWithReset{}.Install(mux)
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		fmt.Fprint(w, proxyMode)
	})
	if h.gatherer != nil {
		mux.Handle("/metrics", promhttp.HandlerFor(h.gatherer, promhttp.HandlerOpts{
			ErrorLog: slogPromLogger{h}, ErrorHandling: promhttp.HTTPErrorOnError}))
	}
	mux.HandleFunc("/configz", h.serveConfigz)
	mux.HandleFunc("GET /sync", h.serveSync)
	mux.HandleFunc("GET /status", h.serveStatus)
	if h.cfg.Profiling {
		handlePprof(mux)
		if h.setV != nil {
			mux.HandleFunc("/debug/flags/v", putFlag(h.setV))
		}
	}
	return mux
}

// putFlag answers as k8s.io/apiserver's StringFlagPutHandler, which
// kube-proxy mounts on /debug/flags/v: a PUT's body goes to set (200, or 400
// with set's error), any other method is 406.
func putFlag(set func(string) (string, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPut {
			writePlainText(w, http.StatusNotAcceptable, "unsupported http method")
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, maxFlagBody))
		if err != nil {
			writePlainText(w, http.StatusBadRequest, "error reading request body: "+err.Error())
			return
		}
		answer, err := set(string(body))
		if err != nil {
			writePlainText(w, http.StatusBadRequest, err.Error())
			return
		}
		writePlainText(w, http.StatusOK, answer)
	}
}

func writePlainText(w http.ResponseWriter, code int, text string) {
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	fmt.Fprintln(w, text)
}

// maxFlagBody bounds what a PUT to /debug/flags/v is read of: a verbosity is a few digits.
const maxFlagBody = 1 << 10

// debugMux serves the debug listener: pprof and the supervisor's /debug/stages
// (which can kill a stage).
func (h *Health) debugMux() http.Handler {
	mux := http.NewServeMux()
	handlePprof(mux)
	if h.stages != nil {
		mux.Handle("/debug/stages", h.stages)
		mux.Handle("/debug/stages/", h.stages)
	}
	return mux
}

// handlePprof registers the profiling handlers on mux only: importing
// net/http/pprof also registers them on http.DefaultServeMux, which kpipe never
// serves.
func handlePprof(mux *http.ServeMux) {
	mux.HandleFunc("/debug/pprof", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/debug/pprof/", http.StatusFound)
	})
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
}

// servePingHealthz is k8s.io/apiserver's healthz handler with only the ping check,
// which is what kube-proxy installs on its metrics listener.
func servePingHealthz(w http.ResponseWriter, r *http.Request) {
	var out bytes.Buffer
	excluded := map[string]bool{}
	for _, name := range r.URL.Query()["exclude"] {
		excluded[name] = true
	}
	if excluded["ping"] {
		delete(excluded, "ping")
		out.WriteString("[+]ping excluded: ok\n")
	} else {
		_ = slis.ObserveHealthcheck(r.Context(), "ping", "healthz", slis.Success) // /metrics/slis
		out.WriteString("[+]ping ok\n")
	}
	if len(excluded) > 0 {
		names := make([]string, 0, len(excluded))
		for name := range excluded {
			names = append(names, fmt.Sprintf("%q", name))
		}
		sort.Strings(names)
		fmt.Fprintf(&out, "warn: some health checks cannot be excluded: no matches for %s\n", strings.Join(names, ","))
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if _, verbose := r.URL.Query()["verbose"]; !verbose {
		fmt.Fprint(w, "ok")
		return
	}
	_, _ = out.WriteTo(w)
	fmt.Fprint(w, "healthz check passed\n")
}

// serveConfigz answers as component-base's configz: a JSON object of the registered
// configurations by name.
func (h *Health) serveConfigz(w http.ResponseWriter, _ *http.Request) {
	configs := map[string]any{}
	if h.cfg.Configz != nil {
		configs[ConfigzKey] = h.cfg.Configz
	}
	b, err := json.Marshal(configs)
	if err != nil {
		http.Error(w, fmt.Sprintf("error marshaling json: %v", err), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	_, _ = w.Write(b)
}

// slogPromLogger hands promhttp's error log to slog.
type slogPromLogger struct{ h *Health }

func (l slogPromLogger) Println(v ...any) {
	l.h.log.Error("serve metrics", "err", strings.TrimSuffix(fmt.Sprintln(v...), "\n"))
}
