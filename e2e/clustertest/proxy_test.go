package clustertest

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kpipe/kpipe/e2e/cluster"
	"github.com/kpipe/kpipe/e2e/testbed"
)

// The ways the node changes hands, each as an operator does it.
type handover struct {
	name string
	to   string // the image the DaemonSet runs afterwards: kpipe's or kube-proxy's
	do   func(t *testing.T, ctx context.Context)
}

// toKpipeSetImage swaps the image of kubeadm's unchanged DaemonSet.
var toKpipeSetImage = handover{name: "kubectl set image", do: func(t *testing.T, ctx context.Context) {
	kubectl(t, ctx, "-n", "kube-system", "set", "image", "daemonset/kube-proxy", "kube-proxy="+c.Images.Kpipe.Ref)
}}

// toKpipeDeploy applies deploy/ with its image set to the one built here,
// as deploy/README.md says.
var toKpipeDeploy = handover{name: "kubectl apply -k deploy/", do: func(t *testing.T, ctx context.Context) {
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.DeployKpipe(ctx, root); err != nil {
		t.Fatal(err)
	}
}}

// toKubeProxyUndo is `kubectl rollout undo`, then deploy/README.md's
// removal of kpipe's role (harmless when it was never applied).
var toKubeProxyUndo = handover{name: "kubectl rollout undo", do: func(t *testing.T, ctx context.Context) {
	if err := c.RollBackToKubeProxy(ctx); err != nil {
		t.Fatal(err)
	}
}}

// toKubeProxyKubeadm is deploy/README.md's way back, command for command:
// kubeadm writes its DaemonSet again from the ClusterConfiguration in
// kubeadm-config and the kube-proxy configuration as it is now.
var toKubeProxyKubeadm = handover{name: "kubeadm init phase addon kube-proxy", do: func(t *testing.T, ctx context.Context) {
	clusterConfig := kubectl(t, ctx, "-n", "kube-system", "get", "cm", "kubeadm-config", "-o", "jsonpath={.data.ClusterConfiguration}")
	proxyConfig := kubectl(t, ctx, "-n", "kube-system", "get", "cm", "kube-proxy", "-o", `jsonpath={.data.config\.conf}`)
	file := filepath.Join(t.TempDir(), "kubeadm.yaml")
	if err := os.WriteFile(file, []byte(clusterConfig+"\n---\n"+proxyConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Kubeadm(ctx, "init", "phase", "addon", "kube-proxy", "--config", file); err != nil {
		t.Fatal(err)
	}
	if err := c.DropKpipeRole(ctx); err != nil {
		t.Fatal(err)
	}
}}

// onKubeProxy hands nothing over: it checks that kubeadm's kube-proxy
// serves the node, as a test that starts from it expects.
var onKubeProxy = handover{name: "start from kubeadm's kube-proxy", to: "kube-proxy", do: func(*testing.T, context.Context) {}}

func init() {
	toKpipeSetImage.to, toKpipeDeploy.to = "kpipe", "kpipe"
	toKubeProxyUndo.to, toKubeProxyKubeadm.to = "kube-proxy", "kube-proxy"
}

func kubectl(t *testing.T, ctx context.Context, args ...string) string {
	t.Helper()
	out, err := c.Kubectl(ctx, "", args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// handOver does h, waits until the DaemonSet has rolled out to h.to's
// image, and returns the new proxy's pod.
func handOver(t *testing.T, ctx context.Context, h handover) corev1.Pod {
	t.Helper()
	want := c.Images.KubeProxy.Ref
	if h.to == "kpipe" {
		want = c.Images.Kpipe.Ref
	}
	start := time.Now()
	h.do(t, ctx)
	if err := c.WaitDaemonSet(ctx, "kube-proxy", 3*time.Minute); err != nil {
		t.Fatalf("%s: %v", h.name, err)
	}
	var pod corev1.Pod
	err := cluster.WaitFor(ctx, time.Minute, "the proxy pod running "+want, func() error {
		pods, err := c.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy"})
		if err != nil {
			return err
		}
		if len(pods.Items) != 1 {
			return fmt.Errorf("%d proxy pods", len(pods.Items))
		}
		pod = pods.Items[0]
		if got := pod.Spec.Containers[0].Image; got != want {
			return fmt.Errorf("pod %s runs %s", pod.Name, got)
		}
		if pod.DeletionTimestamp != nil || len(pod.Status.ContainerStatuses) == 0 || pod.Status.ContainerStatuses[0].State.Running == nil {
			return fmt.Errorf("pod %s not running", pod.Name)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s: %v", h.name, err)
	}
	t.Logf("%s: %s serving (pod %s) %v after the command", h.name, h.to, pod.Name, time.Since(start).Round(100*time.Millisecond))
	return pod
}

// programsAChange proves that the proxy now running programs what changes:
// a new NodePort Service for e's pods answers from the host within a
// minute, and stops answering once deleted.
func programsAChange(t *testing.T, ctx context.Context, e echo, who string) {
	t.Helper()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: e.name + "-change", Namespace: "default"},
		Spec: corev1.ServiceSpec{
			Type:     corev1.ServiceTypeNodePort,
			Selector: map[string]string{"app": e.name},
			Ports:    []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}
	start := time.Now()
	created, err := c.Client.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort(cluster.NodeIP, fmt.Sprint(created.Spec.Ports[0].NodePort))
	if err := cluster.WaitFor(ctx, time.Minute, who+" programming a new NodePort "+addr, func() error {
		_, err := dialLine(addr)
		return err
	}); err != nil {
		t.Error(err)
	}
	t.Logf("%s programmed a new Service: answering at %s %v after its creation", who, addr, time.Since(start).Round(10*time.Millisecond))
	if err := c.Client.CoreV1().Services("default").Delete(ctx, svc.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitFor(ctx, time.Minute, who+" removing the deleted NodePort "+addr, func() error {
		if _, err := dialLine(addr); err == nil {
			return fmt.Errorf("%s still answers", addr)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
}

// nodeMetrics reads the proxy's /metrics on the node's address (the
// ConfigMap's metricsBindAddress is set to 0.0.0.0:10249 by the tests).
func nodeMetrics(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+net.JoinHostPort(cluster.NodeIP, "10249")+"/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	return string(b), err
}

// customiseProxyConfig makes an operator's change to kube-proxy's
// ConfigMap (metrics served on every address, not only loopback) and
// restarts the proxy to take it, unless it is there already.
func customiseProxyConfig(t *testing.T, ctx context.Context) {
	t.Helper()
	cm, err := c.Client.CoreV1().ConfigMaps("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	conf := cm.Data["config.conf"]
	if strings.Contains(conf, customMetrics) {
		return
	}
	if !strings.Contains(conf, `metricsBindAddress: ""`) {
		t.Fatalf("kubeadm's config.conf has no empty metricsBindAddress:\n%s", conf)
	}
	cm.Data["config.conf"] = strings.Replace(conf, `metricsBindAddress: ""`, customMetrics, 1)
	if _, err := c.Client.CoreV1().ConfigMaps("kube-system").Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubectl(t, ctx, "-n", "kube-system", "delete", "pod", "-l", "k8s-app=kube-proxy")
	if err := cluster.WaitFor(ctx, 2*time.Minute, "the proxy's metrics on the node's address", func() error {
		_, err := nodeMetrics(ctx)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

const customMetrics = "metricsBindAddress: 0.0.0.0:10249"

// requireCustomisationsKept checks that the operator's ConfigMap changes
// (ours, and kubeadm's conntrack setting given at init) are still there
// and in force: the running proxy serves /metrics on the node's address.
func requireCustomisationsKept(t *testing.T, ctx context.Context, who string) string {
	t.Helper()
	cm, err := c.Client.CoreV1().ConfigMaps("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{customMetrics, "maxPerCore: 0"} {
		if !strings.Contains(cm.Data["config.conf"], want) {
			t.Errorf("under %s the kube-proxy ConfigMap lost %q:\n%s", who, want, cm.Data["config.conf"])
		}
	}
	var metrics string
	if err := cluster.WaitFor(ctx, time.Minute, who+"'s /metrics on "+cluster.NodeIP, func() (err error) {
		metrics, err = nodeMetrics(ctx)
		return err
	}); err != nil {
		t.Error(err)
	}
	return metrics
}
