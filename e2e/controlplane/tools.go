//go:build tools

// Package controlplane pins the real Kubernetes binaries that e2e tests run:
// kube-apiserver and etcd (the test bed), upstream kube-proxy (the swap
// tests hand the node between it and kpipe), and the rest of a real node and
// control plane for e2e/cluster: kubelet, kube-controller-manager,
// kube-scheduler, kubectl and kubeadm (whose `init phase addon` deploys
// kube-proxy and CoreDNS exactly as kubeadm does).
// Built with: go build -o DIR k8s.io/kubernetes/cmd/... ./etcd
package controlplane

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubeadm"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
