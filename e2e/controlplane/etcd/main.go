// Command etcd is etcd's own server main, built from the pinned module so the
// e2e tests get a real etcd without downloading a release binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
