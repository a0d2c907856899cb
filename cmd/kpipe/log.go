package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/lmittmann/tint"
	"golang.org/x/term"
)

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(strings.ToUpper(s))); err != nil {
		return 0, fmt.Errorf("--log-level %q: must be debug, info, warn or error", s)
	}
	return l, nil
}

// newLogger makes the process logger: tint for people, JSON for machines.
func newLogger(w io.Writer, format, level string) *slog.Logger {
	l, _ := parseLevel(level) // checked by Options.complete
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: l}))
	}
	return slog.New(tint.NewHandler(w, &tint.Options{Level: l, TimeFormat: time.TimeOnly, NoColor: !isTerminal(w)}))
}

// isTerminal says whether w is a terminal: colours are for people at one, not
// for a container runtime's log file.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}
