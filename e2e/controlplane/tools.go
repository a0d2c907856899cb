//go:build tools

// Package controlplane pins the real kube-apiserver and etcd that e2e tests run.
// Built with: go build -o DIR k8s.io/kubernetes/cmd/kube-apiserver ./etcd
package controlplane

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
