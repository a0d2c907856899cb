package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/conntrack"
	"github.com/kpipe/kpipe/stages/events"
	"github.com/kpipe/kpipe/stages/health"
)

// configMapDir lays out dir as the kubelet mounts a ConfigMap: name is a
// symlink to ..data/name, ..data a symlink to a timestamped directory holding
// the file. update swaps in a new timestamped directory as the kubelet does
// (a new ..data symlink renamed over the old one).
type configMapDir struct {
	t     *testing.T
	dir   string
	name  string
	count int
}

func newConfigMapDir(t *testing.T, name, content string) *configMapDir {
	c := &configMapDir{t: t, dir: t.TempDir(), name: name}
	c.update(content)
	if err := os.Symlink(filepath.Join("..data", name), filepath.Join(c.dir, name)); err != nil {
		t.Fatal(err)
	}
	return c
}

func (c *configMapDir) path() string { return filepath.Join(c.dir, c.name) }

func (c *configMapDir) update(content string) {
	c.t.Helper()
	c.count++
	ts := filepath.Join(c.dir, "..2026_11_23_"+strings.Repeat("0", c.count))
	if err := os.Mkdir(ts, 0o755); err != nil {
		c.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ts, c.name), []byte(content), 0o644); err != nil {
		c.t.Fatal(err)
	}
	tmp := filepath.Join(c.dir, "..data_tmp")
	if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
		c.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(c.dir, "..data")); err != nil {
		c.t.Fatal(err)
	}
}

// TestWatchConfigFile: a ConfigMap update (the ..data symlink swapped) and an
// in-place write are each seen within a second, long before the fallback poll;
// an update that leaves the content as it was is not.
func TestWatchConfigFile(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cm := newConfigMapDir(t, "config.conf", "a: 1\n")
	changed := watchConfigFile(ctx, cm.path(), slog.New(slog.DiscardHandler))
	seen := func(what string, want bool) {
		t.Helper()
		select {
		case <-changed:
			if !want {
				t.Errorf("%s: a change was signalled", what)
			}
		case <-time.After(time.Second):
			if want {
				t.Errorf("%s: no change signalled within 1s", what)
			}
		}
	}
	cm.update("a: 2\n")
	seen("ConfigMap update", true)
	cm.update("a: 2\n")
	seen("ConfigMap update with the same content", false)

	plain := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(plain, []byte("a: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	changed = watchConfigFile(ctx, plain, slog.New(slog.DiscardHandler))
	if err := os.WriteFile(plain, []byte("a: 3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	seen("write in place", true)
}

const reloadConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
hostnameOverride: node-1
healthzBindAddress: 127.0.0.1:0
metricsBindAddress: 127.0.0.1:0
iptables:
  minSyncPeriod: 0s
`

// reloadBed is kpipe on a fake apiserver and kernel, run from reloadConfig in
// a ConfigMap volume.
type reloadBed struct {
	client   *fake.Clientset
	watching <-chan string
	kernel   *fakekernel.Kernel
	logs     syncBuffer
	d        deps
	cm       *configMapDir
}

func newReloadBed(t *testing.T) *reloadBed {
	b := &reloadBed{kernel: fakekernel.New(), cm: newConfigMapDir(t, "config.conf", reloadConfig)}
	b.client, b.watching = watchedClient()
	b.d = fakeDeps(b.client, b.kernel, slog.New(slog.NewTextHandler(&b.logs, nil)))
	return b
}

// run runs kpipe on b.d until the test ends (see runInBackground) and waits for
// its watches. Each accepted change of the file runs a tree on next(d) (nil:
// d), d connected to the fake apiserver anew.
func (b *reloadBed) run(t *testing.T, next func(deps) deps) context.Context {
	ctx := runInBackground(t, &b.logs, func(ctx context.Context) error {
		code := runWith([]string{"--config=" + b.cm.path()}, func(_ context.Context, o *Options) error {
			return runReloading(ctx, o, b.d, watchConfigFile(ctx, o.ConfigFile, b.d.log), func(_ *Options, d deps) (deps, error) {
				d.connect(b.client)
				if next != nil {
					d = next(d)
				}
				return d, nil
			})
		})
		if code != 0 {
			return fmt.Errorf("kpipe exited %d", code)
		}
		return nil
	})
	waitWatches(t, b.watching, "services", "endpointslices")
	return ctx
}

// TestReloadRebuildsTheTree: kpipe, run from a config file in a ConfigMap
// volume on a fake apiserver and kernel, takes masqueradeAll: true from an
// update of the file without exiting; an update with a field of the wrong type
// is rejected (counted, a Warning event on the Node naming it) and the rules
// stay as they were; an update with an unknown field applies the rest of the
// file, as kube-proxy restarted on it would (lenient decoding).
func TestReloadRebuildsTheTree(t *testing.T) {
	b := newReloadBed(t)
	client, kernel, d, cm := b.client, b.kernel, &b.d, b.cm
	var afterSyncs atomic.Int32
	d.afterSync = func(context.Context, *slog.Logger) { afterSyncs.Add(1) }
	d.reloads = &health.Reloads{} // what /status tells of the last reload

	ctx := b.run(t, nil)
	createWebService(ctx, t, client)

	// masqueradeAll: every packet to the ClusterIP is marked for SNAT in its
	// service chain (without it and without a cluster CIDR, none is).
	masqueraded := func(nat []string) bool { return hasRule(nat, "-A KUBE-SVC-", "-d 10.96.0.10/32", "-j KUBE-MARK-MASQ") }
	waitNAT(t, kernel, "ns/web's rules", func(nat []string) bool {
		return hasRule(nat, "-j DNAT --to-destination 10.244.1.5:8080") && !masqueraded(nat)
	})

	cm.update(reloadConfig + "  masqueradeAll: true\n")
	waitNAT(t, kernel, "ns/web masqueraded after masqueradeAll: true", masqueraded)
	if n := testutil.ToFloat64(d.metrics.ConfigReloads.WithLabelValues(metrics.ReloadSuccess)); n != 1 {
		t.Errorf("%v successful reloads counted, want 1", n)
	}

	cm.update(reloadConfig + "  masqueradeAll: false\n  masqueradeBit: fourteen\n")
	if e := waitNodeEvent(ctx, t, client, events.ReasonReloadFailed); e.Type != "Warning" || !strings.Contains(e.Note, "masqueradeBit") {
		t.Errorf("%s event: type %q, note %q; want a Warning naming the field of the wrong type", e.Reason, e.Type, e.Note)
	}
	if n := testutil.ToFloat64(d.metrics.ConfigReloads.WithLabelValues(metrics.ReloadFailure)); n != 1 {
		t.Errorf("%v failed reloads counted, want 1", n)
	}
	if v := testutil.ToFloat64(d.metrics.ConfigReloadSuccessful); v != 0 {
		t.Errorf("kpipe_config_last_reload_successful = %v after a rejected file, want 0", v)
	}
	if last := d.reloads.Last(); last == nil || last.OK || !strings.Contains(last.Error, "masqueradeBit") {
		t.Errorf("last reload for /status = %+v after a rejected file, want failed, naming masqueradeBit", last)
	}
	for range 5 { // the rejected file's masqueradeAll: false is not applied
		if nat := kernel.Rules("nat"); !masqueraded(nat) {
			t.Fatalf("the rejected file was applied: no masquerade rule")
		}
		time.Sleep(100 * time.Millisecond)
	}

	cm.update(reloadConfig + "udpIdleTimeout: 250ms\n")
	waitNAT(t, kernel, "ns/web not masqueraded after masqueradeAll is dropped (with an unknown field)", func(nat []string) bool { return !masqueraded(nat) })
	if v := testutil.ToFloat64(d.metrics.ConfigReloadSuccessful); v != 1 {
		t.Errorf("kpipe_config_last_reload_successful = %v after a file with an unknown field, want 1", v)
	}
	if last := d.reloads.Last(); last == nil || !last.OK || last.Error != "" {
		t.Errorf("last reload for /status = %+v after a file with an unknown field, want OK", last)
	}
	if n := testutil.ToFloat64(d.metrics.ConfigReloads.WithLabelValues(metrics.ReloadSuccess)); n != 2 {
		t.Errorf("%v successful reloads counted, want 2", n)
	}
	if n := afterSyncs.Load(); n != 1 {
		t.Errorf("the after-first-sync step (removal of kube-proxy's nftables tables) ran %d times over three trees, want once", n)
	}
}

// TestReloadKeepsPendingStaleFlows: a UDP Service deleted while the conntrack
// stage cannot connect leaves its flows to clear pending; a config reload
// then must not drop them: the next tree's conntrack stage, which can
// connect, deletes the flows to the deleted ClusterIP. (Its own first commit
// knows nothing of that Service: only what the old tree left pending names it.)
func TestReloadKeepsPendingStaleFlows(t *testing.T) {
	b := newReloadBed(t)
	client, kernel := b.client, b.kernel
	b.d.conntrack = func() (conntrack.Clearer, error) { return nil, errors.New("conntrack down") }
	var ct recordingConntrack
	ctx := b.run(t, func(d deps) deps {
		d.conntrack = ct.dial // the new tree's conntrack stage can connect
		return d
	})
	createWebService(ctx, t, client) // to see the new tree's rules
	createService(ctx, t, client, testService{name: "dns", clusterIP: "10.96.0.53", proto: corev1.ProtocolUDP, port: 53,
		endpoint: "10.244.1.7", targetPort: 53})
	waitNAT(t, kernel, "ns/dns's rules", func(nat []string) bool { return hasRule(nat, "-j DNAT --to-destination 10.244.1.7:53") })
	if err := client.CoreV1().Services("ns").Delete(ctx, "dns", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitNAT(t, kernel, "ns/dns's rules gone", func(nat []string) bool { return !hasRule(nat, "10.96.0.53") })

	b.cm.update(reloadConfig + "  masqueradeAll: true\n")
	waitNAT(t, kernel, "the new tree's rules (ns/web masqueraded)", func(nat []string) bool {
		return hasRule(nat, "-A KUBE-SVC-", "-d 10.96.0.10/32", "-j KUBE-MARK-MASQ")
	})
	dns := netip.MustParseAddrPort("10.96.0.53:53")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		cleared, clears := ct.cleared(dns)
		if cleared {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10s after the reload, the flows to %v (ns/dns, deleted before it) were never cleared (%d clears made)", dns, clears)
		}
	}
}

// waitNodeEvent waits up to 10 s for an event with reason about Node node-1,
// in namespace default, and returns it.
func waitNodeEvent(ctx context.Context, t *testing.T, client kubernetes.Interface, reason string) eventsv1.Event {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		list, err := client.EventsV1().Events("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range list.Items {
			if e.Reason == reason && e.Regarding.Kind == "Node" && e.Regarding.Name == "node-1" {
				return e
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s event about Node node-1 in default; events: %v", reason, list.Items)
		}
	}
}

// A changed config file whose apiserver client cannot be made is rejected
// before any of it is applied: the node's conntrack sysctls and OOM score stay
// as they were (kpipe says it runs on the previous configuration).
func TestRejectedReloadLeavesTheNodeAlone(t *testing.T) {
	o, err := parse(t, "--hostname-override=n", "--kubeconfig="+filepath.Join(t.TempDir(), "missing"), "--conntrack-min=1", "--oom-score-adj=5")
	if err != nil {
		t.Fatal(err)
	}
	h := tempNodeHost(t, 2)
	if _, err := (deps{}).reconfigured(o, h, discard()); err == nil {
		t.Fatal("deps made for a kubeconfig that does not exist")
	}
	checkSysctls(t, sysctlsOf(t, h), map[string]string{})
}

// A change of the config file that only adds or changes fields strict decoding
// fails on leaves the configuration as it was: no new tree for it.
func TestReloadIgnoresFieldsLeftOutByLenientDecoding(t *testing.T) {
	path := writeFile(t, reloadConfig)
	optionsOf := func(content string) *Options {
		t.Helper()
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		o, err := (&Options{args: []string{"--config=" + path}}).reread()
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	clean := optionsOf(reloadConfig)
	unknown := optionsOf(reloadConfig + "udpIdleTimeout: 250ms\n")
	if unknown.lenientDecode == nil {
		t.Fatal("udpIdleTimeout was decoded strictly")
	}
	if !unknown.sameAs(clean) || !clean.sameAs(unknown) {
		t.Error("a file with an unknown field more is not the same configuration")
	}
	if optionsOf(reloadConfig + "  masqueradeAll: true\n").sameAs(clean) {
		t.Error("masqueradeAll: true is the same configuration as without it")
	}
}
