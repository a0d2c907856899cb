package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/watch"
)

// objects collects Services, EndpointSlices and this node's Node into the
// state render renders, each converted as the daemon's watch converts it.
type objects struct {
	conv  watch.Converter
	state bus.State
	// skipped counts the invalid parts of objects dropped, as the daemon drops
	// (and counts) them.
	skipped int
}

func newObjects(node string) *objects {
	return &objects{conv: watch.Converter{NodeName: node},
		state: bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}}}
}

// add takes obj in; ok is false for an object of another kind.
func (o *objects) add(obj runtime.Object) (ok bool) {
	switch v := obj.(type) {
	case *corev1.Service:
		if !proxied(v.Labels) {
			break
		}
		svc, skips := o.conv.Service(v)
		o.skipped += len(skips)
		if svc != nil {
			o.state.Services[svc.ServiceKey] = svc
		}
	case *discoveryv1.EndpointSlice:
		if !proxied(v.Labels) {
			break
		}
		sl, skips := o.conv.Slice(v)
		o.skipped += len(skips)
		if sl != nil {
			if o.state.Slices[sl.Service] == nil {
				o.state.Slices[sl.Service] = map[string]*bus.EndpointSlice{}
			}
			o.state.Slices[sl.Service][sl.Name] = sl
		}
	case *corev1.Node:
		if v.Name == o.conv.NodeName { // the daemon watches its own Node only
			o.state.Node = o.conv.Node(v)
		}
	default:
		return false
	}
	return true
}

// proxiedSelector is the daemon's selector of Services and EndpointSlices.
var proxiedSelector = func() labels.Selector {
	sel, err := labels.Parse(watch.Selector)
	if err != nil {
		panic(err) // a constant
	}
	return sel
}()

// proxied says whether the daemon watches an object with these labels.
func proxied(l map[string]string) bool { return proxiedSelector.Matches(labels.Set(l)) }

// listObjects lists, once, what the daemon's watch lists: the proxied
// Services and EndpointSlices and this node's Node.
func listObjects(ctx context.Context, client kubernetes.Interface, node string) (*objects, error) {
	o := newObjects(node)
	selected := metav1.ListOptions{LabelSelector: watch.Selector}
	services, err := client.CoreV1().Services("").List(ctx, selected)
	if err != nil {
		return nil, fmt.Errorf("list Services: %w", err)
	}
	endpointSlices, err := client.DiscoveryV1().EndpointSlices("").List(ctx, selected)
	if err != nil {
		return nil, fmt.Errorf("list EndpointSlices: %w", err)
	}
	n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("get Node %s: %w", node, err)
	}
	for i := range services.Items {
		o.add(&services.Items[i])
	}
	for i := range endpointSlices.Items {
		o.add(&endpointSlices.Items[i])
	}
	if err == nil {
		o.add(n)
	}
	return o, nil
}

// manifestExts are the files readManifests reads; it ignores others.
var manifestExts = []string{".yaml", ".yml", ".json"}

// readManifests reads every manifest file in dir (not its subdirectories):
// Services, EndpointSlices and Nodes, alone, several to a file ("---"), or in
// a List (as `kubectl get svc,endpointslices,node -o yaml` writes them). A
// file that does not parse, or holds an object of another kind, is an error
// naming it: what is rendered is then exactly what the files say.
func readManifests(dir, node string) (*objects, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("--manifests: %w", err)
	}
	o := newObjects(node)
	for _, e := range entries {
		if e.IsDir() || !slices.Contains(manifestExts, strings.ToLower(filepath.Ext(e.Name()))) {
			continue
		}
		path := filepath.Join(dir, e.Name())
		if err := o.readFile(path); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	return o, nil
}

// readFile adds every object of one manifest file.
func (o *objects) readFile(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	docs := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		if err := o.addManifest(doc); err != nil {
			return err
		}
	}
}

// addManifest adds the object of one document, or each item of a List.
func (o *objects) addManifest(doc []byte) error {
	obj, gvk, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
	if err != nil {
		return fmt.Errorf("not a Kubernetes object: %w", err)
	}
	if list, ok := obj.(*corev1.List); ok {
		for _, item := range list.Items {
			if err := o.addManifest(item.Raw); err != nil {
				return err
			}
		}
		return nil
	}
	if !o.add(obj) {
		return fmt.Errorf("a %s (%s) is not a Service, EndpointSlice or Node", gvk.Kind, gvk.GroupVersion())
	}
	return nil
}
