// Command demo shows kpipe at work: it starts the e2e test bed (kube-apiserver,
// etcd, a node namespace, 3 pods), runs kpipe in the node, creates a TCP and a
// UDP service with pods 1 and 2 as endpoints, prints real answers through
// their ClusterIPs as pod 3 sees them and the rules kpipe wrote, ends by
// explaining one of pod 3's packets (kpipe explain), then removes everything. Needs root. Run from the repository:
//
//	go run ./e2e/demo
//
// It exits non-zero if it could not show answers from two different endpoints.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kpipe/kpipe/e2e/testbed"
)

func main() {
	os.Exit(run())
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "demo: "+format+"\n", args...)
}

func run() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	tb, err := testbed.New(ctx, testbed.Config{Pods: 3, Logf: logf})
	if err != nil {
		logf("test bed: %v", err)
		return 1
	}
	// Clean up on the way out, and on Ctrl-C.
	go func() {
		<-ctx.Done()
		tb.Close()
	}()
	defer func() {
		if err := tb.Close(); err != nil {
			logf("cleanup: %v", err)
		}
		logf("cleaned up: namespaces, processes and %s removed", tb.Dir)
	}()

	code, err := show(ctx, tb)
	if err != nil {
		logf("%v", err)
		if k := tb.Kpipe(); k != nil {
			logf("kpipe log tail:\n%s", k.LogTail(30))
		}
	}
	return code
}

func show(ctx context.Context, tb *testbed.Testbed) (int, error) {
	k, err := tb.BuildKpipe()
	if err != nil {
		return 1, err
	}
	if err := k.Start(); err != nil {
		return 1, err
	}
	logf("kpipe running in %s (pid %d)", tb.NodeNS, k.PID())

	const ns = "demo"
	if err := tb.CreateNamespace(ctx, ns); err != nil {
		return 1, err
	}
	var svcs []*corev1.Service
	for _, s := range []struct {
		name  string
		proto corev1.Protocol
	}{{"echo-tcp", corev1.ProtocolTCP}, {"echo-udp", corev1.ProtocolUDP}} {
		svc, err := tb.CreateService(ctx, testbed.Service(ns, s.name, testbed.Port("echo", s.proto, 80, testbed.EchoPort)))
		if err != nil {
			return 1, err
		}
		if _, err := tb.SetEndpoints(ctx, svc, tb.ReadyEndpoints(1, 2)); err != nil {
			return 1, err
		}
		svcs = append(svcs, svc)
		fmt.Printf("service %s/%s: ClusterIP %s port 80/%s -> endpoints %s and %s port %d\n",
			ns, svc.Name, svc.Spec.ClusterIP, s.proto, tb.Pod(1).IPv4, tb.Pod(2).IPv4, testbed.EchoPort)
	}

	// Pod 3 is the client: not an endpoint, so the endpoints see its own address.
	client := tb.Pod(3).NS
	endpoints := map[string]int{}
	for i, svc := range svcs {
		addr := testbed.ClusterAddr(svc, 80)
		proto := svc.Spec.Ports[0].Protocol
		dial := func() (testbed.Answer, error) {
			if proto == corev1.ProtocolUDP {
				return tb.DialUDP(client, addr, 2*time.Second, 0)
			}
			return tb.DialTCP(client, addr, 2*time.Second)
		}
		if err := testbed.Poll(20*time.Second, 100*time.Millisecond, func() error { _, err := dial(); return err }); err != nil {
			return 1, fmt.Errorf("%s never answered: %w", addr, err)
		}
		n := 10
		if i > 0 {
			n = 4
		}
		fmt.Printf("\nrequests from pod 3 (%s) to %s/%s:\n", tb.Pod(3).IPv4, addr, proto)
		// 10 (4 for UDP), and more, up to 30, if only one endpoint answered so far
		for j := 0; j < n || (i == 0 && len(endpoints) < 2 && j < 30); j++ {
			a, err := dial()
			if err != nil {
				fmt.Printf("  #%-2d error: %v\n", j+1, err)
				continue
			}
			fmt.Printf("  #%-2d answered by endpoint %-12s which saw the request come from %s\n", j+1, a.Endpoint, a.SeenSource)
			if i == 0 {
				endpoints[a.Endpoint]++
			}
		}
	}

	fmt.Printf("\nkpipe's rules for these services (iptables-save -t nat in %s):\n", tb.NodeNS)
	nat, err := tb.Exec(tb.NodeNS, "iptables-save", "-t", "nat")
	if err != nil {
		return 1, err
	}
	for _, l := range strings.Split(nat, "\n") {
		if strings.Contains(l, ns+"/") {
			fmt.Println("  " + l)
		}
	}

	if len(endpoints) < 2 {
		return 1, fmt.Errorf("only %d distinct endpoint(s) answered through the TCP ClusterIP: %v", len(endpoints), endpoints)
	}
	fmt.Printf("\n%d different endpoints answered through one ClusterIP: %v\n", len(endpoints), endpoints)
	return explainOne(tb, k, svcs[0])
}

// explainOne asks the node about pod 3's request to the TCP service, as an
// operator would: kpipe status, kpipe render --diff (nothing: the node holds
// what kpipe would write), and last kpipe explain, which must name both
// endpoints that answered.
func explainOne(tb *testbed.Testbed, k *testbed.Kpipe, svc *corev1.Service) (int, error) {
	status, err := ask(tb, k, "status")
	if err != nil {
		return 1, err
	}
	if !strings.Contains(status, "healthy") {
		return 1, fmt.Errorf("kpipe status does not say the node is healthy")
	}
	diff, err := ask(tb, k, append([]string{"render", "--diff"}, k.Args...)...)
	if err != nil {
		return 1, err
	}
	if diff != "" {
		return 1, fmt.Errorf("kpipe render --diff found differences on a synced node")
	}
	fmt.Println("  (nothing: the node holds exactly what kpipe would write; exit code 0)")
	out, err := ask(tb, k, "explain", "--from", "pod", "--src", tb.Pod(3).IPv4, "--dst", testbed.ClusterAddr(svc, 80))
	if err != nil {
		return 1, err
	}
	for _, pod := range []int{1, 2} {
		if ep := tb.Pod(pod).Addr4(testbed.EchoPort); !strings.Contains(out, ep) {
			return 1, fmt.Errorf("kpipe explain does not name endpoint %s", ep)
		}
	}
	return 0, nil
}

// ask runs kpipe args in the node and prints the command and its output.
func ask(tb *testbed.Testbed, k *testbed.Kpipe, args ...string) (string, error) {
	shown := args
	if args[0] == "render" {
		shown = append(args[:2:2], "<the daemon's flags>")
	}
	fmt.Printf("\n$ kpipe %s   (in %s)\n", strings.Join(shown, " "), tb.NodeNS)
	out, err := tb.Exec(tb.NodeNS, append([]string{k.Bin}, args...)...)
	fmt.Print(out)
	return out, err
}
