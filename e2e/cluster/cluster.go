// Package cluster brings up a real single-node Kubernetes cluster on this
// machine, built from the Go module proxy and Debian's packages only: etcd,
// kube-apiserver, kube-controller-manager and kube-scheduler as processes; a
// kubelet with Debian's containerd and runc and the CNI reference plugins
// (bridge with ipMasq, portmap); kube-proxy and CoreDNS deployed by kubeadm's
// own `init phase addon`; every image built here (images.go).
//
// The whole node lives in one network namespace, kpc-node, so that its
// iptables rules (the CNI's, kube-proxy's, kpipe's) are its own and nothing
// it does touches the host's: a veth pair joins it to the host (the node's
// address 10.77.0.2, the host's 10.77.0.1), the host routes the pod range to
// it, and the node's default route is a link that drops what it is given, so nothing it sends leaves the machine. Processes are started with
// nsenter --net (not `ip netns exec`, whose private mount namespace would hide
// the kubelet's volume mounts from containerd).
//
// Up leaves the cluster running (its processes are detached and recorded in
// Dir/run); Down removes every process, mount, namespace, interface and
// cgroup it made. `go tool task cluster` and `cluster-down` call them.
package cluster

import (
	"os"
	"path/filepath"
)

// The node's and the cluster's addresses.
const (
	NodeNS      = "kpc-node"  // the node's network namespace
	NodeName    = "kpc-node"  // its Node object
	NodeIP      = "10.77.0.2" // its address (eth0 in NodeNS)
	HostIP      = "10.77.0.1" // the host's end of the veth (kpc0)
	hostLink    = "kpc0"      // the host's end of the veth
	nodeLink    = "eth0"      // the node's end
	dropLink    = "kpc-drop"  // dummy: the node's default route, drops what leaves
	PodCIDR     = "10.244.0.0/16"
	NodePodCIDR = "10.244.0.0/24" // the controller manager gives the only node the first /24
	ServiceCIDR = "10.96.0.0/12"
	APIServerIP = "10.96.0.1"  // the kubernetes Service
	DNSIP       = "10.96.0.10" // kube-dns, as kubeadm allocates it
	APIPort     = 6443
	cgroupRoot  = "kpc" // the kubelet's cgroup root, in every v1 hierarchy
	ClusterName = "kpc"
)

// Dir is where the cluster keeps its state, logs, certificates and the
// records of what it started: $KPIPE_CLUSTER_DIR, else /var/lib/kpipe-cluster.
func Dir() string {
	if d := os.Getenv("KPIPE_CLUSTER_DIR"); d != "" {
		return d
	}
	return "/var/lib/kpipe-cluster"
}

// Kubeconfig is the admin kubeconfig, for kubectl on the host.
func Kubeconfig() string { return filepath.Join(Dir(), "admin.conf") }

func inDir(parts ...string) string { return filepath.Join(append([]string{Dir()}, parts...)...) }
