package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// execVariables are the only non-literal programs kpipe's code may exec, by file
// and expression, each a fixed name: runTool's binary is Tool.binary(suffix)
// ("iptables" or "ip6tables", the backend, "-save"/"-restore"), which the test
// below checks is only ever called with literals; nftBinary is "nft" (a variable
// so a test can point it at a missing binary); netnstest's Output runs the tool a
// test names in the test's namespace (test support: only tests import it).
var execVariables = map[string]string{
	"netfilter/tool.go":                "binary",
	"netfilter/cleanup.go":             "nftBinary",
	"netfilter/netnstest/netnstest.go": "name",
}

// TestExecOnlyFixedBinaries: every program kpipe's code starts is a fixed binary
// with an argument list: exec.Command/CommandContext with a literal name (or one
// of execVariables), never a shell, and no other way to start a process.
func TestExecOnlyFixedBinaries(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	sites := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch d.Name() {
			case "e2e", "tools", "testdata", ".git":
				return filepath.SkipDir // the test bed and dev tools are not kpipe
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		sites += auditFile(t, filepath.ToSlash(rel), path)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if sites == 0 {
		t.Fatal("found no exec call at all: is the walk looking at kpipe's code?")
	}
}

// auditFile checks one file and returns how many exec calls it holds.
func auditFile(t *testing.T, rel, path string) int {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	execName := ""
	for _, imp := range f.Imports {
		if p, _ := strconv.Unquote(imp.Path.Value); p == "os/exec" {
			execName = "exec"
			if imp.Name != nil {
				execName = imp.Name.Name
			}
		}
	}
	sites := 0
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		at := fset.Position(call.Pos())
		if strings.HasPrefix(rel, "netfilter/") && sel.Sel.Name == "binary" && (len(call.Args) != 1 || !isStringLit(call.Args[0])) {
			// Tool.binary's suffix is always a literal, so runTool's binary is fixed.
			t.Errorf("%s: Tool.binary called with something other than a string literal", at)
		}
		pkg, _ := sel.X.(*ast.Ident)
		if pkg == nil {
			return true
		}
		switch {
		case pkg.Name == execName && (sel.Sel.Name == "Command" || sel.Sel.Name == "CommandContext"):
			sites++
			args := call.Args
			if sel.Sel.Name == "CommandContext" {
				args = args[1:]
			}
			checkProgram(t, rel, at, args)
		case sel.Sel.Name == "StartProcess" || ((pkg.Name == "syscall" || pkg.Name == "unix") && strings.Contains(sel.Sel.Name, "Exec")):
			t.Errorf("%s: %s.%s starts a process outside exec.Command", at, pkg.Name, sel.Sel.Name)
		}
		return true
	})
	return sites
}

func checkProgram(t *testing.T, rel string, at token.Position, args []ast.Expr) {
	t.Helper()
	if len(args) == 0 {
		t.Errorf("%s: exec with no program", at)
		return
	}
	switch prog := args[0].(type) {
	case *ast.BasicLit:
		name, _ := strconv.Unquote(prog.Value)
		if base := filepath.Base(name); base == "sh" || base == "bash" || base == "dash" || base == "env" {
			t.Errorf("%s: execs %q: a shell (or env) reads a command line; exec the program with an argument list", at, name)
		}
	case *ast.Ident:
		if execVariables[rel] != prog.Name {
			t.Errorf("%s: execs the variable %s; the program must be a literal (or listed in execVariables, with why it is fixed)", at, prog.Name)
		}
	default:
		t.Errorf("%s: execs a computed program; it must be a literal", at)
	}
	for _, a := range args[1:] {
		if l, ok := a.(*ast.BasicLit); ok && l.Value == `"-c"` {
			t.Errorf("%s: passes -c: looks like a shell command line", at)
		}
	}
}

func isStringLit(e ast.Expr) bool {
	l, ok := e.(*ast.BasicLit)
	return ok && l.Kind == token.STRING
}
