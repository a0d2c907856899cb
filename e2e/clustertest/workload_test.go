package clustertest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kpipe/kpipe/e2e/cluster"
)

// apply sends manifests to the cluster with kubectl apply.
func apply(t *testing.T, ctx context.Context, manifest string) {
	t.Helper()
	if _, err := c.Kubectl(ctx, manifest, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
}

// echo is a Deployment of the e2e echoserver (each connection answered with
// "<pod IP> <client>") behind a ClusterIP Service and a NodePort Service.
type echo struct {
	name      string
	clusterIP string
	nodePort  int32
}

// deployEcho starts name with replicas pods and waits until they serve;
// they are deleted when the test ends.
func deployEcho(t *testing.T, ctx context.Context, name string, replicas int) echo {
	t.Helper()
	apply(t, ctx, fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: %[1]s, namespace: default}
spec:
  replicas: %[2]d
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: echo
        image: %[3]s
        command: [/echoserver, -port, "8080", -http-port, "8081", -addr, $(POD_IP)]
        env:
        - name: POD_IP
          valueFrom: {fieldRef: {fieldPath: status.podIP}}
        readinessProbe:
          httpGet: {port: 8081}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: default}
spec:
  selector: {app: %[1]s}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: %[1]s-np, namespace: default}
spec:
  type: NodePort
  selector: {app: %[1]s}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
`, name, replicas, c.Images.Tools.Ref))
	for _, obj := range [][2]string{{"deployment", name}, {"service", name}, {"service", name + "-np"}} {
		t.Cleanup(func() { deleteWorkload(context.Background(), obj[0], obj[1]) })
	}
	if err := c.WaitDeployment(ctx, "default", name, 2*time.Minute); err != nil {
		t.Fatal(err)
	}
	svc, err := c.Client.CoreV1().Services("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	np, err := c.Client.CoreV1().Services("default").Get(ctx, name+"-np", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return echo{name: name, clusterIP: svc.Spec.ClusterIP, nodePort: np.Spec.Ports[0].NodePort}
}

// waitServed waits until e's NodePort answers from the host: the proxy
// has programmed e (its ClusterIP comes in the same sync), so that a client
// started now meets no rule not yet written.
func waitServed(t *testing.T, ctx context.Context, e echo) {
	t.Helper()
	addr := net.JoinHostPort(cluster.NodeIP, fmt.Sprint(e.nodePort))
	if err := cluster.WaitFor(ctx, time.Minute, e.name+" answering at "+addr, func() error {
		_, err := dialLine(addr)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// deleteWorkload removes what deployEcho or startProbe made.
func deleteWorkload(ctx context.Context, kind, name string) {
	_, _ = c.Kubectl(ctx, "", "-n", "default", "delete", kind, name, "--ignore-not-found", "--wait=false")
}

// trafficTargets are a client's loops through everything a swap must keep
// serving: the echo ClusterIP and NodePort, DNS over UDP and TCP through the
// kube-dns ClusterIP, and the apiserver through the kubernetes ClusterIP.
func trafficTargets(e echo, every string) []string {
	name := e.name + ".default.svc.cluster.local"
	return []string{
		fmt.Sprintf("clusterip=tcp:%s:80,every=%s", e.clusterIP, every),
		fmt.Sprintf("nodeport=tcp:%s:%d,every=%s", cluster.NodeIP, e.nodePort, every),
		fmt.Sprintf("dns-udp=dns-udp:%s:53,name=%s,every=%s", cluster.DNSIP, name, every),
		fmt.Sprintf("dns-tcp=dns-tcp:%s:53,name=%s,every=%s", cluster.DNSIP, name, every),
		fmt.Sprintf("apiserver=tls:%s:443,every=100ms", cluster.APIServerIP),
	}
}

// startProbe runs the probe client in a pod with targets (see
// e2e/cluster/images/probe), deleted when the test ends, and returns its pod
// IP, where the host reads its counts.
func startProbe(t *testing.T, ctx context.Context, name string, targets ...string) string {
	t.Helper()
	var args strings.Builder
	for _, tg := range targets {
		fmt.Fprintf(&args, ", -target, %q", tg)
	}
	apply(t, ctx, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: default}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: probe
    image: %s
    command: [/probe, -listen, ":8080"%s]
    readinessProbe:
      httpGet: {path: /healthz, port: 8080}
      periodSeconds: 1
`, name, c.Images.Tools.Ref, args.String()))
	t.Cleanup(func() { deleteWorkload(context.Background(), "pod", name) })
	var ip string
	err := cluster.WaitFor(ctx, 2*time.Minute, "pod "+name+" ready", func() error {
		p, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
				ip = p.Status.PodIP
				return nil
			}
		}
		return fmt.Errorf("pod %s not ready (%s)", name, p.Status.Phase)
	})
	if err != nil {
		t.Fatal(err)
	}
	return ip
}

// targetCounts is the part of the probe's /counts a test reads.
type targetCounts struct {
	OK           uint64            `json:"ok"`
	Failed       uint64            `json:"failed"`
	Endpoints    map[string]uint64 `json:"endpoints"`
	LastFailures []struct {
		Time   time.Time `json:"time"`
		Reason string    `json:"reason"`
		Error  string    `json:"error"`
	} `json:"last_failures"`
}

func readCounts(ctx context.Context, probeIP string) (map[string]targetCounts, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+net.JoinHostPort(probeIP, "8080")+"/counts", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Targets map[string]targetCounts `json:"targets"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, err
	}
	return body.Targets, nil
}

// countsNow reads the probe's counts, failing the test if it cannot.
func countsNow(t *testing.T, ctx context.Context, probeIP string) map[string]targetCounts {
	t.Helper()
	var counts map[string]targetCounts
	if err := cluster.WaitFor(ctx, 10*time.Second, "the probe's counts", func() (err error) { counts, err = readCounts(ctx, probeIP); return err }); err != nil {
		t.Fatal(err)
	}
	return counts
}

// requireNoFailures fails the test if any target failed since before, or
// made no successful attempt: a loop that ran nothing proves nothing.
func requireNoFailures(t *testing.T, what string, before, after map[string]targetCounts) {
	t.Helper()
	for name, a := range after {
		b := before[name]
		ok, failed := a.OK-b.OK, a.Failed-b.Failed
		t.Logf("%s: %s: %d ok, %d failed", what, name, ok, failed)
		if failed > 0 {
			t.Errorf("%s: %s: %d of %d attempts failed; last failures: %+v", what, name, failed, ok+failed, a.LastFailures)
		}
		if ok == 0 {
			t.Errorf("%s: %s made no successful attempt", what, name)
		}
	}
}

// dialLine connects from the host to address and reads the echoserver's line.
func dialLine(address string) (string, error) {
	conn, err := net.DialTimeout("tcp", address, time.Second)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if strings.TrimSpace(line) == "" {
		return "", fmt.Errorf("no line from %s: %v", address, err)
	}
	return line, nil
}
