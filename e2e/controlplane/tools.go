//go:build tools

// Package controlplane pins the real kube-apiserver and etcd that e2e tests run,
// and upstream kube-proxy (the swap tests hand the node between it and kpipe).
// Built with: go build -o DIR k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-proxy ./etcd
package controlplane

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
