package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kpipe/kpipe/e2e/testbed"
)

// Cluster is a running cluster: how to reach it, and what it was built from.
type Cluster struct {
	Kubeconfig string // admin credentials, for kubectl and client-go on the host
	Client     kubernetes.Interface
	Bins       testbed.ControlPlaneBinaries
	Images     Images
}

// Up brings the cluster up with kubeadm's kube-proxy serving, or returns the
// one already running (every daemon alive, the node Ready). Anything less
// is taken down and made again. logf reports progress.
func Up(ctx context.Context, logf func(string, ...any)) (*Cluster, error) {
	start := time.Now()
	root, err := testbed.RepoRoot()
	if err != nil {
		return nil, err
	}
	bins, err := testbed.EnsureControlPlane(root, logf)
	if err != nil {
		return nil, err
	}
	images, err := BuildImages(ctx, ImageOptions{Root: root, Cache: imageCache(), KubeProxy: bins.KubeProxy, Logf: logf})
	if err != nil {
		return nil, err
	}
	c := &Cluster{Kubeconfig: Kubeconfig(), Bins: bins, Images: images}
	if Running() {
		if err := c.connect(); err == nil && c.nodeReady(ctx) == nil {
			logf("cluster already running (%s)", Dir())
			return c, c.importImages(ctx)
		}
	}
	if errs := Down(); len(errs) > 0 {
		return nil, fmt.Errorf("clear the previous cluster: %v", errors.Join(errs...))
	}
	if err := c.create(ctx, logf); err != nil {
		return nil, fmt.Errorf("%w\n(logs in %s)", err, inDir("logs"))
	}
	logf("cluster up in %v; kubeconfig %s", time.Since(start).Round(time.Second), c.Kubeconfig)
	return c, nil
}

// daemons in the order they start; Down stops them in reverse.
var daemons = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "containerd", "kubelet"}

// Running says whether every daemon of a cluster is alive.
func Running() bool {
	for _, d := range daemons {
		if _, ok := daemonPID(d); !ok {
			return false
		}
	}
	return true
}

func (c *Cluster) create(ctx context.Context, logf func(string, ...any)) error {
	for _, d := range []string{inDir("pki"), inDir("run"), inDir("logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := setUpNetwork(); err != nil {
		return err
	}
	if err := makeCgroupRoot(); err != nil {
		return err
	}
	if err := makeHostPaths(); err != nil {
		return err
	}
	if err := writePKI(); err != nil {
		return fmt.Errorf("certificates: %w", err)
	}
	if err := c.startControlPlane(ctx, logf); err != nil {
		return err
	}
	if err := c.startNode(ctx, logf); err != nil {
		return err
	}
	return c.addons(ctx, logf)
}

func writePKI() error {
	dir := inDir("pki")
	authority, err := newCA()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), authority.pem, 0o644); err != nil {
		return err
	}
	if err := writeServiceAccountKeys(dir); err != nil {
		return err
	}
	serving, err := authority.sign("kube-apiserver", nil, NodeIP, APIServerIP, "127.0.0.1", NodeName,
		"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")
	if err != nil {
		return err
	}
	if err := serving.write(dir, "apiserver"); err != nil {
		return err
	}
	kubeletClient, err := authority.sign("kube-apiserver-kubelet-client", []string{"system:masters"})
	if err != nil {
		return err
	}
	if err := kubeletClient.write(dir, "apiserver-kubelet-client"); err != nil {
		return err
	}
	server := fmt.Sprintf("https://%s:%d", NodeIP, APIPort)
	for _, u := range []struct{ file, cn, org string }{
		{"admin.conf", "kubernetes-admin", "system:masters"},
		{"controller-manager.conf", "system:kube-controller-manager", ""},
		{"scheduler.conf", "system:kube-scheduler", ""},
		{"kubelet.conf", "system:node:" + NodeName, "system:nodes"},
	} {
		var orgs []string
		if u.org != "" {
			orgs = []string{u.org}
		}
		kp, err := authority.sign(u.cn, orgs)
		if err != nil {
			return err
		}
		if err := os.WriteFile(inDir(u.file), kubeconfig(server, authority.pem, u.cn, kp), 0o600); err != nil {
			return err
		}
	}
	return nil
}

func (c *Cluster) startControlPlane(ctx context.Context, logf func(string, ...any)) error {
	pki := func(f string) string { return inDir("pki", f) }
	if _, err := startDaemon("etcd", nil, c.Bins.Etcd,
		"--name", "kpc", "--data-dir", inDir("etcd"),
		"--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
		"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
		"--initial-cluster", "kpc=http://127.0.0.1:2380", "--listen-metrics-urls", "http://127.0.0.1:2381",
		"--log-level", "warn"); err != nil {
		return err
	}
	if _, err := startDaemon("kube-apiserver", nil, c.Bins.APIServer,
		"--etcd-servers", "http://127.0.0.1:2379",
		"--advertise-address", NodeIP, "--secure-port", fmt.Sprint(APIPort),
		"--tls-cert-file", pki("apiserver.crt"), "--tls-private-key-file", pki("apiserver.key"),
		"--client-ca-file", pki("ca.crt"),
		"--kubelet-client-certificate", pki("apiserver-kubelet-client.crt"), "--kubelet-client-key", pki("apiserver-kubelet-client.key"),
		"--kubelet-preferred-address-types", "InternalIP",
		"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--allow-privileged=true",
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", pki("sa.pub"), "--service-account-signing-key-file", pki("sa.key"),
		"--service-cluster-ip-range", ServiceCIDR,
		"--profiling=false"); err != nil {
		return err
	}
	if err := c.connect(); err != nil {
		return err
	}
	if err := WaitFor(ctx, 90*time.Second, "the apiserver ready", func() error {
		body, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			return fmt.Errorf("%v: %s", err, body)
		}
		return nil
	}); err != nil {
		return err
	}
	logf("apiserver ready")
	if _, err := startDaemon("kube-controller-manager", nil, c.Bins.ControllerManager,
		"--kubeconfig", inDir("controller-manager.conf"),
		"--authentication-kubeconfig", inDir("controller-manager.conf"), "--authorization-kubeconfig", inDir("controller-manager.conf"),
		"--bind-address", "127.0.0.1", "--leader-elect=false",
		"--service-account-private-key-file", pki("sa.key"), "--root-ca-file", pki("ca.crt"),
		"--use-service-account-credentials=true",
		"--allocate-node-cidrs=true", "--cluster-cidr", PodCIDR, "--service-cluster-ip-range", ServiceCIDR,
		"--controllers", "*,bootstrapsigner,tokencleaner"); err != nil {
		return err
	}
	_, err := startDaemon("kube-scheduler", nil, c.Bins.Scheduler,
		"--kubeconfig", inDir("scheduler.conf"),
		"--authentication-kubeconfig", inDir("scheduler.conf"), "--authorization-kubeconfig", inDir("scheduler.conf"),
		"--bind-address", "127.0.0.1", "--leader-elect=false")
	return err
}

func (c *Cluster) connect() error {
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return err
	}
	cfg.Timeout = 15 * time.Second
	c.Client, err = kubernetes.NewForConfig(cfg)
	return err
}

func (c *Cluster) nodeReady(ctx context.Context) error {
	n, err := c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for _, cond := range n.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			if cond.Status == corev1.ConditionTrue {
				return nil
			}
			return fmt.Errorf("node %s not ready: %s", NodeName, cond.Message)
		}
	}
	return fmt.Errorf("node %s has no Ready condition yet", NodeName)
}

// addons deploys kube-proxy and CoreDNS with kubeadm's own `init phase
// addon`, as `kubeadm init` does, and waits for both to serve.
func (c *Cluster) addons(ctx context.Context, logf func(string, ...any)) error {
	if err := os.WriteFile(inDir("kubeadm.yaml"), []byte(c.kubeadmConfig()), 0o644); err != nil {
		return err
	}
	// upload-config first, as kubeadm init does: the kubeadm-config
	// ConfigMap is where the README's way back to kube-proxy reads the
	// ClusterConfiguration from.
	for _, phase := range [][]string{{"upload-config", "kubeadm"}, {"addon", "kube-proxy"}, {"addon", "coredns"}} {
		out, err := c.Kubeadm(ctx, append(append([]string{"init", "phase"}, phase...), "--config", inDir("kubeadm.yaml"))...)
		if err != nil {
			return err
		}
		logf("kubeadm: %s", strings.TrimSpace(out))
	}
	if err := c.WaitDaemonSet(ctx, "kube-proxy", 3*time.Minute); err != nil {
		return err
	}
	return c.WaitDeployment(ctx, "kube-system", "coredns", 3*time.Minute)
}

// Kubeadm runs kubeadm with the admin kubeconfig.
func (c *Cluster) Kubeadm(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, c.Bins.Kubeadm, append(args, "--kubeconfig", c.Kubeconfig)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubeadm %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// Kubectl runs kubectl with the admin kubeconfig, stdin given.
func (c *Cluster) Kubectl(ctx context.Context, stdin string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, c.Bins.Kubectl, append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// kubeadmConfig is what `kubeadm init --config` would be given for this
// node: images from the local "registry" prefix the images are built under,
// and one kube-proxy setting, as an operator passes it to kubeadm: leave
// nf_conntrack_max alone (maxPerCore 0), because this node is a network
// namespace, where that sysctl is read-only (kube-proxy's default exits with
// "open /proc/sys/net/netfilter/nf_conntrack_max: permission denied").
func (c *Cluster) kubeadmConfig() string {
	return fmt.Sprintf(`apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint:
  advertiseAddress: %[1]s
  bindPort: %[2]d
nodeRegistration:
  name: %[3]s
  criSocket: unix://%[4]s
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: %[5]s
clusterName: %[6]s
imageRepository: localhost
controlPlaneEndpoint: %[1]s:%[2]d
networking:
  podSubnet: %[7]s
  serviceSubnet: %[8]s
  dnsDomain: cluster.local
---
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
conntrack:
  maxPerCore: 0
`, NodeIP, APIPort, NodeName, containerdSocket(), c.Bins.Version, ClusterName, PodCIDR, ServiceCIDR)
}

// WaitDaemonSet waits until kube-system/name's pods are all updated,
// available and ready.
func (c *Cluster) WaitDaemonSet(ctx context.Context, name string, timeout time.Duration) error {
	return WaitFor(ctx, timeout, "DaemonSet "+name+" rolled out", func() error {
		ds, err := c.Client.AppsV1().DaemonSets("kube-system").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		return daemonSetRolledOut(ds)
	})
}

func daemonSetRolledOut(ds *appsv1.DaemonSet) error {
	s := ds.Status
	if s.ObservedGeneration < ds.Generation || s.DesiredNumberScheduled == 0 ||
		s.UpdatedNumberScheduled != s.DesiredNumberScheduled || s.NumberAvailable != s.DesiredNumberScheduled || s.NumberUnavailable != 0 {
		return fmt.Errorf("generation %d observed %d, desired %d updated %d available %d",
			ds.Generation, s.ObservedGeneration, s.DesiredNumberScheduled, s.UpdatedNumberScheduled, s.NumberAvailable)
	}
	return nil
}

// WaitDeployment waits until a Deployment's replicas are all updated and available.
func (c *Cluster) WaitDeployment(ctx context.Context, ns, name string, timeout time.Duration) error {
	return WaitFor(ctx, timeout, "Deployment "+ns+"/"+name+" rolled out", func() error {
		d, err := c.Client.AppsV1().Deployments(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		s := d.Status
		want := int32(1)
		if d.Spec.Replicas != nil {
			want = *d.Spec.Replicas
		}
		if s.ObservedGeneration < d.Generation || s.UpdatedReplicas != want || s.AvailableReplicas != want || s.Replicas != want {
			return fmt.Errorf("generation %d observed %d, want %d: updated %d available %d total %d",
				d.Generation, s.ObservedGeneration, want, s.UpdatedReplicas, s.AvailableReplicas, s.Replicas)
		}
		return nil
	})
}

// WaitFor polls check every 250 ms until it returns nil, giving up after
// timeout with its last error.
func WaitFor(ctx context.Context, timeout time.Duration, what string, check func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("waiting %v for %s: %w", timeout, what, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last: %v)", what, ctx.Err(), err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func imageCache() string {
	return filepath.Join(filepath.Dir(testbed.CacheDir()), "images")
}
