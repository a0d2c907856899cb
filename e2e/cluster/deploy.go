package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// DeployKpipe does what deploy/README.md tells an operator: apply deploy/
// with its image set to the kpipe image built here (an overlay's images:,
// which is `kustomize edit set image` written down), and wait until the
// kube-proxy DaemonSet has rolled out.
func (c *Cluster) DeployKpipe(ctx context.Context, root string) error {
	dir, err := os.MkdirTemp("", "kpc-deploy-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	base, err := filepath.Rel(dir, filepath.Join(root, "deploy"))
	if err != nil {
		return err
	}
	name, tag, _ := strings.Cut(strings.TrimPrefix(c.Images.Kpipe.Ref, "localhost/"), ":")
	overlay := fmt.Sprintf("resources: [%s]\nimages:\n- name: ghcr.io/kpipe/kpipe\n  newName: localhost/%s\n  newTag: %q\n", base, name, tag)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(overlay), 0o644); err != nil {
		return err
	}
	if _, err := c.Kubectl(ctx, "", "apply", "--server-side", "--force-conflicts", "-k", dir); err != nil {
		return err
	}
	return c.WaitDaemonSet(ctx, "kube-proxy", 3*time.Minute)
}

// RollBackToKubeProxy is deploy/README.md's short way back: `kubectl
// rollout undo` of the DaemonSet, then kpipe's role dropped.
func (c *Cluster) RollBackToKubeProxy(ctx context.Context) error { return c.undoKpipe(ctx) }

// undoKpipe rolls the kube-proxy DaemonSet back (`rollout undo` with
// extra's flags), drops kpipe's role and waits for the rollout.
func (c *Cluster) undoKpipe(ctx context.Context, extra ...string) error {
	args := append([]string{"-n", "kube-system", "rollout", "undo", "daemonset/kube-proxy"}, extra...)
	if _, err := c.Kubectl(ctx, "", args...); err != nil {
		return err
	}
	if err := c.DropKpipeRole(ctx); err != nil {
		return err
	}
	return c.WaitDaemonSet(ctx, "kube-proxy", 3*time.Minute)
}

// BackToKubeProxy hands the node back to kubeadm's kube-proxy however often
// kpipe was deployed since (where `rollout undo` would go back to the kpipe
// before): the DaemonSet rolled back to its newest revision that runs
// upstream kube-proxy's image, then kpipe's role dropped.
func (c *Cluster) BackToKubeProxy(ctx context.Context) error {
	out, err := c.Kubectl(ctx, "", "-n", "kube-system", "get", "controllerrevisions", "-l", "k8s-app=kube-proxy", "-o",
		`jsonpath={range .items[*]}{.revision} {.data.spec.template.spec.containers[0].image}{"\n"}{end}`)
	if err != nil {
		return err
	}
	newest := int64(0)
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var rev int64
		var image string
		if _, err := fmt.Sscan(line, &rev, &image); err == nil && image == c.Images.KubeProxy.Ref && rev > newest {
			newest = rev
		}
	}
	if newest == 0 {
		return fmt.Errorf("no revision of the kube-proxy DaemonSet runs %s:\n%s", c.Images.KubeProxy.Ref, out)
	}
	return c.undoKpipe(ctx, fmt.Sprintf("--to-revision=%d", newest))
}

// DropKpipeRole deletes deploy/'s ClusterRole and binding, if there.
func (c *Cluster) DropKpipeRole(ctx context.Context) error {
	for _, kind := range []string{"clusterrolebinding", "clusterrole"} {
		if _, err := c.Kubectl(ctx, "", "delete", kind, "kpipe", "--ignore-not-found"); err != nil {
			return err
		}
	}
	return nil
}
