// Package imagefs unpacks an image's root filesystem from a docker-archive tar
// (what `buildah push IMAGE docker-archive:FILE` and the cluster's image builds
// write: manifest.json naming the layers, each a tar, in order), so tests can run
// the image's own programs chrooted in it. It imports nothing of kpipe's, so
// netfilter's tests and e2e can both use it.
package imagefs

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
)

// Unpack writes the root filesystem of the first image in archive into dir
// (which must exist), layer over layer, applying each layer's whiteouts. Every
// write goes through an os.Root, so no entry (nor symlink) can reach outside
// dir. Device nodes are not made (os.Root cannot, and no test needs them): they
// are returned, by path, as skipped.
func Unpack(archive, dir string) (skipped []string, err error) {
	f, err := os.Open(archive)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	layers, err := manifestLayers(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", archive, err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	for _, layer := range layers {
		r, err := openMember(f, layer)
		if err != nil {
			return nil, fmt.Errorf("%s: layer %s: %w", archive, layer, err)
		}
		s, err := applyLayer(root, r)
		if err != nil {
			return nil, fmt.Errorf("%s: layer %s: %w", archive, layer, err)
		}
		skipped = append(skipped, s...)
	}
	return skipped, nil
}

// manifestLayers reads manifest.json: the first image's layers, bottom first.
func manifestLayers(f *os.File) ([]string, error) {
	r, err := openMember(f, "manifest.json")
	if err != nil {
		return nil, err
	}
	var manifest []struct{ Layers []string }
	if err := json.NewDecoder(r).Decode(&manifest); err != nil {
		return nil, fmt.Errorf("manifest.json: %w", err)
	}
	if len(manifest) == 0 || len(manifest[0].Layers) == 0 {
		return nil, errors.New("manifest.json names no image with layers")
	}
	return manifest[0].Layers, nil
}

// openMember finds member name in the archive (following a symlink member, as
// docker's older layout links <id>/layer.tar to the layer) and returns its
// contents, gunzipped if it is gzipped. The tar reader skips other members'
// contents by seeking, so a search costs little more than reading the headers.
func openMember(f *os.File, name string) (io.Reader, error) {
	want := path.Clean(name)
	for range 8 { // a bound on symlink hops
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return nil, err
		}
		tr := tar.NewReader(f)
		hdr, err := findMember(tr, want)
		if err != nil {
			return nil, err
		}
		if hdr.Typeflag == tar.TypeSymlink {
			want = path.Join(path.Dir(want), hdr.Linkname)
			continue
		}
		return maybeGunzip(tr)
	}
	return nil, fmt.Errorf("%s: too many symlinks", name)
}

func findMember(tr *tar.Reader, name string) (*tar.Header, error) {
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil, fmt.Errorf("no %s in the archive", name)
		}
		if err != nil {
			return nil, err
		}
		if path.Clean(hdr.Name) == name {
			return hdr, nil
		}
	}
}

func maybeGunzip(r io.Reader) (io.Reader, error) {
	br := bufio.NewReader(r)
	magic, err := br.Peek(2)
	if err == nil && magic[0] == 0x1f && magic[1] == 0x8b {
		return gzip.NewReader(br)
	}
	return br, nil
}

// applyLayer writes one layer's entries over what the layers below it wrote.
func applyLayer(root *os.Root, layer io.Reader) (skipped []string, err error) {
	tr := tar.NewReader(layer)
	written := map[string]bool{} // by this layer, which its opaque whiteouts keep
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return skipped, nil
		}
		if err != nil {
			return skipped, err
		}
		name := path.Clean(strings.TrimPrefix(hdr.Name, "/"))
		if name == "." {
			continue // the root itself
		}
		if name == ".." || strings.HasPrefix(name, "../") {
			return skipped, fmt.Errorf("entry %q is outside the root", hdr.Name)
		}
		made, err := applyEntry(root, name, hdr, tr, written)
		written[name] = true
		if err != nil {
			return skipped, fmt.Errorf("%s: %w", name, err)
		}
		if !made {
			skipped = append(skipped, name)
		}
	}
}

// whiteout marks a deleted path in a layer (.wh.NAME), and opaque a directory
// whose lower layers' contents are all deleted (.wh..wh..opq), as the OCI image
// spec says.
const (
	whiteout = ".wh."
	opaque   = ".wh..wh..opq"
)

// applyEntry applies one entry; made is false for an entry not made (a device).
func applyEntry(root *os.Root, name string, hdr *tar.Header, contents io.Reader, written map[string]bool) (made bool, err error) {
	dir, base := path.Split(name)
	switch {
	case base == opaque:
		return true, emptyDir(root, path.Clean(dir), written)
	case strings.HasPrefix(base, whiteout):
		return true, root.RemoveAll(dir + strings.TrimPrefix(base, whiteout))
	}
	if err := root.MkdirAll(path.Clean(dir), 0o755); err != nil {
		return false, err
	}
	if err := clearFor(root, name, hdr.Typeflag == tar.TypeDir); err != nil {
		return false, err
	}
	mode := hdr.FileInfo().Mode()
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := root.MkdirAll(name, 0o755); err != nil {
			return false, err
		}
	case tar.TypeReg:
		if err := writeFile(root, name, contents); err != nil {
			return false, err
		}
	case tar.TypeSymlink:
		return true, root.Symlink(hdr.Linkname, name)
	case tar.TypeLink:
		return true, root.Link(path.Clean(strings.TrimPrefix(hdr.Linkname, "/")), name)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		return false, nil
	default:
		return false, fmt.Errorf("unsupported tar entry type %q", hdr.Typeflag)
	}
	// Owner before mode: a chown clears the setuid and setgid bits.
	if os.Geteuid() == 0 {
		if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
			return false, err
		}
	}
	return true, root.Chmod(name, mode.Perm()|mode&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky))
}

// clearFor removes what a lower layer left at name, unless both are directories
// (a directory entry over a directory keeps its contents).
func clearFor(root *os.Root, name string, isDir bool) error {
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if isDir && fi.IsDir() {
		return nil
	}
	return root.RemoveAll(name)
}

func writeFile(root *os.Root, name string, contents io.Reader) error {
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, contents); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// emptyDir removes what lower layers left in dir (an opaque whiteout), keeping
// dir and what this layer has written into it already.
func emptyDir(root *os.Root, dir string, written map[string]bool) error {
	d, err := root.Open(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return err
	}
	for _, n := range names {
		if written[path.Join(dir, n)] {
			continue
		}
		if err := root.RemoveAll(path.Join(dir, n)); err != nil {
			return err
		}
	}
	return nil
}
