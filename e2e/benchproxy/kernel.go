package main

import (
	"context"
	"crypto/sha256"
	"encoding/base32"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/e2e/testbed"
	"github.com/kpipe/kpipe/netfilter"
)

// kernel reads what a proxy wrote in its node namespace: the endpoint
// addresses a service's own chain sends to, from the kernel (nf_tables
// netlink, nft or iptables-save listing the chain), never from the proxy.
type kernel struct {
	tb   *testbed.Testbed
	node *testbed.FreshNode
	nft  bool // kube-proxy's nftables mode (table ip kube-proxy); else iptables' nat table
}

var (
	// "-A KUBE-SVC-X ... --comment "ns/svc:http -> 10.244.1.2:8080" ...": the
	// endpoint rules of a service chain, kpipe's and kube-proxy's alike.
	iptablesEndpoint = regexp.MustCompile(`-> (\d+\.\d+\.\d+\.\d+):\d+`)
	// "-A KUBE-SVC-X ... -j KUBE-SEP-Y": over 1,000 endpoints kube-proxy
	// leaves the comments out of its service chains (its "large cluster
	// mode"), so their jumps name endpoint chains only. (The bench's services
	// have no session affinity: a service chain names an endpoint chain only
	// in its jump to it.)
	endpointJump = regexp.MustCompile(netfilter.PrefixEndpoint + `[A-Z2-7]{16}`)
	// "... -j DNAT --to-destination 10.244.1.2:8080": kpipe's endpoint rules
	// over 1,000 endpoints, which leave their comments out as kube-proxy's do
	// (iptables-save's text; netlinkChain writes a DNAT target so too).
	dnatEndpoint = regexp.MustCompile(`--to-destination (\d+\.\d+\.\d+\.\d+):\d+`)
	// "... vmap { 0 : goto endpoint-HASH-ns/svc/tcp/http__10.244.1.2/8080, ...}".
	nftEndpoint = regexp.MustCompile(`__(\d+\.\d+\.\d+\.\d+)/\d+`)
)

// port is s's service port as the proxies name its chains after it.
func port(s *benchService) bus.ServicePortName {
	return bus.ServicePortName{ServiceKey: bus.ServiceKey{Namespace: benchNamespace, Name: s.svc.Name}, Port: portName, Protocol: bus.TCP}
}

// chain names the chain of s's port as the proxy names it.
func (k kernel) chain(s *benchService) string {
	if k.nft {
		name := fmt.Sprintf("%s/%s/tcp/%s", benchNamespace, s.svc.Name, portName)
		sum := sha256.Sum256([]byte(name))
		return "service-" + base32.StdEncoding.EncodeToString(sum[:])[:8] + "-" + name
	}
	return netfilter.ServiceChain(netfilter.PrefixService, port(s))
}

// endpoints are the addresses s's chain sends to now, sorted (see addresses;
// want is what s's endpoints are); none when the chain does not exist (yet).
// The iptables modes' chain is read over nf_tables netlink (a fraction of a
// millisecond); nftables mode's with nft.
func (k kernel) endpoints(s *benchService, want []string) []string {
	var (
		text string
		err  error
	)
	if k.nft {
		text, err = k.node.Exec("nft", "list", "chain", "ip", "kube-proxy", k.chain(s))
	} else {
		text, err = k.netlinkChain(k.chain(s))
	}
	if err != nil {
		return nil
	}
	return k.addresses(s, want, text)
}

// netlinkChain reads a nat chain from the node's kernel over nf_tables
// netlink (see matchesAndVerdicts).
func (k kernel) netlinkChain(chain string) (string, error) {
	var rules [][]string
	err := k.tb.InNamespace(k.node.NS, func() (err error) {
		rules, err = netfilter.Tool{Family: bus.IPv4}.ChainExpressions(context.Background(), netfilter.TableNAT, chain)
		return err
	})
	return matchesAndVerdicts(rules), err
}

// matchesAndVerdicts is the data of the rules' matches and verdicts
// (ChainExpressions' listing), one a line, raw: their endpoint comments and
// the chain names they jump to read as in iptables-save's text; a DNAT
// target is written as iptables-save writes it.
func matchesAndVerdicts(rules [][]string) string {
	var b strings.Builder
	for _, r := range rules {
		for _, e := range r {
			name, data, _ := strings.Cut(e, " ")
			raw, _ := hex.DecodeString(data)
			switch name {
			case "match", "immediate":
				b.Write(raw)
			case "target":
				if to, ok := dnatDestination(raw); ok {
					b.WriteString("--to-destination " + to.String())
				}
			}
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// dnatDestination is the address an IPv4 DNAT target's data sends to: its
// attributes (NFTA_TARGET_NAME 1, NFTA_TARGET_INFO 3) and, in the info, the
// nf_nat_range2 (flags, min_addr, max_addr, min_proto, ...) iptables-nft writes.
func dnatDestination(data []byte) (netip.AddrPort, bool) {
	var name string
	var info []byte
	for len(data) >= 4 {
		n, typ := int(binary.LittleEndian.Uint16(data)), binary.LittleEndian.Uint16(data[2:])&0x3fff
		if n < 4 || n > len(data) {
			break
		}
		switch typ {
		case 1:
			name = strings.TrimRight(string(data[4:n]), "\x00")
		case 3:
			info = data[4:n]
		}
		data = data[min(len(data), (n+3)&^3):]
	}
	if name != "DNAT" || len(info) < 4+16+16+2 {
		return netip.AddrPort{}, false
	}
	addr, _ := netip.AddrFromSlice(info[4:8])
	return netip.AddrPortFrom(addr, binary.BigEndian.Uint16(info[36:38])), true
}

// addresses are the endpoints a chain's text sends to, sorted: those its
// comments name, else (iptables modes) those it DNATs to and those of the
// KUBE-SEP- chains it jumps to (see jumpedTo).
func (k kernel) addresses(s *benchService, want []string, text string) []string {
	re := iptablesEndpoint
	if k.nft {
		re = nftEndpoint
	}
	var ips []string
	for _, m := range re.FindAllStringSubmatch(text, -1) {
		ips = append(ips, m[1])
	}
	if len(ips) == 0 && !k.nft {
		for _, m := range dnatEndpoint.FindAllStringSubmatch(text, -1) {
			ips = append(ips, m[1])
		}
		ips = append(ips, jumpedTo(s, want, text)...)
	}
	slices.Sort(ips)
	return ips
}

// jumpedTo are the endpoints of the KUBE-SEP- chains a chain's text jumps to,
// known by their names: a KUBE-SEP- chain's name is a hash of its endpoint
// (netfilter.EndpointName, as kube-proxy names them). A jump to the chain of
// none of want (s's endpoints) shows as that chain's name.
func jumpedTo(s *benchService, want []string, text string) []string {
	jumps := endpointJump.FindAllString(text, -1)
	if len(jumps) == 0 {
		return nil
	}
	byChain := make(map[string]string, len(want))
	for _, ip := range want {
		byChain[netfilter.EndpointName(port(s), net.JoinHostPort(ip, strconv.Itoa(testbed.EchoPort)))] = ip
	}
	for i, c := range jumps {
		if ip, ok := byChain[c]; ok {
			jumps[i] = ip
		}
	}
	return jumps
}

// settle waits, after a change of an isolated series (its API write began at
// began), until the proxy has finished the sync that carried it: its IPv4
// last-sync gauge (kube-proxy's, which kpipe keeps too) passed began. Only
// the pacing comes from the proxy, no figure. A change can show in the kernel
// before the proxy is done with it (kpipe deletes a gone endpoint's rule
// first and rebalances the rest in a second write), and a change made in
// between would wait for that write and be timed with it. A proxy whose
// gauge does not move is waited for settleLimit at most.
func (k kernel) settle(began time.Time) {
	for end := time.Now().Add(settleLimit); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		m, err := k.tb.ScrapeMetrics(k.node.NS, testbed.MetricsURL+"/metrics")
		if err != nil {
			continue
		}
		last := testbed.Sum(m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", map[string]string{"ip_family": "IPv4"})
		if last >= float64(began.UnixNano())/1e9 {
			return
		}
	}
	logf("the proxy reported no sync %v after a change made at %s; going on", settleLimit, began.Format(time.TimeOnly))
}

// settleLimit bounds settle's wait.
const settleLimit = 10 * time.Second

// waitFor polls s's chain until the kernel holds s as the API says now (see
// holds) and returns when it saw that.
func (k kernel) waitFor(s *benchService, timeout time.Duration, alive func() error, dispatch bool) (time.Time, error) {
	want := s.want()
	deadline := time.Now().Add(timeout)
	for {
		ok, got := k.holds(s, want, dispatch)
		seen := time.Now()
		if ok {
			return seen, nil
		}
		if err := alive(); err != nil {
			return seen, err
		}
		if seen.After(deadline) {
			return seen, fmt.Errorf("%s: chain %s %s, not %v after %v", s.svc.Name, k.chain(s), got, want, timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// holds reports whether s's chain sends to exactly want, and what it does
// when not. With dispatch, the chain must also be reached (see reached),
// and a deleted service (want nil) is gone once its chain is not, whatever
// the chain still holds.
func (k kernel) holds(s *benchService, want []string, dispatch bool) (bool, string) {
	if dispatch {
		reached, err := k.reached(s)
		switch {
		case err != nil:
			return false, err.Error()
		case want == nil:
			return !reached, "is still reached"
		case !reached:
			return false, "is not reached"
		}
	}
	got := k.endpoints(s, want)
	return slices.Equal(got, want), fmt.Sprintf("sends to %v", got)
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
	for _, s := range svcs {
		want := s.want()
		if got := k.addresses(s, want, chains[k.chain(s)]); !slices.Equal(got, want) {
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
