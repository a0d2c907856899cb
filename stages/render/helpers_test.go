package render

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
)

var update = flag.Bool("update", false, "rewrite the golden files")

const testNode = "node-a"

func ip(s string) netip.Addr       { return netip.MustParseAddr(s) }
func prefix(s string) netip.Prefix { return netip.MustParsePrefix(s) }

func baseConfig() Config {
	return Config{Family: bus.IPv4, NodeName: testNode, MasqueradeBit: 14, DetectLocal: DetectClusterCIDR,
		ClusterCIDRs: []netip.Prefix{prefix("10.244.0.0/16")}, LocalhostNodePorts: true,
		NFAcct: NFAcctObjects{InvalidDropped: true, LocalhostNodePorts: true}}
}

// svc makes a ClusterIP service with the given ports ("name/PROTO/port[/nodePort]").
func svc(ns, name, clusterIP string, ports ...bus.Port) *bus.Service {
	return &bus.Service{ServiceKey: bus.ServiceKey{Namespace: ns, Name: name}, ClusterIPs: []netip.Addr{ip(clusterIP)}, Ports: ports}
}

func port(name string, proto bus.Protocol, p int32) bus.Port {
	return bus.Port{Name: name, Protocol: proto, Port: p}
}

// ep is a ready endpoint on node.
func ep(addr, node string) bus.Endpoint {
	return bus.Endpoint{Addr: ip(addr), Ready: true, Serving: true, NodeName: node}
}

func slice(s *bus.Service, name string, ports []bus.EndpointPort, eps ...bus.Endpoint) *bus.EndpointSlice {
	fam := bus.IPv4
	if len(eps) > 0 {
		fam = bus.FamilyOf(eps[0].Addr)
	}
	return &bus.EndpointSlice{Service: s.ServiceKey, Name: name, Family: fam, Ports: ports, Items: eps}
}

func eport(name string, proto bus.Protocol, p int32) bus.EndpointPort {
	return bus.EndpointPort{Name: name, Protocol: proto, Port: p}
}

// state builds a snapshot state from services and slices.
func state(node *bus.Node, items ...any) bus.State {
	st := bus.State{Services: map[bus.ServiceKey]*bus.Service{}, Slices: map[bus.ServiceKey]map[string]*bus.EndpointSlice{}, Node: node}
	for _, it := range items {
		switch v := it.(type) {
		case *bus.Service:
			st.Services[v.ServiceKey] = v
		case *bus.EndpointSlice:
			if st.Slices[v.Service] == nil {
				st.Slices[v.Service] = map[string]*bus.EndpointSlice{}
			}
			st.Slices[v.Service][v.Name] = v
		}
	}
	return st
}

func node() *bus.Node {
	return &bus.Node{Name: testNode, Addrs: []netip.Addr{ip("192.168.1.10")}, PodCIDRs: []netip.Prefix{prefix("10.244.1.0/24")}, Zone: "zone-a"}
}

// payload is the iptables-restore input commit would write for the plan.
func payload(p *bus.Plan) string {
	var b strings.Builder
	for _, tp := range p.Tables {
		if len(tp.Chains) == 0 {
			continue
		}
		b.Write(nf.Assemble(tp.Table, tp.Chains, nil))
	}
	return b.String()
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read golden file (run go test ./stages/render -update to create it): %v", err)
	}
	if string(want) != got {
		t.Errorf("payload differs from %s (go test ./stages/render -update rewrites it):\n%s", path, diff(string(want), got))
	}
}

func diff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	for i := 0; i < max(len(w), len(g)); i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			b.WriteString("- " + wl + "\n+ " + gl + "\n")
		}
	}
	return b.String()
}

var jumpTarget = regexp.MustCompile(`-j (KUBE-[A-Z0-9-]+)`)

// checkConsistent asserts a full plan only jumps to chains it declares and that the
// masquerade machinery is there: what iptables-restore would reject or what would
// leave traffic unSNATed.
func checkConsistent(t *testing.T, p *bus.Plan) {
	t.Helper()
	for _, tp := range p.Tables {
		declared := map[string]bool{}
		var rules strings.Builder
		for _, c := range tp.Chains {
			declared[c.Name] = true
			rules.WriteString(c.Rules)
		}
		for _, line := range strings.Split(rules.String(), "\n") {
			if line == "" {
				continue
			}
			fields := strings.Fields(line)
			if len(fields) < 2 || fields[0] != "-A" {
				t.Fatalf("%s: rule line %q is not an -A rule", tp.Table, line)
			}
			if p.Full && !declared[fields[1]] {
				t.Errorf("%s: rule for undeclared chain %s", tp.Table, fields[1])
			}
			for _, m := range jumpTarget.FindAllStringSubmatch(line, -1) {
				if p.Full && !declared[m[1]] {
					t.Errorf("%s: %q jumps to undeclared chain %s", tp.Table, line, m[1])
				}
			}
		}
	}
}

// natRules splits a plan's nat rules by chain.
func natRules(p *bus.Plan) map[string][]string {
	out := map[string][]string{}
	for _, c := range tableOf(p, nf.TableNAT).Chains {
		for _, line := range strings.Split(strings.TrimSuffix(string(c.Rules), "\n"), "\n") {
			if line != "" {
				out[c.Name] = append(out[c.Name], line)
			}
		}
	}
	return out
}

// walk counts the nat rules a new TCP connection to dst evaluates from
// KUBE-SERVICES until a rule sends it to a service's own chain; ok is false when
// none does. It follows the -d, -p and --dport matches and the jumps to bucket
// chains; a rule with any other match does not match.
func walk(rules map[string][]string, dst netip.AddrPort) (n int, ok bool) {
	var visit func(chain string) bool
	visit = func(chain string) bool {
		for _, line := range rules[chain] {
			n++
			target, matches := ruleMatches(line, dst)
			if !matches {
				continue
			}
			if !strings.HasPrefix(target, nf.PrefixBucket) {
				return true
			}
			if visit(target) {
				return true
			}
		}
		return false
	}
	return n, visit(nf.ChainServices)
}

func ruleMatches(line string, dst netip.AddrPort) (target string, ok bool) {
	f := strings.Fields(line)
	for i := 2; i < len(f); i++ {
		switch f[i] {
		case "-m":
			switch f[i+1] {
			case "comment":
				i += 3 // to the first word of the quoted comment, then to its last
				for !strings.HasSuffix(f[i], `"`) {
					i++
				}
				continue
			case "tcp":
				i++
				continue
			}
			return "", false
		case "-p":
			if f[i+1] != "tcp" {
				return "", false
			}
			i++
		case "-d":
			if !netip.MustParsePrefix(f[i+1]).Contains(dst.Addr()) {
				return "", false
			}
			i++
		case "--dport":
			if f[i+1] != strconv.Itoa(int(dst.Port())) {
				return "", false
			}
			i++
		case "-j":
			return f[i+1], true
		default:
			return "", false
		}
	}
	return "", false
}
