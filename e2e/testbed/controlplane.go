package testbed

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Control-plane endpoints, all on 127.0.0.1 inside the node namespace.
const (
	APIServerPort  = 6443
	etcdClientPort = 2379
	etcdPeerPort   = 2380
)

// APIServerURL is the apiserver's address as seen from the node namespace.
var APIServerURL = fmt.Sprintf("https://127.0.0.1:%d", APIServerPort)

func (tb *Testbed) startControlPlane(ctx context.Context, bins ControlPlaneBinaries) error {
	// etcd
	etcdClient := fmt.Sprintf("http://127.0.0.1:%d", etcdClientPort)
	etcdPeer := fmt.Sprintf("http://127.0.0.1:%d", etcdPeerPort)
	tb.etcdArgv = []string{"ip", "netns", "exec", tb.NodeNS, bins.Etcd,
		"--name", "kpe2e",
		"--data-dir", tb.path("etcd-data"),
		"--listen-client-urls", etcdClient,
		"--advertise-client-urls", etcdClient,
		"--listen-peer-urls", etcdPeer,
		"--initial-advertise-peer-urls", etcdPeer,
		"--initial-cluster", "kpe2e=" + etcdPeer,
		"--unsafe-no-fsync",
		"--log-level", "warn",
	}
	etcd, err := startProcess("etcd", tb.path("etcd.log"), nil, tb.etcdArgv...)
	if err != nil {
		return err
	}
	tb.etcd = etcd
	tb.track(etcd)

	// apiserver credentials
	tb.Token = randomHex(16)
	tokenFile := tb.path("tokens.csv")
	if err := os.WriteFile(tokenFile, []byte(tb.Token+`,kpe2e-admin,kpe2e-admin,"system:masters"`+"\n"), 0o600); err != nil {
		return fmt.Errorf("write token file: %w", err)
	}
	saKey := tb.path("sa.key")
	if err := writeRSAKey(saKey); err != nil {
		return err
	}
	certDir := tb.path("apiserver-certs")
	if err := os.MkdirAll(certDir, 0o700); err != nil {
		return err
	}
	args := []string{
		"ip", "netns", "exec", tb.NodeNS, bins.APIServer,
		"--etcd-servers", etcdClient,
		"--bind-address", "127.0.0.1",
		"--secure-port", fmt.Sprint(APIServerPort),
		"--advertise-address", NodeIPv4,
		"--cert-dir", certDir,
		"--token-auth-file", tokenFile,
		"--authorization-mode", "RBAC",
		"--allow-privileged=true", // as kubeadm's: kube-proxy's DaemonSet (and kpipe's) is privileged
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", saKey,
		"--service-account-signing-key-file", saKey,
		"--service-cluster-ip-range", ServiceCIDRs,
		"--endpoint-reconciler-type", "none",
		"--disable-admission-plugins", "ServiceAccount",
		"--enable-priority-and-fairness=false",
		"--profiling=false",
		"--v", "1",
	}
	audit, err := tb.auditArgs()
	if err != nil {
		return err
	}
	args = append(args, audit...)
	tb.apiserverArgv = args
	apiserver, err := startProcess("kube-apiserver", tb.path("kube-apiserver.log"), nil, args...)
	if err != nil {
		return err
	}
	tb.apiserver = apiserver
	tb.track(apiserver)

	tb.restConfig = &rest.Config{
		Host:            APIServerURL,
		BearerToken:     tb.Token,
		TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial:            tb.Dialer(tb.NodeNS),
		QPS:             200,
		Burst:           400,
		Timeout:         30 * time.Second,
	}
	cs, err := kubernetes.NewForConfig(tb.restConfig)
	if err != nil {
		return fmt.Errorf("make client: %w", err)
	}
	tb.client = cs

	if err := tb.waitReady(ctx, 90*time.Second); err != nil {
		return fmt.Errorf("%w\n--- etcd log (%s):\n%s\n--- kube-apiserver log (%s):\n%s",
			err, etcd.LogPath, etcd.Tail(30), apiserver.LogPath, apiserver.Tail(40))
	}
	return tb.writeKubeconfig()
}

func (tb *Testbed) waitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for {
		if tb.etcd.Exited() {
			return fmt.Errorf("etcd exited: %v", tb.etcd.ExitErr())
		}
		if tb.apiserver.Exited() {
			return fmt.Errorf("kube-apiserver exited: %v", tb.apiserver.ExitErr())
		}
		body, err := tb.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil {
			return nil
		}
		last = fmt.Sprintf("%v %s", err, body)
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("kube-apiserver not ready after %v: %s", timeout, last)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (tb *Testbed) writeKubeconfig() error {
	tb.Kubeconfig = tb.path("kubeconfig")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: kpe2e
  cluster:
    server: %s
    insecure-skip-tls-verify: true
users:
- name: kpe2e-admin
  user:
    token: %s
contexts:
- name: kpe2e
  context:
    cluster: kpe2e
    user: kpe2e-admin
current-context: kpe2e
`, APIServerURL, tb.Token)
	if err := os.WriteFile(tb.Kubeconfig, []byte(cfg), 0o600); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	return nil
}

// createNode registers the Node object kpipe runs as.
func (tb *Testbed) createNode(ctx context.Context) error {
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: NodeName,
			Labels: map[string]string{
				"kubernetes.io/hostname":      NodeName,
				"topology.kubernetes.io/zone": "zone-a",
			},
		},
		Spec: corev1.NodeSpec{
			PodCIDR:  PodCIDRIPv4,
			PodCIDRs: []string{PodCIDRIPv4, PodCIDRIPv6},
		},
	}
	created, err := tb.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		created, err = tb.client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
	}
	if err != nil {
		return fmt.Errorf("create node %s: %w", NodeName, err)
	}
	created.Status.Addresses = NodeAddresses()
	created.Status.Conditions = []corev1.NodeCondition{{
		Type:               corev1.NodeReady,
		Status:             corev1.ConditionTrue,
		Reason:             "KubeletReady",
		LastHeartbeatTime:  metav1.Now(),
		LastTransitionTime: metav1.Now(),
	}}
	if _, err := tb.client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update status of node %s: %w", NodeName, err)
	}
	return nil
}

func writeRSAKey(path string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return fmt.Errorf("generate service account key: %w", err)
	}
	b := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("write service account key: %w", err)
	}
	return nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
