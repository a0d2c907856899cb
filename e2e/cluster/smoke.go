package cluster

import "os"

// SmokeOnly says whether the real-cluster tests run only their smoke subset
// (KPIPE_CLUSTER_SMOKE=1, as `go tool task e2e-cluster-smoke` and so
// `go tool task test` run them): the drop-in image, pods reaching the
// apiserver and DNS, one swap and rollback under traffic. It is not -short,
// which runs no test that needs root and the kernel.
func SmokeOnly() bool { return os.Getenv("KPIPE_CLUSTER_SMOKE") == "1" }
