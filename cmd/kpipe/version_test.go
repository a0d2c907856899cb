package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// runVersion runs kpipe's command line with a fake proxy and returns the exit
// code, stdout and whether the proxy ran.
func runVersion(t *testing.T, args ...string) (code int, stdout string, ran bool) {
	t.Helper()
	code, stdout = captureStdout(t, func() int {
		c, _ := captureStderr(t, func() int {
			return runWith(args, func(context.Context, *Options) error { ran = true; return nil })
		})
		return c
	})
	return code, stdout, ran
}

// TestVersionFlag: kube-proxy's --version forms print kpipe's version on
// stdout and exit 0 without running the proxy; --version=false runs it.
func TestVersionFlag(t *testing.T) {
	// go test does not stamp: the version says so, with the Go that built it.
	line := "kpipe v0.0.0-dev (commit unknown, " + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH + ")\n"
	for _, args := range [][]string{{"--version"}, {"--version=true"}, {"--config=/no/such/file", "--version"}} {
		code, stdout, ran := runVersion(t, args...)
		if code != 0 || ran || stdout != line {
			t.Errorf("%q: exit %d, ran the proxy %v, stdout %q; want exit 0, not run, %q", args, code, ran, stdout, line)
		}
	}
	// --version=raw prints the build as kube-proxy prints its own: a Go
	// literal of apimachinery's version.Info.
	code, stdout, ran := runVersion(t, "--version=raw")
	raw := `version.Info{Major:"0", Minor:"0", EmulationMajor:"", EmulationMinor:"", MinCompatibilityMajor:"", MinCompatibilityMinor:"", ` +
		`GitVersion:"v0.0.0-dev", GitCommit:"unknown", GitTreeState:"unknown", BuildDate:"unknown", GoVersion:"` + runtime.Version() +
		`", Compiler:"` + runtime.Compiler + `", Platform:"` + runtime.GOOS + "/" + runtime.GOARCH + `"}` + "\n"
	if code != 0 || ran || stdout != raw {
		t.Errorf("--version=raw: exit %d, ran the proxy %v, stdout %q; want exit 0, not run, %q", code, ran, stdout, raw)
	}
	code, stdout, ran = runVersion(t, "--version=false")
	if code != 0 || !ran || stdout != "" {
		t.Errorf("--version=false: exit %d, ran the proxy %v, stdout %q; want the proxy run", code, ran, stdout)
	}
	// kube-proxy's --version=vX.Y.Z sets the version it reports: kpipe reports its own.
	code, stdout, ran = runVersion(t, "--version=v1.34.0")
	if code != 1 || ran || stdout != "" {
		t.Errorf("--version=v1.34.0: exit %d, ran the proxy %v, stdout %q; want exit 1", code, ran, stdout)
	}
}

// TestBuildInfoMetric: kpipe_build_info is 1, labelled with the build
// --version reports.
func TestBuildInfoMetric(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(buildInfoMetric())
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(families) != 1 || families[0].GetName() != "kpipe_build_info" {
		t.Fatalf("gathered %v, want kpipe_build_info alone", families)
	}
	m := families[0].GetMetric()[0]
	labels := map[string]string{}
	for _, l := range m.GetLabel() {
		labels[l.GetName()] = l.GetValue()
	}
	want := map[string]string{"git_version": "v0.0.0-dev", "git_commit": "unknown", "git_tree_state": "unknown",
		"build_date": "unknown", "go_version": runtime.Version(), "compiler": runtime.Compiler,
		"platform": runtime.GOOS + "/" + runtime.GOARCH}
	for k, v := range want {
		if labels[k] != v {
			t.Errorf("label %s=%q, want %q (labels %v)", k, labels[k], v, labels)
		}
	}
	if len(labels) != len(want) || m.GetGauge().GetValue() != 1 {
		t.Errorf("kpipe_build_info%v %v, want exactly the labels %v and 1", labels, m.GetGauge().GetValue(), want)
	}
}

// TestVersionStampedAtBuild: a binary built with the -ldflags of Taskfile.yml
// and the Dockerfile reports the stamp, and the same as kube-proxy (the
// image's /usr/local/bin/kube-proxy is kpipe under that name).
func TestVersionStampedAtBuild(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "kpipe")
	ldflags := "-X main.gitVersion=v9.8.7-stamp -X main.gitCommit=0123abcd -X main.gitTreeState=clean -X main.buildDate=2026-01-02T03:04:05Z"
	build := exec.Command("go", "build", "-ldflags", ldflags, "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if err := os.Symlink("kpipe", filepath.Join(dir, "kube-proxy")); err != nil {
		t.Fatal(err)
	}
	want := "kpipe v9.8.7-stamp (commit 0123abcd, " + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH + ")\n"
	for _, name := range []string{"kpipe", "kube-proxy"} {
		out, err := exec.Command(filepath.Join(dir, name), "--version").Output()
		if err != nil || string(out) != want {
			t.Errorf("%s --version: %q, %v; want %q", name, out, err, want)
		}
	}
	out, err := exec.Command(bin, "--version=raw").Output()
	if err != nil || !strings.Contains(string(out), `GitTreeState:"clean"`) || !strings.Contains(string(out), `BuildDate:"2026-01-02T03:04:05Z"`) {
		t.Errorf("kpipe --version=raw: %q, %v; want the stamped tree state and build date", out, err)
	}
}
