package cluster

// The single-node cluster's container images, built here (no registry is
// reachable) and kept as archives `ctr -n k8s.io images import` takes.
//
// The scratch images (pause, coredns, kpc-tools) are static Go binaries
// written straight into a docker-archive by writeDockerArchive: no buildah,
// and the same inputs give the same bytes. kube-proxy and kpipe need a Debian
// root filesystem and apt: buildah builds them (chroot isolation: crun
// refuses this host's hybrid cgroups) on two local bases, a debootstrapped
// localhost/debian:bookworm and localhost/golang:1.26 (that base plus the
// host's Go), themselves kept as archives and loaded back into buildah's
// storage only when an image built on them must be rebuilt.
//
// Cache layout: o.Cache/NAME-KEY.tar, KEY hashing everything the image is
// made of (sources, binaries, Dockerfiles, bases), so a changed input makes a
// new archive and an unchanged one is never rebuilt. One caller builds at a
// time (o.Cache/.lock); the others wait and find the archives. Archives of
// older keys stay until removed by hand (another work tree may still use
// them), as do the images buildah's storage keeps.

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// Image is an image built here, as an archive `ctr -n k8s.io images import` takes.
type Image struct {
	Ref     string // e.g. "localhost/pause:3.10"
	Archive string // path of a docker-archive tar whose image name is Ref
}

// ImageOptions says where the sources, the cache and upstream kube-proxy are.
type ImageOptions struct {
	Root      string // the kpipe repository root (testbed.RepoRoot())
	Cache     string // where archives are kept between runs, e.g. ~/.cache/kpipe-e2e/images
	KubeProxy string // path of the kube-proxy v1.34.4 binary already built
	Logf      func(string, ...any)
}

// Images are every image the single-node cluster runs.
type Images struct {
	Pause, CoreDNS, KubeProxy, Kpipe, Tools Image
}

// All lists the images, to import them all.
func (im Images) All() []Image {
	return []Image{im.Pause, im.CoreDNS, im.KubeProxy, im.Kpipe, im.Tools}
}

// Names and tags of the images. kubeadm with imageRepository "localhost"
// names CoreDNS localhost/coredns:v1.12.1 (only registry.k8s.io gets the
// extra /coredns path: kubeadm's images.GetDNSImage) and kube-proxy
// localhost/kube-proxy:v1.34.4. The pause tag is the cluster's choice:
// kubeadm v1.34's PauseVersion is 3.10.1, and kubeadm only warns when
// containerd's sandbox_image differs.
const (
	PauseRef     = "localhost/pause:3.10"
	CoreDNSRef   = "localhost/coredns:v1.12.1"
	KubeProxyRef = "localhost/kube-proxy:v1.34.4"
	kpipeRepo    = "localhost/kpipe"
	toolsRepo    = "localhost/kpc-tools"

	debianRef    = "localhost/debian:bookworm"
	golangRef    = "localhost/golang:1.26"
	debianSuite  = "bookworm" // the host's release: kube-proxy links its glibc
	debianMirror = "http://deb.debian.org/debian"
)

// ToolPrograms are the kpc-tools image's programs, each /NAME for the
// package directory .../NAME under the repository root. A directory that is
// not in this tree is left out (e2e/cluster/images/probe comes from another
// branch).
var ToolPrograms = []string{"e2e/echoserver", "e2e/cluster/images/probe"}

// BuildImages returns every image, building only those whose inputs changed since the cache was filled.
func BuildImages(ctx context.Context, o ImageOptions) (Images, error) {
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	if o.Root == "" || o.Cache == "" || o.KubeProxy == "" {
		return Images{}, errors.New("build images: Root, Cache and KubeProxy must be set")
	}
	if err := os.MkdirAll(o.Cache, 0o755); err != nil {
		return Images{}, fmt.Errorf("create image cache: %w", err)
	}
	unlock, err := lockDir(o.Cache)
	if err != nil {
		return Images{}, err
	}
	defer unlock()

	start := time.Now()
	b := &builder{o: o, ctx: ctx}
	var im Images
	steps := []struct {
		img   *Image
		build func() (Image, error)
	}{
		{&im.Pause, b.pause},
		{&im.CoreDNS, b.coreDNS},
		{&im.Tools, b.tools},
		{&im.KubeProxy, b.kubeProxy},
		{&im.Kpipe, b.kpipe},
	}
	for _, s := range steps {
		if err := ctx.Err(); err != nil {
			return im, err
		}
		if *s.img, err = s.build(); err != nil {
			return im, err
		}
	}
	o.Logf("images ready in %v (%d built)", time.Since(start).Round(time.Millisecond), b.built)
	return im, nil
}

// lockDir takes dir/.lock, released by the returned function.
func lockDir(dir string) (func(), error) {
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open image cache lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("take image cache lock: %w", err)
	}
	return func() { f.Close() }, nil
}

type builder struct {
	o     ImageOptions
	ctx   context.Context
	built int
	goVer string
}

// cached returns the archive NAME-KEY.tar, calling build(tmp) to write it
// when the cache has none. The image's Ref is read from the archive.
func (b *builder) cached(name, key string, build func(archive string) error) (Image, error) {
	final := filepath.Join(b.o.Cache, name+"-"+key+".tar")
	if !fileExists(final) {
		if err := b.ctx.Err(); err != nil {
			return Image{}, err
		}
		start := time.Now()
		b.o.Logf("building image %s (key %s)", name, key)
		tmp := final + ".tmp"
		_ = os.Remove(tmp)
		if err := build(tmp); err != nil {
			_ = os.Remove(tmp)
			return Image{}, fmt.Errorf("build image %s: %w", name, err)
		}
		if err := os.Rename(tmp, final); err != nil {
			return Image{}, fmt.Errorf("keep image %s: %w", name, err)
		}
		b.built++
		b.o.Logf("built image %s in %v", name, time.Since(start).Round(time.Millisecond))
	}
	ref, err := archiveRef(final)
	if err != nil {
		return Image{}, err
	}
	return Image{Ref: ref, Archive: final}, nil
}

// --- scratch images: static Go binaries in one layer ---

// goProgram is a static Go binary put at /Name in a scratch image.
type goProgram struct {
	Name      string
	Module    string // the module's directory
	OwnModule bool   // outside go.work (GOWORK=off)
	Pkg       string // what to build, relative to Module or an import path
	Xattrs    map[string]string
}

var staticEnv = []string{"CGO_ENABLED=0"}

// netBindServiceCap is security.capability granting CAP_NET_BIND_SERVICE
// (bit 10) permitted and effective: upstream's image does
// `setcap cap_net_bind_service=+ep /coredns` so that CoreDNS, running as
// nonroot, binds port 53. vfs_cap_data revision 2, little endian.
var netBindServiceCap = string([]byte{
	0x01, 0x00, 0x00, 0x02, // VFS_CAP_REVISION_2 | VFS_CAP_FLAGS_EFFECTIVE
	0x00, 0x04, 0x00, 0x00, 0, 0, 0, 0, // permitted, inheritable (caps 0-31)
	0, 0, 0, 0, 0, 0, 0, 0, // caps 32-63
})

func (b *builder) pause() (Image, error) {
	return b.scratch("pause", PauseRef, imageConfig{
		User:       "65535:65535",
		Entrypoint: []string{"/pause"},
	}, []goProgram{{Name: "pause", Module: b.o.Root, Pkg: "./e2e/cluster/images/pause"}}, nil)
}

// coreDNS is upstream's image: /coredns with cap_net_bind_service, run as
// distroless's nonroot, with the CA bundle beside it.
func (b *builder) coreDNS() (Image, error) {
	var extra []layerFile
	if fileExists(hostCABundle) {
		extra = append(extra, layerFile{Name: strings.TrimPrefix(hostCABundle, "/"), Source: hostCABundle, Mode: 0o644})
	}
	return b.scratch("coredns", CoreDNSRef, imageConfig{
		User:         "65532:65532",
		Entrypoint:   []string{"/coredns"},
		Env:          []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SSL_CERT_FILE=" + hostCABundle},
		WorkingDir:   "/",
		ExposedPorts: map[string]struct{}{"53/tcp": {}, "53/udp": {}},
	}, []goProgram{{
		Name: "coredns", Module: filepath.Join(b.o.Root, "e2e", "cluster", "coredns"), OwnModule: true,
		Pkg: "github.com/coredns/coredns", Xattrs: map[string]string{"security.capability": netBindServiceCap},
	}}, extra)
}

// tools is kpc-tools, tagged with its key: the echoserver and probe pods'
// programs.
func (b *builder) tools() (Image, error) {
	var progs []goProgram
	for _, dir := range ToolPrograms {
		if _, err := os.Stat(filepath.Join(b.o.Root, dir)); errors.Is(err, fs.ErrNotExist) {
			b.o.Logf("kpc-tools: no %s in this tree, left out", dir)
			continue
		}
		progs = append(progs, goProgram{Name: path.Base(dir), Module: b.o.Root, Pkg: "./" + dir})
	}
	return b.scratch("kpc-tools", "", imageConfig{Env: []string{"PATH=/"}}, progs, nil)
}

// scratch builds a FROM-scratch image of progs and extra; an empty ref is
// toolsRepo tagged with the key.
func (b *builder) scratch(name, ref string, cfg imageConfig, progs []goProgram, extra []layerFile) (Image, error) {
	k := newKey("scratch/1", name, ref)
	cfgJSON, _ := json.Marshal(cfg)
	k.add(string(cfgJSON))
	for _, p := range progs {
		src, err := b.goSourceKey(p)
		if err != nil {
			return Image{}, err
		}
		k.add(p.Name, src, fmt.Sprint(p.Xattrs))
	}
	for _, f := range extra {
		if err := k.addFile(f.Source); err != nil {
			return Image{}, err
		}
		k.add(f.Name)
	}
	key := k.sum()
	if ref == "" {
		ref = toolsRepo + ":" + key
	}
	return b.cached(name, key, func(archive string) error {
		dir, err := os.MkdirTemp(b.o.Cache, name+".bin-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		files := append([]layerFile(nil), extra...)
		for _, p := range progs {
			out := filepath.Join(dir, p.Name)
			if err := testbed.GoBuild(p.Module, p.OwnModule, staticEnv, out, p.Pkg); err != nil {
				return err
			}
			files = append(files, layerFile{Name: p.Name, Source: out, Mode: 0o755, Xattrs: p.Xattrs})
		}
		return writeDockerArchive(archive, ref, cfg, files)
	})
}

// goVersion is `go env GOVERSION`, part of every Go program's key.
func (b *builder) goVersion() (string, error) {
	if b.goVer == "" {
		out, err := testbed.GoCmd(b.o.Root, false, nil, "env", "GOVERSION").Output()
		if err != nil {
			return "", fmt.Errorf("go env GOVERSION: %w", err)
		}
		b.goVer = strings.TrimSpace(string(out))
	}
	return b.goVer, nil
}

// goListTemplate prints a package, the module version it comes from and,
// for its files, where they are: a versioned module's are immutable, a local
// one's (the main module, a directory replace) are hashed.
const goListTemplate = `{{.ImportPath}}	{{if .Standard}}std{{else}}{{with .Module}}{{.Path}}@{{.Version}}{{with .Replace}}=>{{.Path}}@{{.Version}}{{end}}{{end}}{{end}}	{{.Dir}}	{{join .GoFiles " "}} {{join .EmbedFiles " "}} {{join .SFiles " "}}`

// goSourceKey hashes what `go build` of p reads: the Go version, the module's
// go.mod and every non-standard package it depends on (its module version,
// or the content of its files when local). Cheaper than building to hash
// the binary, and as exact.
func (b *builder) goSourceKey(p goProgram) (string, error) {
	ver, err := b.goVersion()
	if err != nil {
		return "", err
	}
	cmd := testbed.GoCmd(p.Module, p.OwnModule, staticEnv, "list", "-deps", "-f", goListTemplate, p.Pkg)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go list -deps %s: %w: %s", p.Pkg, err, strings.TrimSpace(stderr.String()))
	}
	k := newKey(ver, strings.Join(staticEnv, " "))
	if err := k.addFile(filepath.Join(p.Module, "go.mod")); err != nil {
		return "", err
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Split(sc.Text(), "\t")
		if len(f) != 4 {
			return "", fmt.Errorf("go list -deps %s: unexpected line %q", p.Pkg, sc.Text())
		}
		k.add(f[0], f[1])
		if f[1] == "std" || !strings.HasSuffix(f[1], "@") {
			continue
		}
		for _, name := range strings.Fields(f[3]) {
			if err := k.addFile(filepath.Join(f[2], name)); err != nil {
				return "", err
			}
		}
	}
	return k.sum(), nil
}

// imageConfig is the "config" of an image's configuration (the parts used).
type imageConfig struct {
	User         string              `json:",omitempty"`
	ExposedPorts map[string]struct{} `json:",omitempty"`
	Env          []string            `json:",omitempty"`
	Entrypoint   []string            `json:",omitempty"`
	WorkingDir   string              `json:",omitempty"`
}

// layerFile is a file of a scratch image's one layer.
type layerFile struct {
	Name   string // path in the image, without the leading /
	Source string // host file
	Mode   int64
	Xattrs map[string]string
}

// epoch is every scratch image's creation time and its files' mtime, so
// that the same inputs give the same archive.
var epoch = time.Unix(0, 0).UTC()

// writeDockerArchive writes a one-layer image named ref as a docker-archive
// (manifest.json, the config, LAYER/layer.tar), which `ctr images import`
// and `buildah pull docker-archive:` take.
func writeDockerArchive(archive, ref string, cfg imageConfig, files []layerFile) error {
	layer, diffID, err := layerTar(files)
	if err != nil {
		return err
	}
	config, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"created":      epoch,
		"config":       cfg,
		"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + diffID}},
		"history":      []map[string]any{{"created": epoch, "created_by": "kpipe e2e/cluster images.go"}},
	})
	if err != nil {
		return err
	}
	configSum := sha256.Sum256(config)
	configName := hex.EncodeToString(configSum[:]) + ".json"
	layerName := diffID + "/layer.tar"
	manifest, err := json.Marshal([]map[string]any{{"Config": configName, "RepoTags": []string{ref}, "Layers": []string{layerName}}})
	if err != nil {
		return err
	}

	f, err := os.Create(archive)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	entries := []struct {
		name string
		data []byte
	}{{layerName, layer}, {configName, config}, {"manifest.json", manifest}}
	for _, e := range entries {
		hdr := &tar.Header{Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: epoch, Typeflag: tar.TypeReg}
		if err := tw.WriteHeader(hdr); err != nil {
			f.Close()
			return err
		}
		if _, err := tw.Write(e.data); err != nil {
			f.Close()
			return err
		}
	}
	if err := tw.Close(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// layerTar is the layer holding files (and their parent directories), and
// its sha256 (the diff ID).
func layerTar(files []layerFile) ([]byte, string, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	sort.Slice(files, func(i, j int) bool { return files[i].Name < files[j].Name })
	for _, f := range files {
		for d := path.Dir(f.Name); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var dirNames []string
	for d := range dirs {
		dirNames = append(dirNames, d)
	}
	sort.Strings(dirNames)
	for _, d := range dirNames {
		if err := tw.WriteHeader(&tar.Header{Name: d + "/", Mode: 0o755, ModTime: epoch, Typeflag: tar.TypeDir, Format: tar.FormatPAX}); err != nil {
			return nil, "", err
		}
	}
	for _, f := range files {
		data, err := os.ReadFile(f.Source)
		if err != nil {
			return nil, "", err
		}
		hdr := &tar.Header{Name: f.Name, Mode: f.Mode, Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
		if len(f.Xattrs) > 0 {
			hdr.PAXRecords = map[string]string{}
			for k, v := range f.Xattrs {
				hdr.PAXRecords["SCHILY.xattr."+k] = v
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, "", err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, "", err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, "", err
	}
	sum := sha256.Sum256(buf.Bytes())
	return buf.Bytes(), hex.EncodeToString(sum[:]), nil
}

// archiveRef is the name of the (first) image in a docker-archive.
func archiveRef(archive string) (string, error) {
	f, err := os.Open(archive)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return "", fmt.Errorf("%s: no manifest.json", archive)
		}
		if err != nil {
			return "", fmt.Errorf("read %s: %w", archive, err)
		}
		if path.Clean(hdr.Name) != "manifest.json" {
			continue
		}
		var m []struct{ RepoTags []string }
		if err := json.NewDecoder(tr).Decode(&m); err != nil {
			return "", fmt.Errorf("%s: manifest.json: %w", archive, err)
		}
		if len(m) == 0 || len(m[0].RepoTags) == 0 {
			return "", fmt.Errorf("%s: manifest.json names no image", archive)
		}
		return m[0].RepoTags[0], nil
	}
}

// --- buildah images: Debian bases, kube-proxy, kpipe ---

// buildah runs buildah and returns its trimmed stdout.
func buildah(args ...string) (string, error) {
	out, err := testbed.Run(append([]string{"buildah"}, args...)...)
	return strings.TrimSpace(out), err
}

// buildahBuildArgs are common to every `buildah build`: no registry to pull
// from, the host's network for apt and the Go module proxy, and chroot
// isolation (crun refuses this host's hybrid cgroups).
var buildahBuildArgs = []string{"build", "--isolation", "chroot", "--network", "host", "--pull=never", "--layers"}

// debian is localhost/debian:bookworm: `debootstrap --variant=minbase`,
// committed with buildah.
func (b *builder) debian() (Image, error) {
	return b.cached("debian", newKey("debian/1", debianRef, debianSuite, debianMirror, "minbase").sum(), func(archive string) error {
		rootfs, err := os.MkdirTemp(b.o.Cache, "debian.rootfs-")
		if err != nil {
			return err
		}
		defer removeRootfs(rootfs)
		if _, err := testbed.Run("debootstrap", "--variant=minbase", debianSuite, rootfs, debianMirror); err != nil {
			return err
		}
		// Package lists and .debs are the build's leftovers, not the image's.
		for _, glob := range []string{"var/lib/apt/lists/*", "var/cache/apt/archives/*.deb"} {
			matches, _ := filepath.Glob(filepath.Join(rootfs, glob))
			for _, m := range matches {
				_ = os.RemoveAll(m)
			}
		}
		return commitTree(debianRef, "scratch", []copyIn{{rootfs, "/"}}, archive,
			"--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "--cmd", "/bin/bash")
	})
}

// hostCABundle is the host's trusted certificates: the golang image's, so
// that the kpipe build's `go mod download` trusts what the host trusts (here
// an egress proxy's own CA: Debian's ca-certificates alone fails with "x509:
// certificate signed by unknown authority"); upstream's golang image has
// ca-certificates for the same reason. CoreDNS's image has it as upstream's.
const hostCABundle = "/etc/ssl/certs/ca-certificates.crt"

// golang is localhost/golang:1.26: the Debian base with the host's Go in
// /usr/local/go and the host's CA bundle (the kpipe image's build stage).
func (b *builder) golang(debian Image) (Image, error) {
	out, err := testbed.GoCmd(b.o.Root, false, nil, "env", "GOROOT").Output()
	if err != nil {
		return Image{}, fmt.Errorf("go env GOROOT: %w", err)
	}
	goroot := strings.TrimSpace(string(out))
	copies := []copyIn{{goroot, "/usr/local/go"}, {hostCABundle, hostCABundle}}
	k := newKey("golang/1", golangRef, filepath.Base(debian.Archive))
	for _, f := range []string{filepath.Join(goroot, "VERSION"), hostCABundle} {
		if err := k.addFile(f); err != nil {
			return Image{}, err
		}
	}
	return b.cached("golang", k.sum(), func(archive string) error {
		if err := loadIntoBuildah(debian); err != nil {
			return err
		}
		return commitTree(golangRef, debianRef, copies, archive,
			"--env", "PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			"--env", "GOPATH=/go", "--env", "GOTOOLCHAIN=local")
	})
}

// copyIn is a host file or directory put into an image.
type copyIn struct{ src, dst string }

// commitTree commits the image ref: from, with each copy's host file or
// directory copied in (cp -a: owners, modes, links, devices), configured
// with configArgs, and pushes it to archive.
func commitTree(ref, from string, copies []copyIn, archive string, configArgs ...string) error {
	c, err := buildah("from", "--pull=never", from)
	if err != nil {
		return err
	}
	committed := false
	defer func() {
		if !committed {
			_, _ = buildah("rm", c)
		}
	}()
	mnt, err := buildah("mount", c)
	if err != nil {
		return err
	}
	cpErr := copyInto(mnt, copies)
	if _, err := buildah("umount", c); err != nil && cpErr == nil {
		cpErr = err
	}
	if cpErr != nil {
		return cpErr
	}
	if _, err := buildah(append(append([]string{"config"}, configArgs...), c)...); err != nil {
		return err
	}
	if _, err := buildah("commit", "--rm", c, ref); err != nil {
		return err
	}
	committed = true
	return pushArchive(ref, archive)
}

func copyInto(mnt string, copies []copyIn) error {
	for _, c := range copies {
		target := filepath.Join(mnt, c.dst)
		st, err := os.Stat(c.src)
		if err != nil {
			return err
		}
		argv := []string{"cp", "-L", "--preserve=mode", c.src, target}
		if st.IsDir() {
			argv = []string{"cp", "-a", c.src + "/.", target + "/"}
		} else {
			target = filepath.Dir(target)
		}
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if _, err := testbed.Run(argv...); err != nil {
			return err
		}
	}
	return nil
}

func pushArchive(ref, archive string) error {
	_, err := buildah("push", ref, "docker-archive:"+archive+":"+ref)
	return err
}

// loadIntoBuildah puts a base image from its archive into buildah's storage
// under its name: whatever that name held before (an older build, another
// tree's) is replaced, so a build starts from exactly the cached base.
// Layers already there are not copied again.
func loadIntoBuildah(img Image) error {
	out, err := buildah("pull", "--quiet", "docker-archive:"+img.Archive)
	if err != nil {
		return err
	}
	lines := strings.Fields(out)
	if len(lines) == 0 {
		return fmt.Errorf("buildah pull %s printed no image ID", img.Archive)
	}
	_, err = buildah("tag", lines[len(lines)-1], img.Ref)
	return err
}

// kubeProxy is upstream kube-proxy (o.KubeProxy) in its image's Debian root
// filesystem (e2e/cluster/images/kube-proxy/Dockerfile).
func (b *builder) kubeProxy() (Image, error) {
	dockerfile := filepath.Join(b.o.Root, "e2e", "cluster", "images", "kube-proxy", "Dockerfile")
	wrapper := filepath.Join(b.o.Root, "deploy", "iptables-wrapper.sh")
	debian, err := b.debian()
	if err != nil {
		return Image{}, err
	}
	k := newKey("kube-proxy/1", KubeProxyRef, filepath.Base(debian.Archive))
	for _, f := range []string{dockerfile, wrapper, b.o.KubeProxy} {
		if err := k.addFile(f); err != nil {
			return Image{}, err
		}
	}
	return b.cached("kube-proxy", k.sum(), func(archive string) error {
		if err := loadIntoBuildah(debian); err != nil {
			return err
		}
		buildDir, err := os.MkdirTemp(b.o.Cache, "kube-proxy.context-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(buildDir)
		for name, src := range map[string]string{"kube-proxy": b.o.KubeProxy, "iptables-wrapper.sh": wrapper} {
			if _, err := testbed.Run("cp", src, filepath.Join(buildDir, name)); err != nil {
				return err
			}
		}
		args := append(append([]string(nil), buildahBuildArgs...), "--build-arg", "BASE="+debianRef, "-f", dockerfile, "-t", KubeProxyRef, buildDir)
		if _, err := buildah(args...); err != nil {
			return err
		}
		return pushArchive(KubeProxyRef, archive)
	})
}

// kpipe is the repository's own Dockerfile built on the local bases,
// tagged and stamped with git's description of the tree as `go tool task
// image` does. Its key is the content of every file the build context
// holds, so a changed source always makes a new image.
func (b *builder) kpipe() (Image, error) {
	ctxKey, err := buildContextKey(b.o.Root)
	if err != nil {
		return Image{}, err
	}
	debian, err := b.debian()
	if err != nil {
		return Image{}, err
	}
	golang, err := b.golang(debian)
	if err != nil {
		return Image{}, err
	}
	key := newKey("kpipe/1", ctxKey, filepath.Base(debian.Archive), filepath.Base(golang.Archive)).sum()
	return b.cached("kpipe", key, func(archive string) error {
		stamp := gitStamp(b.o.Root)
		ref := kpipeRepo + ":" + stamp.tag()
		for _, base := range []Image{debian, golang} {
			if err := loadIntoBuildah(base); err != nil {
				return err
			}
		}
		args := append(append([]string(nil), buildahBuildArgs...),
			"--build-arg", "BASE="+debianRef, "--build-arg", "GO_IMAGE="+golangRef,
			"--build-arg", "VERSION="+stamp.version, "--build-arg", "GIT_COMMIT="+stamp.commit,
			"--build-arg", "GIT_TREE_STATE="+stamp.treeState, "--build-arg", "BUILD_DATE="+time.Now().UTC().Format(time.RFC3339),
			"-f", filepath.Join(b.o.Root, "Dockerfile"), "-t", ref, b.o.Root)
		if _, err := buildah(args...); err != nil {
			return err
		}
		return pushArchive(ref, archive)
	})
}

// buildStamp is what Taskfile.yml's VERSION, GIT_COMMIT and GIT_TREE_STATE
// compute.
type buildStamp struct{ version, commit, treeState string }

func gitStamp(root string) buildStamp {
	git := func(args ...string) (string, error) {
		out, err := testbed.Run(append([]string{"git", "-C", root}, args...)...)
		return strings.TrimSpace(out), err
	}
	s := buildStamp{version: "v0.0.0-dev", commit: "unknown", treeState: "unknown"}
	if v, err := git("describe", "--tags", "--always", "--dirty"); err == nil && v != "" {
		s.version = v
	}
	if c, err := git("rev-parse", "HEAD"); err == nil {
		s.commit = c
	}
	if st, err := git("status", "--porcelain"); err == nil {
		s.treeState = "clean"
		if st != "" {
			s.treeState = "dirty"
		}
	}
	return s
}

var notInTag = regexp.MustCompile(`[^A-Za-z0-9_.-]`)

// tag is the version as an image tag (a tag has at most 128 of [A-Za-z0-9_.-]).
func (s buildStamp) tag() string {
	t := notInTag.ReplaceAllString(s.version, "-")
	if len(t) > 128 {
		t = t[:128]
	}
	return t
}

// buildContextKey hashes the files `buildah build ROOT` sends: what git sees
// (tracked and untracked, less .gitignore'd) less what .dockerignore leaves
// out; by name, mode and content.
func buildContextKey(root string) (string, error) {
	ignore, err := readDockerignore(filepath.Join(root, ".dockerignore"))
	if err != nil {
		return "", err
	}
	out, err := testbed.Run("git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	if err != nil {
		return "", err
	}
	names := strings.Split(strings.TrimRight(out, "\x00"), "\x00")
	sort.Strings(names)
	k := newKey("context/1")
	last := ""
	for _, name := range names {
		if name == "" || name == last || ignore.excludes(name) {
			continue
		}
		last = name
		p := filepath.Join(root, name)
		st, err := os.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted in the work tree: not sent
		}
		if err != nil {
			return "", err
		}
		k.add(name, st.Mode().String())
		switch {
		case st.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return "", err
			}
			k.add(target)
		case st.Mode().IsRegular():
			if err := k.addFile(p); err != nil {
				return "", err
			}
		}
	}
	return k.sum(), nil
}

// dockerignore is a .dockerignore's patterns as regular expressions.
type dockerignore []*regexp.Regexp

// readDockerignore reads the patterns kpipe's .dockerignore uses: *, ?, **
// and a directory excluding all below it. Exceptions (!) are refused rather
// than misread.
func readDockerignore(file string) (dockerignore, error) {
	b, err := os.ReadFile(file)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var d dockerignore
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.HasPrefix(line, "!") {
			return nil, fmt.Errorf("%s: exception %q not supported by the image cache's context hash", file, line)
		}
		d = append(d, regexp.MustCompile("^"+patternRegexp(path.Clean(strings.TrimPrefix(line, "/")))+"(/.*)?$"))
	}
	return d, nil
}

func patternRegexp(p string) string {
	var re strings.Builder
	for i := 0; i < len(p); i++ {
		switch {
		case strings.HasPrefix(p[i:], "**/"):
			re.WriteString("(.*/)?")
			i += 2
		case strings.HasPrefix(p[i:], "**"):
			re.WriteString(".*")
			i++
		case p[i] == '*':
			re.WriteString("[^/]*")
		case p[i] == '?':
			re.WriteString("[^/]")
		default:
			re.WriteString(regexp.QuoteMeta(p[i : i+1]))
		}
	}
	return re.String()
}

func (d dockerignore) excludes(name string) bool {
	for _, re := range d {
		if re.MatchString(name) {
			return true
		}
	}
	return false
}

// removeRootfs removes a debootstrap target, unmounting first what a failed
// debootstrap may have left mounted in it (proc, sys), deepest first.
func removeRootfs(dir string) {
	if mounts, err := os.ReadFile("/proc/self/mounts"); err == nil {
		var under []string
		for _, line := range strings.Split(string(mounts), "\n") {
			if f := strings.Fields(line); len(f) > 1 && strings.HasPrefix(f[1], dir+"/") {
				under = append(under, f[1])
			}
		}
		sort.Sort(sort.Reverse(sort.StringSlice(under)))
		for _, m := range under {
			_ = syscall.Unmount(m, syscall.MNT_DETACH)
		}
	}
	_ = os.RemoveAll(dir)
}

// --- keys ---

// key hashes an image's inputs.
type key struct{ h []byte }

func newKey(parts ...string) *key {
	k := &key{}
	k.add(parts...)
	return k
}

// add hashes each part with its length, so that parts never run together.
func (k *key) add(parts ...string) {
	for _, p := range parts {
		k.h = append(k.h, fmt.Sprintf("%d:%s;", len(p), p)...)
	}
}

func (k *key) addFile(name string) error {
	f, err := os.Open(name)
	if err != nil {
		return fmt.Errorf("image input: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return fmt.Errorf("image input: %w", err)
	}
	k.add(hex.EncodeToString(h.Sum(nil)))
	return nil
}

func (k *key) sum() string {
	s := sha256.Sum256(k.h)
	return hex.EncodeToString(s[:])[:16]
}

func fileExists(name string) bool {
	st, err := os.Stat(name)
	return err == nil && st.Mode().IsRegular()
}
