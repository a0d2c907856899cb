package e2e

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/e2e/testbed"
	nf "github.com/kpipe/kpipe/netfilter"
)

// Every request the feature tests assert (expectExactly and the negative
// helpers) is also put to `kpipe explain`, run in the node on its live rules:
// what explain predicts must be what the packets did. explained and
// unexplained count them for the run's summary; on a node that kube-proxy's
// nftables mode serves, explain must refuse (it reads iptables rules only),
// and those are unexplained.
var explained, unexplained atomic.Int64

// explainedAs is the part of `kpipe explain --json` these checks read.
type explainedAs struct {
	Verdict string            `json:"verdict"`
	Paths   []explainedPathAs `json:"paths"`
}

type explainedPathAs struct {
	Endpoint    string `json:"endpoint"`
	Masqueraded bool   `json:"masqueraded"`
	Verdict     string `json:"verdict"`
	Delivered   string `json:"delivered"`
}

// What the requests did, as the helpers saw it.
const (
	sawAnswered   = "answered"
	sawRefused    = "refused"
	sawDropped    = "dropped"
	sawUnanswered = "unanswered"
)

// observed is what a series of requests did.
type observed struct {
	saw string
	dst netip.Addr
	// answered: the endpoints that answered, and the sources they saw
	// (nil: not checked) and the client's own source address.
	answerers, sources []string
	client             netip.Addr
}

// explainAgrees puts the request d makes from ns to addr to `kpipe explain`
// and fails the test unless its prediction is what obs saw.
func explainAgrees(t *testing.T, what string, d dialer, ns, addr string, obs observed) {
	t.Helper()
	args, client, ok := explainArgs(d, ns, addr)
	if !ok {
		unexplained.Add(1)
		return
	}
	out, err := tb.Exec(tb.NodeNS, append([]string{tb.Kpipe().Bin, "explain", "--json"}, args...)...)
	if _, nftMode := tb.Exec(tb.NodeNS, "nft", "list", "table", nf.NFTFamily(bus.FamilyOf(netip.MustParseAddrPort(addr).Addr().Unmap())), nf.NFTablesTable); nftMode == nil {
		// kube-proxy's nftables mode serves the node: explain must refuse.
		if err == nil {
			t.Fatalf("%s: kpipe explain %s answered on a node served by kube-proxy's nftables mode:\n%s", what, strings.Join(args, " "), out)
		}
		unexplained.Add(1)
		return
	}
	if err != nil {
		t.Fatalf("%s: kpipe explain %s: %v", what, strings.Join(args, " "), err)
	}
	var e explainedAs
	if err := json.Unmarshal([]byte(out), &e); err != nil {
		t.Fatalf("%s: kpipe explain %s: %v in %q", what, strings.Join(args, " "), err, out)
	}
	obs.client = client
	obs.dst = netip.MustParseAddrPort(addr).Addr().Unmap()
	if err := e.disagrees(obs); err != nil {
		text, _ := tb.Exec(tb.NodeNS, append([]string{tb.Kpipe().Bin, "explain"}, args...)...)
		t.Fatalf("%s: kpipe explain %s predicts what the packets did not: %v\n%s", what, strings.Join(args, " "), err, text)
	}
	explained.Add(1)
}

// explainArgs are explain's flags for the request d makes from ns to addr,
// and its source; not ok when the request cannot be described (a fake
// dialer, a namespace whose role explain does not know).
func explainArgs(d dialer, ns, addr string) (args []string, src netip.Addr, ok bool) {
	if d.proto == "" {
		return nil, src, false
	}
	dst, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, src, false
	}
	v6 := dst.Addr().Is6() && !dst.Addr().Is4In6()
	pick := func(v4, v6addr string) string {
		if v6 {
			return v6addr
		}
		return v4
	}
	from, source := "", d.src
	switch {
	case ns == tb.NodeNS:
		from = "node"
	case ns == tb.ClientNS:
		from, source = "outside", cmp.Or(source, pick(testbed.ClientIPv4, testbed.ClientIPv6))
	default:
		for _, p := range tb.Pods {
			if p.NS == ns {
				from, source = "pod", cmp.Or(source, pick(p.IPv4, p.IPv6))
			}
		}
	}
	if from == "" {
		return nil, src, false
	}
	args = []string{"--proto", d.proto, "--dst", addr, "--from", from}
	if source != "" {
		args = append(args, "--src", source)
		src = netip.MustParseAddr(source)
	}
	return args, src, true
}

// disagrees says how the prediction differs from what the requests did.
func (e explainedAs) disagrees(obs observed) error {
	var predicted []string // the addresses that may answer
	masq := map[bool]int{}
	for _, p := range e.Paths {
		switch {
		case p.Verdict != "ACCEPT":
		case p.Endpoint != "":
			ip, _, _ := net.SplitHostPort(p.Endpoint)
			predicted = append(predicted, ip)
			masq[p.Masqueraded]++
		default: // not DNATed: on to the destination as it is
			predicted = append(predicted, obs.dst.String())
			masq[p.Masqueraded]++
		}
	}
	sort.Strings(predicted)
	predicted = slices.Compact(predicted)
	switch obs.saw {
	case sawAnswered:
		want := slices.Sorted(slices.Values(obs.answerers))
		if !slices.Equal(predicted, want) {
			return fmt.Errorf("answered by %v; explain predicts %v (verdict %s)", want, predicted, e.Verdict)
		}
		if e.Verdict != "ACCEPT" {
			return fmt.Errorf("every request was answered; explain predicts verdict %s on some path", e.Verdict)
		}
		if len(obs.sources) == 0 || !obs.client.IsValid() {
			return nil
		}
		kept := slices.Contains(obs.sources, obs.client.String())
		switch {
		case kept && len(obs.sources) == 1 && masq[true] > 0:
			return fmt.Errorf("the endpoints saw the client's own source %s; explain predicts masquerading", obs.client)
		case !kept && masq[false] > 0:
			return fmt.Errorf("the endpoints saw only %v, never the client's %s; explain predicts the source kept", obs.sources, obs.client)
		}
	case sawRefused:
		if e.Verdict != "REJECT" && !(e.Verdict == "ACCEPT" && len(predicted) == 1 && predicted[0] == obs.dst.String()) {
			return fmt.Errorf("refused; explain predicts verdict %s, endpoints %v (want REJECT, or delivered as it is to a port nothing listens on)", e.Verdict, predicted)
		}
	case sawDropped:
		// Dropped by a rule, or left alone and routed on to an address
		// nothing answers for.
		routedOn := e.Verdict == "ACCEPT" && !slices.ContainsFunc(e.Paths, func(p explainedPathAs) bool {
			return p.Endpoint != "" || p.Delivered != "routed on"
		})
		if e.Verdict != "DROP" && !routedOn {
			return fmt.Errorf("dropped (no answer, no refusal); explain predicts verdict %s, endpoints %v", e.Verdict, predicted)
		}
	case sawUnanswered:
		if slices.ContainsFunc(e.Paths, func(p explainedPathAs) bool {
			return p.Verdict == "ACCEPT" && p.Endpoint != ""
		}) {
			return fmt.Errorf("never answered; explain predicts DNAT to %v", predicted)
		}
	}
	return nil
}

// The check itself must be able to fail: a prediction that differs from
// what was seen, in each way, is caught.
func TestExplainCheckCatchesAWrongPrediction(t *testing.T) {
	var twoEndpoints explainedAs
	if err := json.Unmarshal([]byte(`{"verdict":"ACCEPT","paths":[
		{"endpoint":"10.244.0.11:8080","masqueraded":false,"verdict":"ACCEPT","probability":0.5},
		{"endpoint":"10.244.0.12:8080","masqueraded":false,"verdict":"ACCEPT","probability":0.5}]}`), &twoEndpoints); err != nil {
		t.Fatal(err)
	}
	client, dst := netip.MustParseAddr("10.244.0.21"), netip.MustParseAddr("10.96.0.10")
	right := observed{saw: sawAnswered, dst: dst, client: client, answerers: []string{"10.244.0.12", "10.244.0.11"}, sources: []string{"10.244.0.21"}}
	if err := twoEndpoints.disagrees(right); err != nil {
		t.Fatalf("a right prediction: %v", err)
	}
	for name, obs := range map[string]observed{
		"one endpoint fewer": {saw: sawAnswered, dst: dst, answerers: []string{"10.244.0.11"}},
		"masqueraded":        {saw: sawAnswered, dst: dst, client: client, answerers: right.answerers, sources: []string{"10.244.0.1"}},
		"refused":            {saw: sawRefused, dst: dst},
		"dropped":            {saw: sawDropped, dst: dst},
		"unanswered":         {saw: sawUnanswered, dst: dst},
	} {
		if err := twoEndpoints.disagrees(obs); err == nil {
			t.Errorf("%s: not caught", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
}
