package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/version"

	"github.com/kpipe/kpipe/metrics"
)

// Stamped at build time, as Kubernetes stamps its binaries:
//
//	go build -ldflags "-X main.gitVersion=v0.1.0 -X main.gitCommit=<sha> -X main.gitTreeState=clean -X main.buildDate=<RFC 3339>"
//
// (Taskfile.yml's build, the Dockerfile). A build nobody stamped says so.
var (
	gitVersion   string
	gitCommit    string
	gitTreeState string
	buildDate    string
)

// unstampedVersion is the version of a build nobody stamped (go build, go test).
const unstampedVersion = "v0.0.0-dev"

// buildInfo is what kpipe reports of its own build: --version and
// kpipe_build_info (kube-proxy's kubernetes_build_info, less major and minor).
type buildInfo struct {
	GitVersion, GitCommit, GitTreeState, BuildDate, GoVersion, Compiler, Platform string
}

// getBuildInfo is the stamp, else what the Go toolchain recorded (the module
// version of `go install …@vX`, the commit of a build in a git work tree),
// else "unknown".
func getBuildInfo() buildInfo {
	b := buildInfo{GitVersion: gitVersion, GitCommit: gitCommit, GitTreeState: gitTreeState, BuildDate: buildDate,
		GoVersion: runtime.Version(), Compiler: runtime.Compiler, Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if b.GitVersion == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			b.GitVersion = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision" && b.GitCommit == "":
				b.GitCommit = s.Value
			case s.Key == "vcs.modified" && b.GitTreeState == "":
				b.GitTreeState = map[string]string{"true": "dirty", "false": "clean"}[s.Value]
			}
		}
	}
	b.GitVersion = orElse(b.GitVersion, unstampedVersion)
	b.GitCommit = orElse(b.GitCommit, "unknown")
	b.GitTreeState = orElse(b.GitTreeState, "unknown")
	b.BuildDate = orElse(b.BuildDate, "unknown")
	return b
}

func orElse(s, otherwise string) string {
	if s == "" {
		return otherwise
	}
	return s
}

// String is --version's line.
func (b buildInfo) String() string {
	return fmt.Sprintf("kpipe %s (commit %s, %s %s)", b.GitVersion, b.GitCommit, b.GoVersion, b.Platform)
}

// versionInfo is the build in the shape kube-proxy's --version=raw prints
// (apimachinery's version.Info), major and minor read from the version; kpipe
// emulates no other version, so those fields stay empty as in an unset one.
func (b buildInfo) versionInfo() version.Info {
	major, minor := majorMinor(b.GitVersion)
	return version.Info{Major: major, Minor: minor, GitVersion: b.GitVersion, GitCommit: b.GitCommit,
		GitTreeState: b.GitTreeState, BuildDate: b.BuildDate, GoVersion: b.GoVersion, Compiler: b.Compiler, Platform: b.Platform}
}

// majorMinor is "1", "2" of "v1.2.3-rc.1"; empty strings when v is not vX.Y....
func majorMinor(v string) (major, minor string) {
	parts := strings.SplitN(strings.TrimPrefix(v, "v"), ".", 3)
	if len(parts) < 2 {
		return "", ""
	}
	for _, p := range parts[:2] {
		if _, err := strconv.ParseUint(p, 10, 32); err != nil {
			return "", ""
		}
	}
	return parts[0], parts[1]
}

// buildInfoMetric is kpipe_build_info for this binary.
func buildInfoMetric() prometheus.Collector { return metrics.BuildInfo(buildLabels()) }

// buildLabels are this binary's build as kpipe_build_info labels it.
func buildLabels() prometheus.Labels {
	b := getBuildInfo()
	return prometheus.Labels{"git_version": b.GitVersion, "git_commit": b.GitCommit,
		"git_tree_state": b.GitTreeState, "build_date": b.BuildDate, "go_version": b.GoVersion,
		"compiler": b.Compiler, "platform": b.Platform}
}

// versionFlag is kube-proxy's --version: true (or bare) prints the version and
// exits, raw prints every field of the build as kube-proxy does and exits,
// false runs.
// kube-proxy's --version=vX.Y.Z, which changes the version it reports, is
// refused: kpipe reports its own.
type versionFlag string

const (
	versionOff  versionFlag = "false"
	versionLine versionFlag = "true"
	versionRaw  versionFlag = "raw"
)

func (v *versionFlag) Set(s string) error {
	if s == string(versionRaw) {
		*v = versionRaw
		return nil
	}
	on, err := strconv.ParseBool(s)
	if err != nil {
		return fmt.Errorf("%q: want true, false or raw (kpipe reports its own version; it cannot be set)", s)
	}
	*v = versionOff
	if on {
		*v = versionLine
	}
	return nil
}

func (v *versionFlag) String() string { return string(*v) }
func (v *versionFlag) Type() string   { return "version" }

// text is what the flag prints, "" when it asks for nothing.
func (v versionFlag) text() string {
	switch v {
	case versionLine:
		return getBuildInfo().String()
	case versionRaw:
		return fmt.Sprintf("%#v", getBuildInfo().versionInfo())
	}
	return ""
}
