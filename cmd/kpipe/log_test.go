package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2"
)

// Logs written to a file or a pipe (a container runtime's log) carry no colour codes.
func TestTextLogsHaveNoColoursWhenNotATerminal(t *testing.T) {
	restoreLogging(t)
	var buf bytes.Buffer
	newLogger(&buf, "text", "info").Warn("canary flushed", "family", "IPv4")
	if strings.Contains(buf.String(), "\x1b[") {
		t.Errorf("log to a buffer has ANSI escapes: %q", buf.String())
	}
	f, err := os.CreateTemp(t.TempDir(), "log")
	if err != nil {
		t.Fatal(err)
	}
	newLogger(f, "text", "info").Error("commit failed", "err", "boom")
	f.Close()
	b, _ := os.ReadFile(f.Name())
	if strings.Contains(string(b), "\x1b[") || !strings.Contains(string(b), "commit failed") {
		t.Errorf("log to a file: %q; want the message without ANSI escapes", b)
	}
}

func TestJSONLogsStayJSON(t *testing.T) {
	restoreLogging(t)
	var buf bytes.Buffer
	newLogger(&buf, "json", "info").Info("synced", "rules", 3)
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil || m["msg"] != "synced" {
		t.Errorf("json log %q: %v", buf.String(), err)
	}
}

// client-go logs through klog: with --logging-format=json its lines are JSON
// on kpipe's stream too, errors with their error.
func TestKlogLinesComeOutAsJSON(t *testing.T) {
	restoreLogging(t)
	var buf bytes.Buffer
	newLogger(&buf, "json", "info")
	klog.InfoS("watch started", "resource", "services")
	klog.ErrorS(errors.New("connection refused"), "list failed", "resource", "endpointslices")
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	if len(lines) != 2 {
		t.Fatalf("klog wrote %d lines to kpipe's log, want 2: %q", len(lines), buf.String())
	}
	for i, want := range []map[string]any{
		{"level": "INFO", "msg": "watch started", "resource": "services"},
		{"level": "ERROR", "msg": "list failed", "resource": "endpointslices", "err": "connection refused"},
	} {
		var got map[string]any
		if err := json.Unmarshal([]byte(lines[i]), &got); err != nil {
			t.Fatalf("line %d is not JSON (%v): %q", i+1, err, lines[i])
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("line %d: %s = %v, want %v (%q)", i+1, k, got[k], v, lines[i])
			}
		}
	}
}

// Text lines carry the date, as klog's do: a log read days later still says when.
func TestTextLogsCarryTheDate(t *testing.T) {
	restoreLogging(t)
	var buf bytes.Buffer
	before := time.Now().Format(time.DateOnly)
	newLogger(&buf, "text", "info").Info("synced")
	after := time.Now().Format(time.DateOnly) // the day may turn meanwhile
	if !strings.HasPrefix(buf.String(), before) && !strings.HasPrefix(buf.String(), after) {
		t.Errorf("text line %q does not start with the date %s", buf.String(), after)
	}
}

// client-go's V(n) lines show as kube-proxy's -v shows them: at -v=2 its
// V(2) lines, at kpipe's info level; none at -v=0.
func TestKlogVerbosityDecidesClientGoLines(t *testing.T) {
	restoreLogging(t)
	for _, c := range []struct {
		v     int
		lines int
	}{{0, 0}, {2, 1}} {
		var buf bytes.Buffer
		newLogger(&buf, "json", "info")
		setKlogVerbosity(c.v)
		klog.V(2).InfoS("relisted", "resource", "services")
		klog.Background().V(2).Info("relisted", "resource", "services") // contextual logging too
		if got := strings.Count(buf.String(), "\n"); got != 2*c.lines {
			t.Errorf("-v=%d: %d lines, want %d: %q", c.v, got, 2*c.lines, buf.String())
		}
		if c.lines > 0 && !strings.Contains(buf.String(), `"level":"INFO"`) {
			t.Errorf("-v=%d: V(2) lines not at INFO: %q", c.v, buf.String())
		}
	}
}

// PUT /debug/flags/v changes klog's verbosity and kpipe's level as -v maps
// it; a value that is not a verbosity changes nothing.
func TestSetVerbosityChangesBothLevels(t *testing.T) {
	restoreLogging(t)
	var buf bytes.Buffer
	log := newLogger(&buf, "json", "info")
	if _, err := setVerbosity("4"); err != nil {
		t.Fatal(err)
	}
	log.Debug("per-object detail")
	klog.V(4).InfoS("client-go detail")
	if n := strings.Count(buf.String(), `"level":"DEBUG"`); n != 2 {
		t.Errorf("after v=4: %d debug lines, want kpipe's and klog's: %q", n, buf.String())
	}
	if _, err := setVerbosity("loud"); err == nil {
		t.Error(`setVerbosity("loud") accepted`)
	}
	if _, err := setVerbosity("1"); err != nil {
		t.Fatal(err)
	}
	buf.Reset()
	log.Debug("per-object detail")
	klog.V(4).InfoS("client-go detail")
	if buf.Len() != 0 {
		t.Errorf("after v=1: debug lines still written: %q", buf.String())
	}
}

// With --logging-format=json, the error kpipe stops on is a JSON line too,
// as kube-proxy logs it through klog once logging is set up: a collector
// parsing kpipe's log sees why it stopped. (Here: a kubeconfig that is not
// there, found before anything on the host is touched.)
func TestFatalErrorIsAJSONLine(t *testing.T) {
	restoreLogging(t)
	code, stderr := runCaptured(t, "--logging-format=json", "--kubeconfig=/no/such/kubeconfig", "--hostname-override=n1")
	if code != 1 {
		t.Fatalf("exit %d; want 1 (stderr %q)", code, stderr)
	}
	named := false
	for _, line := range strings.Split(strings.TrimSpace(stderr), "\n") {
		var fields map[string]any
		if err := json.Unmarshal([]byte(line), &fields); err != nil {
			t.Errorf("stderr line %q is not JSON: %v", line, err)
		}
		named = named || strings.Contains(line, "/no/such/kubeconfig")
	}
	if !named {
		t.Errorf("no line names the missing kubeconfig: %q", stderr)
	}
}

// A reloaded configuration kpipe rejects (here: its kubeconfig is not
// there) leaves the process's logging as it was: the level, and client-go's
// (klog's) verbosity.
func TestRejectedReloadKeepsTheLogging(t *testing.T) {
	var buf bytes.Buffer
	newLogger(&buf, "text", "info")
	setKlogVerbosity(0)
	restoreLogging(t)
	o := defaultOptions()
	o.LogFormat, o.LogLevel, o.Verbosity, o.Kubeconfig = "json", "debug", 6, "/no/such/kubeconfig"
	if _, err := reconfigure(o, deps{}); err == nil {
		t.Fatal("a configuration with no kubeconfig was taken")
	}
	if l := logLevel.Level(); l != slog.LevelInfo {
		t.Errorf("log level %v after a rejected reload; want INFO, as before it", l)
	}
	if klog.V(6).Enabled() {
		t.Error("klog's verbosity is the rejected configuration's 6")
	}
}

// restoreLogging puts the process's logging back when t ends: the tests here
// install loggers (newLogger), and klog must not go on writing into a
// finished test's buffer.
func restoreLogging(t *testing.T) {
	t.Cleanup(func() {
		klog.ClearLogger()
		logLevel.Set(slog.LevelInfo)
		setKlogVerbosity(0)
	})
}
