package imagefs

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// entry is one member of a test tar: a directory (name ends in /), a file
// (body), a symlink (link), a hard link (hard) or a device (dev).
type entry struct {
	name, body, link, hard string
	mode                   int64
	dev                    bool
}

func tarOf(t *testing.T, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		hdr := &tar.Header{Name: e.name, Mode: e.mode, Typeflag: tar.TypeReg, Size: int64(len(e.body))}
		switch {
		case strings.HasSuffix(e.name, "/"):
			hdr.Typeflag = tar.TypeDir
		case e.link != "":
			hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, e.link
		case e.hard != "":
			hdr.Typeflag, hdr.Linkname = tar.TypeLink, e.hard
		case e.dev:
			hdr.Typeflag, hdr.Devmajor, hdr.Devminor = tar.TypeChar, 1, 3
		}
		if hdr.Mode == 0 {
			hdr.Mode = 0o644
			if hdr.Typeflag == tar.TypeDir {
				hdr.Mode = 0o755 // only root may enter a directory without x
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.body)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gzipped(t *testing.T, b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// archiveOf writes a docker-archive holding layers, bottom first: the first
// under docker's older <id>/layer.tar symlink, the others as plain members.
func archiveOf(t *testing.T, layers ...[]byte) string {
	t.Helper()
	var members []entry
	var names []string
	for i, l := range layers {
		name := "layer" + string(rune('0'+i)) + ".tar"
		members = append(members, entry{name: name, body: string(l)})
		names = append(names, name)
	}
	members = append(members, entry{name: "id0/"}, entry{name: "id0/layer.tar", link: "../" + names[0]})
	names[0] = "id0/layer.tar"
	manifest, err := json.Marshal([]map[string]any{{"Config": "c.json", "Layers": names}})
	if err != nil {
		t.Fatal(err)
	}
	members = append(members, entry{name: "manifest.json", body: string(manifest)})
	file := filepath.Join(t.TempDir(), "image.tar")
	if err := os.WriteFile(file, tarOf(t, members...), 0o644); err != nil {
		t.Fatal(err)
	}
	return file
}

// tree lists dir's paths: "path" for a file (with its contents), "path/" for a
// directory, "path -> target" for a symlink.
func tree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			out = append(out, rel+" -> "+target)
		case d.IsDir():
			out = append(out, rel+"/")
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out = append(out, rel+"="+string(b))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestUnpackAppliesLayersAndWhiteouts(t *testing.T) {
	lower := tarOf(t,
		entry{name: "usr/"}, entry{name: "usr/bin/"},
		entry{name: "usr/bin/tool", body: "v1", mode: 0o4755},
		entry{name: "bin", link: "usr/bin"},
		entry{name: "etc/"}, entry{name: "etc/gone", body: "x"}, entry{name: "etc/kept", body: "k"},
		entry{name: "opaque/"}, entry{name: "opaque/old", body: "o"},
		entry{name: "was-dir/"}, entry{name: "was-dir/f", body: "f"},
		entry{name: "dev/"}, entry{name: "dev/null", dev: true},
	)
	upper := gzipped(t, tarOf(t,
		entry{name: "usr/bin/tool", body: "v2", mode: 0o755},
		entry{name: "usr/bin/same", hard: "usr/bin/tool"},
		entry{name: "etc/.wh.gone"},
		entry{name: "opaque/new", body: "n"}, // before the marker: still this layer's
		entry{name: "opaque/.wh..wh..opq"},
		entry{name: "was-dir", body: "now a file"},
	))
	dir := t.TempDir()
	skipped, err := Unpack(archiveOf(t, lower, upper), dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"bin -> usr/bin", "dev/", "etc/", "etc/kept=k", "opaque/", "opaque/new=n",
		"usr/", "usr/bin/", "usr/bin/same=v2", "usr/bin/tool=v2", "was-dir=now a file",
	}
	if got := tree(t, dir); !slices.Equal(got, want) {
		t.Errorf("unpacked\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if !slices.Equal(skipped, []string{"dev/null"}) {
		t.Errorf("skipped %q, want the device dev/null", skipped)
	}
	fi, err := os.Stat(filepath.Join(dir, "usr/bin/tool"))
	if err != nil || fi.Mode() != 0o755 {
		t.Errorf("usr/bin/tool: mode %v, %v; want the upper layer's -rwxr-xr-x", fi.Mode(), err)
	}
}

func TestUnpackKeepsSetuid(t *testing.T) {
	dir := t.TempDir()
	if _, err := Unpack(archiveOf(t, tarOf(t, entry{name: "su", body: "s", mode: 0o4755})), dir); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(dir, "su"))
	if err != nil || fi.Mode() != fs.ModeSetuid|0o755 {
		t.Errorf("su: mode %v, %v; want setuid -rwxr-xr-x", fi.Mode(), err)
	}
}

func TestUnpackRefusesEscapes(t *testing.T) {
	for name, layer := range map[string][]byte{
		"dot-dot":       tarOf(t, entry{name: "../escaped", body: "x"}),
		"through-links": tarOf(t, entry{name: "up", link: "../.."}, entry{name: "up/escaped", body: "x"}),
	} {
		t.Run(name, func(t *testing.T) {
			parent := t.TempDir()
			dir := filepath.Join(parent, "root")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if _, err := Unpack(archiveOf(t, layer), dir); err == nil {
				t.Error("Unpack wrote an entry outside the root without an error")
			}
			for _, p := range []string{filepath.Join(parent, "escaped"), filepath.Join(filepath.Dir(parent), "escaped")} {
				if _, err := os.Lstat(p); err == nil {
					t.Errorf("%s was written", p)
				}
			}
		})
	}
}

func TestUnpackBadArchive(t *testing.T) {
	file := filepath.Join(t.TempDir(), "x.tar")
	if err := os.WriteFile(file, tarOf(t, entry{name: "other", body: "x"}), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Unpack(file, t.TempDir()); err == nil || !strings.Contains(err.Error(), "no manifest.json") {
		t.Errorf("Unpack of an archive without a manifest: %v, want no manifest.json", err)
	}
}
