package e2e

import (
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// kubeadmCommand is the container command of kubeadm v1.34's kube-proxy
// DaemonSet (cmd/kubeadm/app/phases/addons/proxy/manifests.go), which
// `kubectl set image` keeps: the image must run it.
var kubeadmCommand = []string{"/usr/local/bin/kube-proxy", "--config=/var/lib/kube-proxy/config.conf", "--hostname-override=$(NODE_NAME)"}

// iptablesCommands are the commands kube-proxy's image (and kpipe's) have as
// the iptables-wrapper, which picks the host's backend on the first run.
var iptablesCommands = []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"}

// imageLayout is what the Dockerfile's last stage (the image) puts where.
type imageLayout struct {
	copied map[string]string // destination → source ("stage:path" for COPY --from=stage)
	links  map[string]string // link → target, made by `ln -s` in a RUN
	runs   []string          // the RUN commands
}

var lnSymlink = regexp.MustCompile(`\bln\s+-sf?\s+(\S+)\s+(\S+)`)

// readImageLayout reads ../Dockerfile: continuation lines joined, comments
// skipped, only the last stage kept.
func readImageLayout(t *testing.T) imageLayout {
	t.Helper()
	data, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var img imageLayout
	var logical strings.Builder
	for line := range strings.Lines(string(data)) {
		line = strings.TrimRight(line, "\n")
		if strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		if head, more := strings.CutSuffix(line, `\`); more {
			logical.WriteString(head + " ")
			continue
		}
		logical.WriteString(line)
		f := strings.Fields(logical.String())
		logical.Reset()
		switch {
		case len(f) == 0:
		case f[0] == "FROM":
			img = imageLayout{copied: map[string]string{}, links: map[string]string{}}
		case f[0] == "COPY" && len(f) >= 3:
			from, args := "", f[1:]
			for len(args) > 0 && strings.HasPrefix(args[0], "--") {
				if stage, ok := strings.CutPrefix(args[0], "--from="); ok {
					from = stage + ":"
				}
				args = args[1:]
			}
			if len(args) == 2 {
				img.copied[args[1]] = from + args[0]
			}
		case f[0] == "RUN":
			run := strings.Join(f[1:], " ")
			img.runs = append(img.runs, run)
			for _, m := range lnSymlink.FindAllStringSubmatch(run, -1) {
				img.links[m[2]] = m[1]
			}
		}
	}
	if img.copied == nil {
		t.Fatal("the Dockerfile has no FROM")
	}
	return img
}

// resolve follows the image's links from p to a copied file and returns
// where it was copied from ("" if nothing is there).
func (img imageLayout) resolve(p string) string {
	for range 10 {
		if src, ok := img.copied[p]; ok {
			return src
		}
		target, ok := img.links[p]
		if !ok {
			return ""
		}
		if !path.IsAbs(target) {
			target = path.Join(path.Dir(p), target)
		}
		p = target
	}
	return ""
}

// TestDeployImageRunsKubeadmsCommand: the DaemonSet runs kubeadm's command,
// and the image runs it as kpipe: /usr/local/bin/kube-proxy (and kpipe) is
// the binary the build stage made, and the iptables commands are the
// iptables-wrapper (installed beside Debian's backends, in /usr/sbin).
func TestDeployImageRunsKubeadmsCommand(t *testing.T) {
	_, c := deployDaemonSet(t)
	if !slices.Equal(c.Command, kubeadmCommand) || len(c.Args) != 0 {
		t.Errorf("command %q, args %q; want kubeadm's command %q and no args", c.Command, c.Args, kubeadmCommand)
	}
	img := readImageLayout(t)
	for _, bin := range []string{"/usr/local/bin/kube-proxy", "/usr/local/bin/kpipe"} {
		if src := img.resolve(bin); src != "build:/out/kpipe" {
			t.Errorf("the image's %s is %q, want the build stage's /out/kpipe (copied %v, links %v)", bin, src, img.copied, img.links)
		}
	}
	const wrapper = "/usr/sbin/iptables-wrapper"
	if src := img.copied[wrapper]; src != "deploy/iptables-wrapper.sh" {
		t.Errorf("the image's %s is %q, want deploy/iptables-wrapper.sh", wrapper, src)
	}
	if !slices.ContainsFunc(img.runs, func(r string) bool { return strings.Contains(r, wrapper+" --install") }) {
		t.Errorf("no RUN %s --install (which links %v to it) in %q", wrapper, iptablesCommands, img.runs)
	}
}

// TestDeployIPTablesWrapper: installed beside the two backends, the wrapper
// makes the six iptables commands its own; the first of them run in a network
// namespace picks the backend the namespace's rules say (the kubelet's hint
// chain, else the backend with more rules), answers from it (`iptables -V`,
// which kpipe asks to choose how to write its rules, names it; an
// iptables-restore first writes all its input there) and leaves all six
// pointing at it.
func TestDeployIPTablesWrapper(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, tool := range []string{"xtables-legacy-multi", "xtables-nft-multi"} {
		if _, err := exec.LookPath(tool); err != nil {
			netnstest.Unavailable(t, tool+" is not installed")
		}
	}
	for _, tt := range []struct {
		name, mode, version string
		setup               [][]string // run in the namespace before the first iptables command
		restoreFirst        bool       // the first command is iptables-restore, not iptables -V
	}{
		{"legacy hint", "legacy", "(legacy)", [][]string{{"iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"},
			{"iptables-nft", "-A", "INPUT", "-j", "ACCEPT"}, {"iptables-nft", "-A", "INPUT", "-j", "ACCEPT"}}, true},
		{"nft hint", "nft", "(nf_tables)", [][]string{{"ip6tables-nft", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"},
			{"iptables-legacy", "-A", "INPUT", "-j", "ACCEPT"}}, false},
		{"more legacy rules", "legacy", "(legacy)", [][]string{{"iptables-legacy", "-A", "INPUT", "-j", "ACCEPT"},
			{"ip6tables-legacy", "-A", "INPUT", "-j", "ACCEPT"}, {"iptables-nft", "-A", "INPUT", "-j", "ACCEPT"}}, false},
		{"no rules", "nft", "(nf_tables)", nil, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sbin := installWrapper(t)
			ns := netnstest.New(t)
			ns.Run(t, func() error {
				for _, args := range tt.setup {
					if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
						t.Fatalf("%q: %v: %s", args, err, out)
					}
				}
				if tt.restoreFirst {
					restore := exec.Command(filepath.Join(sbin, "iptables-restore"), "--noflush")
					restore.Stdin = strings.NewReader("*filter\n:WRAPPER-TEST - [0:0]\n-A WRAPPER-TEST -j ACCEPT\nCOMMIT\n")
					if out, err := restore.CombinedOutput(); err != nil {
						t.Fatalf("iptables-restore through the wrapper: %v: %s", err, out)
					}
					backend := filepath.Join(sbin, "xtables-"+tt.mode+"-multi")
					out, err := exec.Command(backend, "iptables-save", "-t", "filter").Output()
					if err != nil || !strings.Contains(string(out), "-A WRAPPER-TEST -j ACCEPT") {
						t.Errorf("%s iptables-save after iptables-restore through the wrapper: %v\n%s\nwant the restored chain and rule", backend, err, out)
					}
				}
				out, err := exec.Command(filepath.Join(sbin, "iptables"), "-V").Output()
				if err != nil || !strings.Contains(string(out), tt.version) {
					t.Errorf("iptables -V: %q, %v; want %s", out, err, tt.version)
				}
				checkLinks(t, sbin, "xtables-"+tt.mode+"-multi")
				// From now on the commands are the backend's: the wrapper is not run.
				out, err = exec.Command(filepath.Join(sbin, "ip6tables"), "-V").Output()
				if err != nil || !strings.Contains(string(out), tt.version) {
					t.Errorf("ip6tables -V after the switch: %q, %v; want %s", out, err, tt.version)
				}
				return nil
			})
		})
	}
}

// installWrapper puts deploy/iptables-wrapper.sh in a new directory beside
// links to the host's two backends, as the image has it in /usr/sbin, runs
// its --install and checks that the six commands are the wrapper.
func installWrapper(t *testing.T) string {
	t.Helper()
	sbin := t.TempDir()
	script, err := os.ReadFile(filepath.Join(deployDir, "iptables-wrapper.sh"))
	if err != nil {
		t.Fatal(err)
	}
	wrapper := filepath.Join(sbin, "iptables-wrapper")
	if err := os.WriteFile(wrapper, script, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tool := range []string{"xtables-legacy-multi", "xtables-nft-multi"} {
		p, _ := exec.LookPath(tool)
		if err := os.Symlink(p, filepath.Join(sbin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command(wrapper, "--install").CombinedOutput(); err != nil {
		t.Fatalf("iptables-wrapper --install: %v: %s", err, out)
	}
	checkLinks(t, sbin, "iptables-wrapper")
	return sbin
}

// checkLinks: each of the six iptables commands in sbin is a link to target.
func checkLinks(t *testing.T, sbin, target string) {
	t.Helper()
	for _, c := range iptablesCommands {
		if got, err := os.Readlink(filepath.Join(sbin, c)); err != nil || got != target {
			t.Errorf("%s -> %q (%v), want -> %s", c, got, err, target)
		}
	}
}
