package main

import (
	"context"
	"crypto/sha256"
	"encoding/base32"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/e2e/testbed"
	"github.com/kpipe/kpipe/netfilter"
)

// kernel reads what a proxy wrote in its node namespace: the endpoint
// addresses a service's own chain sends to, from the kernel (iptables or nft
// listing the chain), never from the proxy.
type kernel struct {
	tb   *testbed.Testbed
	node *testbed.FreshNode
	nft  bool // kube-proxy's nftables mode (table ip kube-proxy); else iptables' nat table
	// seps maps kube-proxy's KUBE-SEP- chains to the endpoint they DNAT to. Over
	// 1,000 endpoints kube-proxy leaves the comments out of its service chains
	// (its "large cluster mode"), so their jumps name endpoint chains only. A
	// KUBE-SEP- chain's name is a hash of its endpoint: listed once, known.
	seps map[string]string
}

func newKernel(tb *testbed.Testbed, node *testbed.FreshNode, nft bool) kernel {
	return kernel{tb: tb, node: node, nft: nft, seps: map[string]string{}}
}

var (
	// "-A KUBE-SVC-X ... --comment "ns/svc:http -> 10.244.1.2:8080" ...": the
	// endpoint rules of a service chain, kpipe's and kube-proxy's alike.
	iptablesEndpoint = regexp.MustCompile(`-> (\d+\.\d+\.\d+\.\d+):\d+`)
	// "-A KUBE-SVC-X ... -j KUBE-SEP-Y" without a comment, and KUBE-SEP-Y's
	// "-j DNAT --to-destination 10.244.1.2:8080".
	sepJump = regexp.MustCompile(`-j (KUBE-SEP-[A-Z0-9]+)`)
	dnatTo  = regexp.MustCompile(`--to-destination (\d+\.\d+\.\d+\.\d+):\d+`)
	// "... vmap { 0 : goto endpoint-HASH-ns/svc/tcp/http__10.244.1.2/8080, ...}".
	nftEndpoint = regexp.MustCompile(`__(\d+\.\d+\.\d+\.\d+)/\d+`)
)

// chain names the chain of s's port as the proxy names it.
func (k kernel) chain(s *benchService) string {
	if k.nft {
		name := fmt.Sprintf("%s/%s/tcp/%s", benchNamespace, s.svc.Name, portName)
		sum := sha256.Sum256([]byte(name))
		return "service-" + base32.StdEncoding.EncodeToString(sum[:])[:8] + "-" + name
	}
	return netfilter.ServiceChain(netfilter.PrefixService, bus.ServicePortName{
		ServiceKey: bus.ServiceKey{Namespace: benchNamespace, Name: s.svc.Name}, Port: portName, Protocol: bus.TCP})
}

// endpoints are the addresses s's chain sends to now, sorted; none when the
// chain does not exist (yet). The iptables modes' chain is read over nf_tables
// netlink (a fraction of a millisecond); nftables mode's with nft.
func (k kernel) endpoints(s *benchService) []string {
	if !k.nft {
		return k.netlinkEndpoints(k.chain(s))
	}
	out, err := k.node.Exec("nft", "list", "chain", "ip", "kube-proxy", k.chain(s))
	if err != nil {
		return nil
	}
	return k.addresses(out, nil)
}

// netlinkEndpoints reads an iptables service chain from the kernel: the
// endpoints its comments name ("-> 10.244.1.2:8080"), else those of the
// KUBE-SEP- chains it jumps to (their DNAT target's address).
func (k kernel) netlinkEndpoints(chain string) []string {
	rules := k.readChain(chain)
	var ips []string
	for _, r := range rules {
		for _, e := range r {
			if m := iptablesEndpoint.FindStringSubmatch(string(e.data)); e.name == "match" && m != nil {
				ips = append(ips, m[1])
			}
		}
	}
	if len(ips) == 0 {
		for _, r := range rules {
			for _, e := range r {
				sep := sepName.Find(e.data)
				if e.name != "immediate" || sep == nil {
					continue
				}
				ip, ok := k.seps[string(sep)]
				if !ok {
					if ip, ok = k.dnatOf(string(sep)); ok {
						k.seps[string(sep)] = ip
					}
				}
				if ok {
					ips = append(ips, ip)
				}
			}
		}
	}
	slices.Sort(ips)
	return ips
}

var sepName = regexp.MustCompile(`KUBE-SEP-[A-Z0-9]+`)

// expr is one nf_tables expression of a rule: its name, and its data.
type expr struct {
	name string
	data []byte
}

// readChain lists a nat chain's rules from the node's kernel; none when it
// does not exist.
func (k kernel) readChain(chain string) [][]expr {
	var listed [][]string
	err := k.tb.InNamespace(k.node.NS, func() (err error) {
		listed, err = netfilter.Tool{Family: bus.IPv4}.ChainExpressions(context.Background(), netfilter.TableNAT, chain)
		return err
	})
	if err != nil {
		return nil
	}
	out := make([][]expr, len(listed))
	for i, r := range listed {
		for _, e := range r {
			name, data, _ := strings.Cut(e, " ")
			b, _ := hex.DecodeString(data)
			out[i] = append(out[i], expr{name, b})
		}
	}
	return out
}

// dnatOf is the address a KUBE-SEP- chain's DNAT target sends to: the
// min_addr of its struct nf_nat_range2 (after a 4-byte flags field).
func (k kernel) dnatOf(chain string) (string, bool) {
	for _, r := range k.readChain(chain) {
		for _, e := range r {
			if e.name != "target" {
				continue
			}
			var name string
			var info []byte
			for b := e.data; len(b) >= 4; {
				size := int(binary.NativeEndian.Uint16(b))
				if size < 4 || size > len(b) {
					break
				}
				switch binary.NativeEndian.Uint16(b[2:]) & 0x3fff {
				case 1: // NFTA_TARGET_NAME
					name = strings.TrimRight(string(b[4:size]), "\x00")
				case 3: // NFTA_TARGET_INFO
					info = b[4:size]
				}
				b = b[min(len(b), (size+3)&^3):]
			}
			if name == "DNAT" && len(info) >= 8 {
				return netip.AddrFrom4([4]byte(info[4:8])).String(), true
			}
		}
	}
	return "", false
}

// addresses are the endpoints a service chain's text sends to, sorted;
// sepText gives a KUBE-SEP- chain's text when the service chain names only
// endpoint chains.
func (k kernel) addresses(text string, sepText func(chain string) string) []string {
	re := iptablesEndpoint
	if k.nft {
		re = nftEndpoint
	}
	var ips []string
	for _, m := range re.FindAllStringSubmatch(text, -1) {
		ips = append(ips, m[1])
	}
	if len(ips) == 0 && !k.nft && sepText != nil {
		for _, m := range sepJump.FindAllStringSubmatch(text, -1) {
			ip, ok := k.seps[m[1]]
			if !ok {
				if d := dnatTo.FindStringSubmatch(sepText(m[1])); d != nil {
					ip, ok = d[1], true
					k.seps[m[1]] = ip
				}
			}
			if ok {
				ips = append(ips, ip)
			}
		}
	}
	slices.Sort(ips)
	return ips
}

// waitFor polls s's chain until it sends to exactly s's endpoints now and
// returns when it saw that.
func (k kernel) waitFor(s *benchService, timeout time.Duration, alive func() error) (time.Time, error) {
	want := s.want()
	deadline := time.Now().Add(timeout)
	for {
		got := k.endpoints(s)
		seen := time.Now()
		if slices.Equal(got, want) {
			return seen, nil
		}
		if err := alive(); err != nil {
			return seen, err
		}
		if seen.After(deadline) {
			return seen, fmt.Errorf("%s: chain %s sends to %v, not %v after %v", s.svc.Name, k.chain(s), got, want, timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// mismatches dumps the whole ruleset once and counts the services whose
// chain does not send to exactly their endpoints; example describes one.
func (k kernel) mismatches(svcs []*benchService) (n int, example string, err error) {
	var out string
	if k.nft {
		out, err = k.node.Exec("nft", "list", "table", "ip", "kube-proxy")
	} else {
		out, err = k.node.Exec("iptables-save", "-t", "nat")
	}
	if err != nil {
		return 0, "", err
	}
	chains := k.chainTexts(out)
	sepText := func(chain string) string { return chains[chain] }
	for _, s := range svcs {
		want := s.want()
		if got := k.addresses(chains[k.chain(s)], sepText); !slices.Equal(got, want) {
			if n == 0 {
				example = fmt.Sprintf("%s: chain %s sends to %v, not %v", s.svc.Name, k.chain(s), got, want)
			}
			n++
		}
	}
	return n, example, nil
}

// chainTexts splits a dump into each chain's text.
func (k kernel) chainTexts(dump string) map[string]string {
	texts := map[string]*strings.Builder{}
	add := func(chain, line string) {
		b := texts[chain]
		if b == nil {
			b = &strings.Builder{}
			texts[chain] = b
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	current := ""
	for _, line := range strings.Split(dump, "\n") {
		line = strings.TrimSpace(line)
		if k.nft {
			if name, ok := strings.CutPrefix(line, "chain "); ok {
				current = strings.TrimSuffix(name, " {")
			} else if current != "" {
				add(current, line)
			}
			continue
		}
		if rest, ok := strings.CutPrefix(line, "-A "); ok {
			chain, _, _ := strings.Cut(rest, " ")
			add(chain, line)
		}
	}
	out := make(map[string]string, len(texts))
	for c, b := range texts {
		out[c] = b.String()
	}
	return out
}

// waitAll waits until every service's chain sends to exactly its endpoints,
// dumping the ruleset again and again, and returns when a dump showed it.
func (k kernel) waitAll(svcs []*benchService, timeout time.Duration, alive func() error) (time.Time, error) {
	deadline := time.Now().Add(timeout)
	for {
		n, example, err := k.mismatches(svcs)
		seen := time.Now()
		if err == nil && n == 0 {
			return seen, nil
		}
		if aerr := alive(); aerr != nil {
			return seen, aerr
		}
		if seen.After(deadline) {
			if err != nil {
				return seen, err
			}
			return seen, fmt.Errorf("%d of %d services not as in the API after %v, e.g. %s", n, len(svcs), timeout, example)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
