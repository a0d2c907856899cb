package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// deployDir holds the manifests that replace kube-proxy with kpipe.
const deployDir = "../deploy"

// deployObject is one YAML document of deploy/, decoded strictly.
type deployObject struct {
	file string
	obj  runtime.Object
}

func (o deployObject) String() string {
	m := o.obj.(metav1.Object)
	return fmt.Sprintf("%s: %T %s/%s", o.file, o.obj, m.GetNamespace(), m.GetName())
}

// manifestFiles lists the YAML files of deploy/ that hold objects (all but
// kustomization.yaml, which is kustomize's input).
func manifestFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	for _, pattern := range []string{"*.yaml", "*.yml"} {
		m, err := filepath.Glob(filepath.Join(deployDir, pattern))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	files = slices.DeleteFunc(files, func(f string) bool { return filepath.Base(f) == "kustomization.yaml" })
	sort.Strings(files)
	if len(files) == 0 {
		t.Fatalf("no manifests under %s", deployDir)
	}
	return files
}

// loadDeployObjects decodes every document of every manifest strictly into
// its typed object: an unknown field (a typo) or an unknown kind fails.
func loadDeployObjects(t *testing.T) []deployObject {
	t.Helper()
	var objs []deployObject
	for _, file := range manifestFiles(t) {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
		for i := 0; ; i++ {
			doc, err := r.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("%s: document %d: %v", file, i, err)
			}
			obj, err := decodeStrict(doc)
			if err != nil {
				t.Fatalf("%s: document %d: %v", file, i, err)
			}
			if obj != nil {
				objs = append(objs, deployObject{file: filepath.Base(file), obj: obj})
			}
		}
	}
	return objs
}

// decodeStrict decodes one YAML document into the typed object its
// apiVersion and kind name; nil for a document of comments only.
func decodeStrict(doc []byte) (runtime.Object, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	if tm.APIVersion == "" && tm.Kind == "" {
		if len(bytes.TrimSpace(stripComments(doc))) != 0 {
			return nil, errors.New("document without apiVersion and kind")
		}
		return nil, nil
	}
	var obj runtime.Object
	switch tm.APIVersion + " " + tm.Kind {
	case "v1 ServiceAccount":
		obj = &corev1.ServiceAccount{}
	case "rbac.authorization.k8s.io/v1 ClusterRole":
		obj = &rbacv1.ClusterRole{}
	case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
		obj = &rbacv1.ClusterRoleBinding{}
	case "apps/v1 DaemonSet":
		obj = &appsv1.DaemonSet{}
	default:
		return nil, fmt.Errorf("unexpected %s %s (teach decodeStrict and dryRunCreate about it)", tm.APIVersion, tm.Kind)
	}
	if err := unmarshalStrict(doc, obj); err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	return obj, nil
}

// unmarshalStrict decodes YAML into v as the apiserver's strict field
// validation does: field names are case-sensitive (encoding/json, under
// sigs.k8s.io/yaml.UnmarshalStrict, would take "hostnetwork"), unknown and
// duplicate fields are errors.
func unmarshalStrict(doc []byte, v any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strictErrs, err := sigsjson.UnmarshalStrict(j, v, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}

func stripComments(doc []byte) []byte {
	var out []byte
	for line := range bytes.Lines(doc) {
		if !bytes.HasPrefix(bytes.TrimSpace(line), []byte("#")) {
			out = append(out, line...)
		}
	}
	return out
}

// dryRunCreate sends obj to the apiserver as a server-side dry-run create:
// validated and admitted (priority class, RBAC escalation checks) like a
// real create, never stored.
func dryRunCreate(ctx context.Context, cs kubernetes.Interface, obj runtime.Object) error {
	opts := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: metav1.FieldValidationStrict}
	var err error
	switch o := obj.(type) {
	case *corev1.ServiceAccount:
		_, err = cs.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, opts)
	case *rbacv1.ClusterRole:
		_, err = cs.RbacV1().ClusterRoles().Create(ctx, o, opts)
	case *rbacv1.ClusterRoleBinding:
		_, err = cs.RbacV1().ClusterRoleBindings().Create(ctx, o, opts)
	case *appsv1.DaemonSet:
		_, err = cs.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, opts)
	default:
		err = fmt.Errorf("no dry run for %T", obj)
	}
	return err
}

// waitKubeSystem waits for the apiserver's own kube-system namespace (its
// system namespaces controller creates it shortly after start).
func waitKubeSystem(ctx context.Context, t *testing.T, cs kubernetes.Interface) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := cs.CoreV1().Namespaces().Get(ctx, metav1.NamespaceSystem, metav1.GetOptions{})
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("namespace kube-system: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestDeployManifestsDryRun: the real kube-apiserver accepts every object of
// deploy/ (server-side dry run: validation, defaulting, admission).
func TestDeployManifestsDryRun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cs := tb.Client()
	waitKubeSystem(ctx, t, cs)

	objs := loadDeployObjects(t)
	for _, o := range objs {
		m := o.obj.(metav1.Object)
		namespaced := true
		switch o.obj.(type) {
		case *rbacv1.ClusterRole, *rbacv1.ClusterRoleBinding:
			namespaced = false
		}
		if namespaced && m.GetNamespace() != metav1.NamespaceSystem {
			t.Errorf("%v: namespace %q, want kube-system (where kubeadm's kube-proxy lives)", o, m.GetNamespace())
			continue
		}
		err := dryRunCreate(ctx, cs, o.obj)
		if err == nil {
			if ds, ok := o.obj.(*appsv1.DaemonSet); ok {
				err = dryRunPod(ctx, t, cs, ds)
			}
		}
		if err != nil {
			t.Errorf("%v: the apiserver refused it: %v", o, err)
			continue
		}
		t.Logf("%v: accepted (dry run)", o)
	}
	// Nothing was stored.
	if _, err := cs.AppsV1().DaemonSets(metav1.NamespaceSystem).Get(ctx, "kube-proxy", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("after a dry run, get daemonset kube-system/kube-proxy: %v, want NotFound", err)
	}
}

// dryRunPod sends a pod made from the DaemonSet's template as a dry run:
// pod admission (the priority class must exist) sees only pods.
func dryRunPod(ctx context.Context, t *testing.T, cs kubernetes.Interface, ds *appsv1.DaemonSet) error {
	pod := &corev1.Pod{
		ObjectMeta: *ds.Spec.Template.ObjectMeta.DeepCopy(),
		Spec:       *ds.Spec.Template.Spec.DeepCopy(),
	}
	pod.Namespace = ds.Namespace
	pod.GenerateName = ds.Name + "-"
	pod.Spec.NodeName = testbedNodeName(ctx, t)
	opts := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: metav1.FieldValidationStrict}
	_, err := cs.CoreV1().Pods(pod.Namespace).Create(ctx, pod, opts)
	if err != nil {
		return fmt.Errorf("a pod of its template: %w", err)
	}
	return nil
}

// deployDaemonSet is the one DaemonSet of deploy/ and its one container.
func deployDaemonSet(t *testing.T) (*appsv1.DaemonSet, *corev1.Container) {
	t.Helper()
	var dss []*appsv1.DaemonSet
	for _, o := range loadDeployObjects(t) {
		if ds, ok := o.obj.(*appsv1.DaemonSet); ok {
			dss = append(dss, ds)
		}
	}
	if len(dss) != 1 {
		t.Fatalf("%d DaemonSets under deploy/, want 1", len(dss))
	}
	ds := dss[0]
	if n := len(ds.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("DaemonSet has %d containers, want 1", n)
	}
	return ds, &ds.Spec.Template.Spec.Containers[0]
}

// TestDeployDaemonSet: the DaemonSet has what kubeadm's kube-proxy DaemonSet
// has and kpipe needs; removing any of it fails here.
func TestDeployDaemonSet(t *testing.T) {
	ds, c := deployDaemonSet(t)
	pod := ds.Spec.Template.Spec

	// Same identity as kubeadm's, so applying it replaces kube-proxy in place
	// (a DaemonSet's selector cannot change).
	if ds.Namespace != "kube-system" || ds.Name != "kube-proxy" {
		t.Errorf("DaemonSet %s/%s, want kube-system/kube-proxy", ds.Namespace, ds.Name)
	}
	if ds.Spec.Selector == nil || len(ds.Spec.Selector.MatchLabels) != 1 || ds.Spec.Selector.MatchLabels["k8s-app"] != "kube-proxy" {
		t.Errorf("selector %v, want kubeadm's k8s-app=kube-proxy", ds.Spec.Selector)
	}
	if ds.Spec.UpdateStrategy.Type != appsv1.RollingUpdateDaemonSetStrategyType {
		t.Errorf("updateStrategy %q, want RollingUpdate", ds.Spec.UpdateStrategy.Type)
	}
	if !pod.HostNetwork {
		t.Error("hostNetwork is not set: kpipe must program the node's own netfilter")
	}
	if pod.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q, want system-node-critical", pod.PriorityClassName)
	}
	if pod.ServiceAccountName != "kube-proxy" {
		t.Errorf("serviceAccountName %q, want kube-proxy (kubeadm's kubeconfig.conf reads its token)", pod.ServiceAccountName)
	}
	if pod.NodeSelector["kubernetes.io/os"] != "linux" {
		t.Errorf("nodeSelector %v, want kubernetes.io/os=linux", pod.NodeSelector)
	}
	wantTolerations := []corev1.Toleration{
		{Key: "CriticalAddonsOnly", Operator: corev1.TolerationOpExists},
		{Operator: corev1.TolerationOpExists},
	}
	for _, want := range wantTolerations {
		if !slices.Contains(pod.Tolerations, want) {
			t.Errorf("tolerations %v lack %v (kubeadm's)", pod.Tolerations, want)
		}
	}

	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Error("container is not privileged")
	}
	for _, arg := range []string{"--config=/var/lib/kube-proxy/config.conf", "--hostname-override=$(NODE_NAME)"} {
		if !slices.Contains(c.Args, arg) && !slices.Contains(c.Command, arg) {
			t.Errorf("container lacks the argument %s (command %q, args %q)", arg, c.Command, c.Args)
		}
	}
	nodeName := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool {
		return e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil &&
			e.ValueFrom.FieldRef.FieldPath == "spec.nodeName"
	})
	if nodeName < 0 {
		t.Errorf("env %v lacks NODE_NAME from spec.nodeName", c.Env)
	}

	// kubeadm's kube-proxy has no probes; a liveness probe on /livez would
	// restart kpipe over what a restart cannot fix (a write the kernel refuses).
	if c.LivenessProbe != nil || c.ReadinessProbe != nil || c.StartupProbe != nil {
		t.Errorf("probes liveness %v, readiness %v, startup %v; kubeadm's kube-proxy has none", c.LivenessProbe, c.ReadinessProbe, c.StartupProbe)
	}

	checkMount(t, pod, c, "/var/lib/kube-proxy", false, func(v corev1.VolumeSource) bool {
		return v.ConfigMap != nil && v.ConfigMap.Name == "kube-proxy"
	}, "kubeadm's kube-proxy ConfigMap")
	checkMount(t, pod, c, "/run/xtables.lock", false, func(v corev1.VolumeSource) bool {
		return v.HostPath != nil && v.HostPath.Path == "/run/xtables.lock" &&
			v.HostPath.Type != nil && *v.HostPath.Type == corev1.HostPathFileOrCreate
	}, "the host's /run/xtables.lock (FileOrCreate)")
	checkMount(t, pod, c, "/lib/modules", true, func(v corev1.VolumeSource) bool {
		return v.HostPath != nil && v.HostPath.Path == "/lib/modules"
	}, "the host's /lib/modules")
}

// checkMount: the container mounts, at path, a volume from source (readOnly
// as given).
func checkMount(t *testing.T, pod corev1.PodSpec, c *corev1.Container, path string, readOnly bool,
	source func(corev1.VolumeSource) bool, what string) {
	t.Helper()
	i := slices.IndexFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == path })
	if i < 0 {
		t.Errorf("nothing mounted at %s (want %s)", path, what)
		return
	}
	m := c.VolumeMounts[i]
	if m.ReadOnly != readOnly {
		t.Errorf("mount %s readOnly=%v, want %v", path, m.ReadOnly, readOnly)
	}
	j := slices.IndexFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name })
	if j < 0 || !source(pod.Volumes[j].VolumeSource) {
		t.Errorf("mount %s: volume %q is not %s", path, m.Name, what)
	}
}

// kustomization is the part of kustomize's Kustomization deploy/ uses;
// decoding strictly makes any other field (or a typo) fail.
type kustomization struct {
	APIVersion string           `json:"apiVersion"`
	Kind       string           `json:"kind"`
	Resources  []string         `json:"resources"`
	Images     []kustomizeImage `json:"images"`
}

// kustomizeImage is an images: entry.
type kustomizeImage struct {
	Name    string `json:"name"`
	NewName string `json:"newName,omitempty"`
	NewTag  string `json:"newTag,omitempty"`
	Digest  string `json:"digest,omitempty"`
}

// TestDeployKustomization: kustomization.yaml parses, lists every manifest
// of deploy/ and sets the DaemonSet's image.
func TestDeployKustomization(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(deployDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := unmarshalStrict(data, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Errorf("kustomization.yaml is %s %s", k.APIVersion, k.Kind)
	}
	var want []string
	for _, f := range manifestFiles(t) {
		want = append(want, filepath.Base(f))
	}
	got := slices.Sorted(slices.Values(k.Resources))
	if !slices.Equal(got, want) {
		t.Errorf("resources %q, want the manifests %q", got, want)
	}
	_, c := deployDaemonSet(t)
	i := slices.IndexFunc(k.Images, func(im kustomizeImage) bool {
		return im.Name == c.Image
	})
	if i < 0 || k.Images[i].NewName == "" {
		t.Fatalf("images %+v do not set the DaemonSet's image %q", k.Images, c.Image)
	}
	// A release, not :latest: what a node runs must not change under it when
	// the kubelet pulls again (and IfNotPresent would keep an old :latest).
	if im := k.Images[i]; im.Digest == "" && !releaseTag.MatchString(im.NewTag) {
		t.Errorf("image %s:%s; want a release tag (vX.Y.Z) or a digest", im.NewName, im.NewTag)
	}
}

// releaseTag is a released version's tag, as the Dockerfile stamps VERSION.
var releaseTag = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+$`)

// TestDeployRBAC: with deploy/'s ClusterRole and binding stored (and nothing
// else granting it anything), the kube-proxy ServiceAccount (a client
// impersonating it) can list and watch what kpipe's informers watch and record
// events.k8s.io events, and is refused everything in kpipeNeverDoes (its own
// SelfSubjectAccessReviews) and a real secrets list: kpipe's role is enough,
// and no more.
func TestDeployRBAC(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cs := tb.Client()
	waitKubeSystem(ctx, t, cs)
	for _, o := range loadDeployObjects(t) {
		var err error
		switch obj := o.obj.(type) {
		case *rbacv1.ClusterRole:
			_, err = cs.RbacV1().ClusterRoles().Create(ctx, obj, metav1.CreateOptions{})
			t.Cleanup(func() { _ = cs.RbacV1().ClusterRoles().Delete(context.Background(), obj.Name, metav1.DeleteOptions{}) })
		case *rbacv1.ClusterRoleBinding:
			_, err = cs.RbacV1().ClusterRoleBindings().Create(ctx, obj, metav1.CreateOptions{})
			t.Cleanup(func() {
				_ = cs.RbacV1().ClusterRoleBindings().Delete(context.Background(), obj.Name, metav1.DeleteOptions{})
			})
		}
		if err != nil {
			t.Fatalf("%v: %v", o, err)
		}
	}

	cfg := tb.RESTConfig()
	cfg.Impersonate.UserName = "system:serviceaccount:kube-system:kube-proxy"
	sa, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	list := metav1.ListOptions{Limit: 1}
	allowed := map[string]func() error{
		"list services":       func() error { _, err := sa.CoreV1().Services("").List(ctx, list); return err },
		"list endpointslices": func() error { _, err := sa.DiscoveryV1().EndpointSlices("").List(ctx, list); return err },
		"list nodes":          func() error { _, err := sa.CoreV1().Nodes().List(ctx, list); return err },
		"watch services":      func() error { return watchOnce(sa.CoreV1().Services("").Watch(ctx, metav1.ListOptions{})) },
		"watch endpointslices": func() error {
			return watchOnce(sa.DiscoveryV1().EndpointSlices("").Watch(ctx, metav1.ListOptions{}))
		},
		"watch nodes": func() error { return watchOnce(sa.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{})) },
		"create events.k8s.io events": func() error {
			ev := &eventsv1.Event{
				ObjectMeta: metav1.ObjectMeta{GenerateName: "kpipe-", Namespace: metav1.NamespaceDefault},
				EventTime:  metav1.NowMicro(), ReportingController: "kube-proxy", ReportingInstance: "kube-proxy-test",
				Action: "StartKubeProxy", Regarding: corev1.ObjectReference{Kind: "Node", Name: testbedNodeName(ctx, t)},
				Reason: "Test", Note: "TestDeployRBAC", Type: corev1.EventTypeNormal,
			}
			_, err := sa.EventsV1().Events(metav1.NamespaceDefault).Create(ctx, ev,
				metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			return err
		},
	}
	// RBAC's authorizer follows its cache: wait until the role applies.
	deadline := time.Now().Add(30 * time.Second)
	for name, try := range allowed {
		for {
			err := try()
			if err == nil {
				break
			}
			if !apierrors.IsForbidden(err) || time.Now().After(deadline) {
				t.Errorf("%s as kube-system:kube-proxy: %v", name, err)
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	for _, c := range kpipeNeeds {
		if !selfAllowed(ctx, t, sa, c) {
			t.Errorf("kube-system:kube-proxy is refused %v, which kpipe does", c)
		}
	}
	// Not granted, every time.
	for range settleRequests {
		_, err := sa.CoreV1().Secrets(metav1.NamespaceSystem).List(ctx, list)
		if !apierrors.IsForbidden(err) {
			t.Fatalf("list secrets as kube-system:kube-proxy: %v, want Forbidden", err)
		}
		for _, c := range kpipeNeverDoes {
			if selfAllowed(ctx, t, sa, c) {
				t.Errorf("kube-system:kube-proxy is allowed %v, which kpipe never does", c)
			}
		}
		time.Sleep(settleInterval)
	}
}

func watchOnce(w watch.Interface, err error) error {
	if err != nil {
		return err
	}
	w.Stop()
	return nil
}

func testbedNodeName(ctx context.Context, t *testing.T) string {
	t.Helper()
	n, err := tb.GetNode(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return n.Name
}

// rbacCheck is one request kpipe's ServiceAccount makes, or must not be able to.
type rbacCheck struct{ verb, group, resource string }

// kpipeNeeds is every request kpipe's code makes to the apiserver: the
// informers of stages/watch, and stages/events' events.k8s.io broadcaster
// (create; patch for a series).
var kpipeNeeds = []rbacCheck{
	{"list", "", "services"}, {"watch", "", "services"},
	{"list", "discovery.k8s.io", "endpointslices"}, {"watch", "discovery.k8s.io", "endpointslices"},
	{"list", "", "nodes"}, {"watch", "", "nodes"},
	{"create", "events.k8s.io", "events"}, {"patch", "events.k8s.io", "events"},
}

// TestDeployRBACRulesAreKpipesNeeds: deploy/rbac.yaml's ClusterRole, expanded,
// grants exactly kpipeNeeds: nothing more.
func TestDeployRBACRulesAreKpipesNeeds(t *testing.T) {
	var role *rbacv1.ClusterRole
	for _, o := range loadDeployObjects(t) {
		if r, ok := o.obj.(*rbacv1.ClusterRole); ok {
			role = r
		}
	}
	if role == nil {
		t.Fatal("deploy/ has no ClusterRole")
	}
	var granted []rbacCheck
	for _, r := range role.Rules {
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, v := range r.Verbs {
					granted = append(granted, rbacCheck{v, g, res})
				}
			}
		}
		if len(r.ResourceNames) > 0 || len(r.NonResourceURLs) > 0 {
			t.Errorf("rule %+v: kpipe needs no resourceNames or non-resource URLs", r)
		}
	}
	less := func(a, b rbacCheck) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) }
	want := slices.Clone(kpipeNeeds)
	slices.SortFunc(want, less)
	slices.SortFunc(granted, less)
	if !slices.Equal(granted, want) {
		t.Errorf("ClusterRole %s grants %v; want exactly %v", role.Name, granted, want)
	}
}

// kpipeNeverDoes are requests kpipe's account must be refused.
var kpipeNeverDoes = []rbacCheck{
	{"list", "", "secrets"}, {"get", "", "secrets"}, {"get", "", "configmaps"}, {"list", "", "pods"},
	{"update", "", "services"}, {"create", "", "services"}, {"delete", "", "services"}, {"patch", "", "services"},
	{"update", "discovery.k8s.io", "endpointslices"}, {"create", "discovery.k8s.io", "endpointslices"},
	{"patch", "", "nodes"}, {"update", "", "nodes"}, {"delete", "", "nodes"},
	{"create", "", "events"}, {"update", "events.k8s.io", "events"}, {"delete", "events.k8s.io", "events"},
	{"list", "events.k8s.io", "events"},
}

// selfAllowed asks the apiserver whether the client's own user may do c.
func selfAllowed(ctx context.Context, t *testing.T, cs kubernetes.Interface, c rbacCheck) bool {
	t.Helper()
	r := &authorizationv1.SelfSubjectAccessReview{Spec: authorizationv1.SelfSubjectAccessReviewSpec{
		ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: c.verb, Group: c.group, Resource: c.resource,
			Namespace: metav1.NamespaceDefault}}}
	got, err := cs.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, r, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("SelfSubjectAccessReview %v: %v", c, err)
	}
	return got.Status.Allowed
}
