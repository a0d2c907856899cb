//go:build tools

// Package tools pins CoreDNS at the version kubeadm v1.34 deploys
// (constants.CoreDNSVersion), built for the single-node cluster's
// localhost/coredns image (e2e/cluster/images.go). Its own module, outside
// go.work, so that CoreDNS's dependencies stay out of kpipe's go.mod.
package tools

import _ "github.com/coredns/coredns"
