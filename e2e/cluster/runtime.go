package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"time"
)

func containerdSocket() string { return inDir("containerd", "containerd.sock") }

// containerdConfig is Debian's containerd 1.6 with its own root, state,
// socket and runc state (nothing shared with a containerd the host may run),
// the pause image built here as the sandbox image, cgroupfs (no systemd on
// this host), and the CNI reference plugins from Debian's package.
// restrict_oom_score_adj: this VM withholds CAP_SYS_RESOURCE even from root,
// so no process may lower its oom_score_adj below containerd's own (the pod
// sandbox's -998 failed every pod with runc's "failed to update
// /proc/self/oom_score_adj: Permission denied").
func containerdConfig() string {
	return fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %q
`, inDir("containerd", "root"), inDir("containerd", "state"), containerdSocket(), containerdSocket()+".ttrpc",
		PauseRef, inDir("cni", "net.d"), inDir("containerd", "runc"))
}

// cniConfig is the node's pod network: the bridge plugin with ipMasq (its
// own CNI-* chains in nat POSTROUTING) and portmap (CNI-HOSTPORT-*), the two
// reference plugins that write iptables rules beside the service proxy's.
func cniConfig() string {
	return fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "kpc",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %q}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, NodePodCIDR)
}

// kubeletConfig: cgroupfs under its own root on this cgroup v1 host
// (failCgroupV1 false: v1.34 still runs on v1, in maintenance), swap allowed,
// x509 client certificates from the cluster CA (the apiserver's logs and
// exec), and image garbage collection off (images here cannot be pulled
// again).
func kubeletConfig() string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupRoot: /%s
failCgroupV1: false
failSwapOn: false
address: %s
healthzBindAddress: 127.0.0.1
clusterDNS: [%s]
clusterDomain: cluster.local
resolvConf: %s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %s}
authorization: {mode: AlwaysAllow}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%%"
  imagefs.available: "1%%"
  nodefs.inodesFree: "1%%"
rotateCertificates: false
serverTLSBootstrap: false
`, containerdSocket(), cgroupRoot, NodeIP, DNSIP, inDir("resolv.conf"), inDir("pki", "ca.crt"))
}

func (c *Cluster) startNode(ctx context.Context, logf func(string, ...any)) error {
	for _, d := range []string{inDir("containerd"), inDir("cni", "net.d"), inDir("kubelet")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	files := map[string]string{
		inDir("containerd", "config.toml"):       containerdConfig(),
		inDir("cni", "net.d", "10-kpc.conflist"): cniConfig(),
		inDir("kubelet-config.yaml"):             kubeletConfig(),
		// CoreDNS forwards what is not cluster.local to the host's end of the
		// veth, where nothing answers: no query leaves the machine.
		inDir("resolv.conf"): "nameserver " + HostIP + "\n",
	}
	for f, body := range files {
		if err := os.WriteFile(f, []byte(body), 0o644); err != nil {
			return err
		}
	}
	if _, err := startDaemon("containerd", nil, "containerd", "--config", inDir("containerd", "config.toml")); err != nil {
		return err
	}
	if err := WaitFor(ctx, 30*time.Second, "containerd's socket", func() error {
		conn, err := net.Dial("unix", containerdSocket())
		if err == nil {
			conn.Close()
		}
		return err
	}); err != nil {
		return err
	}
	if err := c.importImages(ctx); err != nil {
		return err
	}
	logf("containerd up, images imported")
	if err := c.startKubelet(ctx); err != nil {
		return err
	}
	logf("node %s Ready", NodeName)
	return nil
}

func (c *Cluster) startKubelet(ctx context.Context) error {
	if _, err := startDaemon("kubelet", nil, c.Bins.Kubelet,
		"--config", inDir("kubelet-config.yaml"), "--kubeconfig", inDir("kubelet.conf"),
		"--root-dir", inDir("kubelet"), "--cert-dir", inDir("kubelet", "pki"),
		"--hostname-override", NodeName, "--node-ip", NodeIP, "--v=1"); err != nil {
		return err
	}
	return WaitFor(ctx, 2*time.Minute, "node "+NodeName+" Ready", func() error { return c.nodeReady(ctx) })
}

// RestartKubelet stops the kubelet (SIGTERM, as systemd does) and starts it
// again, waiting for the node to be Ready.
func (c *Cluster) RestartKubelet(ctx context.Context) error {
	if err := stopDaemon("kubelet", 10*time.Second); err != nil {
		return err
	}
	return c.startKubelet(ctx)
}

// importImages loads every image built here into containerd's k8s.io
// namespace, where the kubelet looks; an image already there is replaced
// by the same content.
func (c *Cluster) importImages(ctx context.Context) error {
	for _, img := range c.Images.All() {
		if err := c.Ctr(ctx, "images", "import", img.Archive); err != nil {
			return fmt.Errorf("import %s: %w", img.Ref, err)
		}
	}
	return nil
}

// Ctr runs containerd's ctr against the cluster's containerd, k8s.io namespace.
func (c *Cluster) Ctr(ctx context.Context, args ...string) error {
	argv := append([]string{"--address", containerdSocket(), "-n", "k8s.io"}, args...)
	out, err := exec.CommandContext(ctx, "ctr", argv...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// Down removes every process, mount, network namespace, interface and cgroup
// the cluster made, and its directory. It is safe to run on nothing.
func Down() []error {
	var errs []error
	note := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	// The kubelet first, so that it restarts nothing; then the pods'
	// processes (their shims outlive containerd).
	note(stopDaemon("kubelet", 10*time.Second))
	for _, pid := range append(shimPIDs(), cgroupPIDs()...) {
		note(stopPID(pid, 0))
	}
	for i := len(daemons) - 1; i >= 0; i-- {
		if daemons[i] != "kubelet" {
			note(stopDaemon(daemons[i], 10*time.Second))
		}
	}
	pods := podNetns()
	errs = append(errs, unmountUnder(Dir())...)
	errs = append(errs, tearDownNetwork(pods)...)
	errs = append(errs, removeCgroupRoot()...)
	errs = append(errs, removeHostPaths()...)
	if err := os.RemoveAll(Dir()); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errs
}
