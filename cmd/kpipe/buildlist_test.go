package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestWorkspaceBuildsTheImagesVersions: CI and the README's commands build
// kpipe through go.work (which adds tools/, go-task's module), the Dockerfile
// with GOWORK=off (go.mod alone). Both must select the same version of every
// module that kpipe and its tests compile: the image must ship what CI
// tested. When this fails, raise the product's go.mod to the workspace's
// versions (`GOWORK=off go get module@version`, then `go mod tidy`).
func TestWorkspaceBuildsTheImagesVersions(t *testing.T) {
	root := moduleRoot(t)
	if _, err := os.Stat(filepath.Join(root, "go.work")); err != nil {
		t.Skipf("no go.work beside go.mod (%v): nothing to compare", err)
	}
	workspace := buildList(t, root, "GOWORK="+filepath.Join(root, "go.work"))
	module := buildList(t, root, "GOWORK=off")
	if diff := listDiff(module, workspace); diff != "" {
		t.Errorf("go.mod alone (the Dockerfile) and go.work (CI, the README) build different versions (-go.mod, +go.work):\n%s", diff)
	}
}

// moduleRoot is the directory of the product module's go.mod.
func moduleRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// buildList is module@version of every module that packages of ./... and their
// tests import, one each, sorted, as go list sees them with env added.
func buildList(t *testing.T, root string, env ...string) []string {
	t.Helper()
	cmd := exec.Command("go", "list", "-deps", "-test", "-f", "{{with .Module}}{{.Path}}@{{.Version}}{{end}}", "./...")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%v go list: %v\n%s", env, err, stderrOf(err))
	}
	list := strings.Fields(string(out))
	slices.Sort(list)
	return slices.Compact(list)
}

func stderrOf(err error) []byte {
	if e, ok := err.(*exec.ExitError); ok {
		return e.Stderr
	}
	return nil
}

// listDiff is "-" for each line only in a and "+" for each only in b, in
// order; "" when a and b are equal.
func listDiff(a, b []string) string {
	var d strings.Builder
	for _, s := range a {
		if !slices.Contains(b, s) {
			fmt.Fprintf(&d, "-%s\n", s)
		}
	}
	for _, s := range b {
		if !slices.Contains(a, s) {
			fmt.Fprintf(&d, "+%s\n", s)
		}
	}
	return d.String()
}
