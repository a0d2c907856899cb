package main

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"
)

// Logs written to a file or a pipe (a container runtime's log) carry no colour codes.
func TestTextLogsHaveNoColoursWhenNotATerminal(t *testing.T) {
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
	var buf bytes.Buffer
	newLogger(&buf, "json", "info").Info("synced", "rules", 3)
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil || m["msg"] != "synced" {
		t.Errorf("json log %q: %v", buf.String(), err)
	}
}
