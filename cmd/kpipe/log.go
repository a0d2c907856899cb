package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/lmittmann/tint"
	"golang.org/x/term"
	"k8s.io/component-base/logs"
	"k8s.io/klog/v2"
)

// textTimeFormat dates every text line, as klog's header does: a log read
// days later still says when.
const textTimeFormat = "2006-01-02 15:04:05.000"

// logLevel is the level of every line kpipe writes. The process has one, as
// it has one klog verbosity: /debug/flags/v changes both (setVerbosity).
var logLevel = new(slog.LevelVar)

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(strings.ToUpper(s))); err != nil {
		return 0, fmt.Errorf("--log-level %q: must be debug, info, warn or error", s)
	}
	return l, nil
}

// newLogger makes a logger (makeLogger) and makes it the process's
// (installLogger).
func newLogger(w io.Writer, format, level string) *slog.Logger {
	log := makeLogger(w, format)
	installLogger(log, level)
	return log
}

// makeLogger makes a logger, tint for people, JSON for machines, at the
// process's level (logLevel). It changes nothing of the process's.
func makeLogger(w io.Writer, format string) *slog.Logger {
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: logLevel}))
	}
	return slog.New(tint.NewHandler(w, &tint.Options{Level: logLevel, TimeFormat: textTimeFormat, NoColor: !isTerminal(w)}))
}

// installLogger makes log the process's: the process's level is level, and
// klog (client-go's logger) writes through log's handler, so every line has
// one format.
func installLogger(log *slog.Logger, level string) {
	l, _ := parseLevel(level) // checked by Options.complete
	logLevel.Set(l)
	klog.SetSlogLogger(slog.New(klogHandler{log.Handler()}))
}

// processLogger is kpipe's logger on stderr for o, and install, which makes
// it the process's with klog's verbosity o's -v: a reload installs it only
// once its configuration is taken.
func processLogger(o *Options) (log *slog.Logger, install func()) {
	log = makeLogger(os.Stderr, o.LogFormat)
	return log, func() {
		installLogger(log, o.LogLevel)
		setKlogVerbosity(o.Verbosity)
	}
}

// klogHandler is the handler klog writes through. klog's V(n) lines reach
// it at slog level -n; klog's verbosity (-v) decides which are written, and
// they are written at the level -v maps n to (levelOfVerbosity), so client-go
// shows at -v=2 what it shows under kube-proxy at -v=2.
type klogHandler struct{ slog.Handler }

func (h klogHandler) Enabled(ctx context.Context, l slog.Level) bool {
	if l >= slog.LevelInfo {
		return h.Handler.Enabled(ctx, l)
	}
	return klog.V(klog.Level(-l)).Enabled() && h.Handler.Enabled(ctx, levelOfV(-int(l)))
}

func (h klogHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelInfo {
		r.Level = levelOfV(-int(r.Level))
	}
	return h.Handler.Handle(ctx, r)
}

func (h klogHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return klogHandler{h.Handler.WithAttrs(as)}
}

func (h klogHandler) WithGroup(name string) slog.Handler {
	return klogHandler{h.Handler.WithGroup(name)}
}

// levelOfV is the slog level of klog's verbosity v.
func levelOfV(v int) slog.Level {
	if v >= 4 {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}

// setKlogVerbosity sets klog's -v, as kube-proxy's flag does.
func setKlogVerbosity(v int) {
	_, _ = logs.GlogSetter(strconv.Itoa(v)) // a non-negative int always parses
}

// setVerbosity is /debug/flags/v's PUT, as kube-proxy's: klog's verbosity
// (component-base's GlogSetter, with its answers), and kpipe's level as -v
// maps it.
func setVerbosity(val string) (string, error) {
	answer, err := logs.GlogSetter(val)
	if err != nil {
		return "", err
	}
	v, _ := strconv.Atoi(val) // GlogSetter took it: a uint32
	logLevel.Set(levelOfV(v))
	return answer, nil
}

// isTerminal says whether w is a terminal: colours are for people at one, not
// for a container runtime's log file.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}
