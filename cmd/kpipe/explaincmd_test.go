package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/kpipe/kpipe/stages/render/tracer"
)

// sharedNodeRules is iptables-save's output on a node shared with Docker, with
// kube-proxy's rules for default/web (10.96.0.80:80, two endpoints).
const sharedNodeRules = "../../stages/render/tracer/testdata/shared-node.rules"

func fromAPod() explainFlags {
	return explainFlags{rules: sharedNodeRules, src: "10.244.1.20", dst: "10.96.0.80:80", proto: "tcp", from: fromPod,
		iface: "veth1", nodeIPs: []string{"192.168.1.10"}}
}

// What an operator reads: the Service, both endpoints with their chances,
// the source kept, each path's chains, and other agents' rules it could
// not evaluate.
func TestExplainPrintsTheServiceEndpointsAndPaths(t *testing.T) {
	var out bytes.Buffer
	if err := explain(context.Background(), fromAPod(), &out); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	for _, want := range []string{
		"packet:   tcp 10.244.1.20 -> 10.96.0.80:80 from a pod (IPv4, in on veth1)",
		"service:  default/web:http",
		"outcome:  ACCEPT, DNAT to one of 2 endpoints:",
		"10.244.1.5:8080           50.0%  source kept",
		"10.244.2.6:8080           50.0%  source kept",
		"path 1 of 2 (50.0%): DNAT to 10.244.1.5:8080, source kept, ACCEPT (routed on)",
		"nat/KUBE-SERVICES",
		"path 2 of 2 (50.0%): DNAT to 10.244.2.6:8080, source kept, ACCEPT (routed on)\n  (the first 3 steps as path 1's)\n  nat/KUBE-SVC-WEB",
		"not evaluated: rules explain cannot read (other agents' matches and targets), taken as not matching:",
		"nat/PREROUTING: -A PREROUTING -j LOG",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("no %q in:\n%s", want, text)
		}
	}
}

func TestExplainJSON(t *testing.T) {
	fl := fromAPod()
	fl.src, fl.from, fl.iface = "172.30.0.7", fromOutside, "eth0"
	fl.json = true
	var out bytes.Buffer
	if err := explain(context.Background(), fl, &out); err != nil {
		t.Fatal(err)
	}
	var e explanation
	if err := json.Unmarshal(out.Bytes(), &e); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	if e.Verdict != "ACCEPT" || len(e.Endpoints) != 2 || len(e.Paths) != 2 {
		t.Fatalf("got %+v", e)
	}
	for _, ep := range e.Endpoints {
		if math.Abs(ep.Probability-0.5) > 1e-9 || ep.Masqueraded != "yes" {
			t.Errorf("endpoint %+v; want probability 0.5, masqueraded (from outside the pod range)", ep)
		}
	}
	marked := slices.ContainsFunc(e.Paths[0].Steps, func(s tracer.Step) bool { return s.Chain == "KUBE-MARK-MASQ" && s.Mark == "0x4000" })
	if !marked {
		t.Errorf("no step of path 1 says KUBE-MARK-MASQ set the mark 0x4000: %+v", e.Paths[0].Steps)
	}
}

// Bad input: one clear error, before anything is read.
func TestExplainRefusesBadInput(t *testing.T) {
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage")
	if err := os.WriteFile(garbage, []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		change func(*explainFlags)
		want   string
	}{
		"no destination":       {func(f *explainFlags) { f.dst = "" }, "--dst IP:PORT is required"},
		"destination no IP":    {func(f *explainFlags) { f.dst = "web:80" }, `"web" is not an IP address`},
		"port out of range":    {func(f *explainFlags) { f.dst = "10.96.0.80:70000" }, `port "70000" is out of range (1-65535)`},
		"port 0":               {func(f *explainFlags) { f.dst = "10.96.0.80:0" }, `port "0" is out of range`},
		"no port":              {func(f *explainFlags) { f.dst = "10.96.0.80" }, "is not IP:PORT"},
		"source no IP":         {func(f *explainFlags) { f.src = "10.244.1.300" }, `--src "10.244.1.300" is not an IP address`},
		"no source from a pod": {func(f *explainFlags) { f.src = "" }, "--src is required for a packet from a pod"},
		"families differ":      {func(f *explainFlags) { f.src = "fd00::1" }, "are not of one IP family"},
		"protocol":             {func(f *explainFlags) { f.proto = "icmp" }, `--proto "icmp": want tcp, udp or sctp`},
		"entry point":          {func(f *explainFlags) { f.from = "mars" }, `--from "mars": want pod, node or outside`},
		"node ip":              {func(f *explainFlags) { f.nodeIPs = []string{"x"} }, `--node-ip "x" is not an IP address`},
		"unreadable rules":     {func(f *explainFlags) { f.rules = filepath.Join(dir, "none") }, "read --rules: open"},
		"not rules":            {func(f *explainFlags) { f.rules = garbage }, "outside a table"},
	} {
		fl := fromAPod()
		c.change(&fl)
		var out bytes.Buffer
		err := explain(context.Background(), fl, &out)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: error %v; want one line with %q", name, err, c.want)
		}
		if out.Len() > 0 {
			t.Errorf("%s: printed %q", name, out.String())
		}
	}
	if code := runWith([]string{"explain", "--dst", "10.96.0.80:99999", "--src", "10.244.1.20"}, nil); code != 1 {
		t.Errorf("exit code %d for a bad port; want 1", code)
	}
}

// With --kubeconfig, explain says what the apiserver holds of each Service
// the rules name: its policies, or that it is gone (the rules are stale).
func TestExplainAsksTheApiserverAboutTheServices(t *testing.T) {
	local := corev1.ServiceInternalTrafficPolicyLocal
	web := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"}, Spec: corev1.ServiceSpec{
		Type: corev1.ServiceTypeNodePort, ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyLocal, InternalTrafficPolicy: &local,
		SessionAffinity:       corev1.ServiceAffinityClientIP,
		SessionAffinityConfig: &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](60)}}}}
	client := fake.NewClientset(web)
	facts, err := lookUpServices(context.Background(), client, []string{"default/web:http", "default/web:https", "default/gone:http"})
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, f := range facts {
		lines = append(lines, f.String())
	}
	want := []string{
		"default/web: type NodePort, externalTrafficPolicy Local, internalTrafficPolicy Local, sessionAffinity ClientIP (60 s)",
		"default/gone: not in the apiserver (deleted? the node's rules for it are stale)",
	}
	if !slices.Equal(lines, want) {
		t.Fatalf("got\n%s\nwant\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
	client.PrependReactor("get", "services", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("connection refused")
	})
	if _, err := lookUpServices(context.Background(), client, []string{"default/web:http"}); err == nil || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("an apiserver that does not answer: %v", err)
	}
	fl := fromAPod()
	fl.kubeconfig = filepath.Join(t.TempDir(), "none")
	if err := explain(context.Background(), fl, &bytes.Buffer{}); err == nil || strings.Contains(err.Error(), "\n") {
		t.Fatalf("an unreadable kubeconfig: %v; want one line", err)
	}
}

// "What if": kpipe render --manifests writes the rules for a directory of
// objects, and kpipe explain --rules follows a packet through them.
func TestExplainWhatRenderWrote(t *testing.T) {
	code, out, stderr := runRenderCaptured(t, append([]string{"--manifests", "testdata/render"}, renderArgs...)...)
	if code != 0 {
		t.Fatalf("render: exit %d; stderr %q", code, stderr)
	}
	rules := filepath.Join(t.TempDir(), "what-if.rules")
	if err := os.WriteFile(rules, []byte(out), 0o644); err != nil {
		t.Fatal(err)
	}
	fl := explainFlags{rules: rules, src: "10.244.0.50", dst: "10.96.0.10:80", proto: "tcp", from: fromPod, iface: "veth9", json: true}
	var b bytes.Buffer
	if err := explain(context.Background(), fl, &b); err != nil {
		t.Fatal(err)
	}
	var e explanation
	if err := json.Unmarshal(b.Bytes(), &e); err != nil {
		t.Fatal(err)
	}
	if len(e.Endpoints) != 1 || e.Endpoints[0].Endpoint != "10.244.0.10:8080" || !slices.Equal(e.Services, []string{"default/web:http"}) {
		t.Fatalf("explained %+v; want default/web:http DNATed to 10.244.0.10:8080", e)
	}
}
