package netfilter_test

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// The proof of the object writer: kube-proxy's table (docs/kube-proxy-nftables-v1.34.md,
// sections 1, 2 and 4), written by NFTTransaction into one fresh network
// namespace and by `nft -f` of the same objects as "add" commands into another,
// must list the same with `nft list table`, line for line.

// nftFamily is one family's addresses for kube-proxy's table.
type nftFamily struct {
	family                                    bus.Family
	nft, addrType                             string // "ip", "ipv4_addr"
	clusterIP, clusterIP2, nodeIP, externalIP string
	lbIP                                      string
}

var nftFamilies = []nftFamily{
	{bus.IPv4, "ip", "ipv4_addr", "172.30.0.41", "172.30.0.46", "192.168.0.2", "192.168.99.22", "1.2.3.4"},
	{bus.IPv6, "ip6", "ipv6_addr", "fd00:172:30::41", "fd00:172:30::46", "fd00:192:168::2", "fd00:192:168:99::22", "2001:db8::1:2:3:4"},
}

// Names of kube-proxy's per-service chains and affinity set, from the fact sheet.
const (
	svcChain      = "service-ULMVA6XW-ns1/svc1/tcp/p80"
	extChain      = "external-ULMVA6XW-ns1/svc1/tcp/p80"
	fwChain       = "firewall-ULMVA6XW-ns1/svc1/tcp/p80"
	epChain       = "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
	affinitySet   = "affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80"
	rejectComment = "helper for @no-endpoint-services / @no-endpoint-nodeports"
)

// kubeProxyChains are the base chains of section 2 (in its order, priorities as
// knftables writes them) and some regular ones.
var kubeProxyChains = []nf.NFTChain{
	{Name: "filter-prerouting-pre-dnat", Type: "filter", Hook: "prerouting", Priority: -110},
	{Name: "filter-output-pre-dnat", Type: "filter", Hook: "output", Priority: -110},
	{Name: "filter-input", Type: "filter", Hook: "input", Priority: 0},
	{Name: "filter-forward", Type: "filter", Hook: "forward", Priority: 0},
	{Name: "filter-output", Type: "filter", Hook: "output", Priority: 0},
	{Name: "nat-prerouting", Type: "nat", Hook: "prerouting", Priority: -100},
	{Name: "nat-output", Type: "nat", Hook: "output", Priority: -100},
	{Name: "nat-postrouting", Type: "nat", Hook: "postrouting", Priority: 100},
	{Name: "services"},
	{Name: "mark-for-masquerade"},
	{Name: "reject-chain", Comment: rejectComment},
	{Name: epChain},
	{Name: svcChain},
	{Name: extChain},
	{Name: fwChain},
}

// kubeProxyChainsNFT is kubeProxyChains as nft commands.
const kubeProxyChainsNFT = `
add chain FAM kube-proxy filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }
add chain FAM kube-proxy filter-output-pre-dnat { type filter hook output priority -110 ; }
add chain FAM kube-proxy filter-input { type filter hook input priority 0 ; }
add chain FAM kube-proxy filter-forward { type filter hook forward priority 0 ; }
add chain FAM kube-proxy filter-output { type filter hook output priority 0 ; }
add chain FAM kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
add chain FAM kube-proxy nat-output { type nat hook output priority -100 ; }
add chain FAM kube-proxy nat-postrouting { type nat hook postrouting priority 100 ; }
add chain FAM kube-proxy services
add chain FAM kube-proxy mark-for-masquerade
add chain FAM kube-proxy reject-chain { comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }
add chain FAM kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80
add chain FAM kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80
add chain FAM kube-proxy external-ULMVA6XW-ns1/svc1/tcp/p80
add chain FAM kube-proxy firewall-ULMVA6XW-ns1/svc1/tcp/p80
`

// sets are section 4's sets and maps, in a fresh node's order, and an
// affinity set.
func (f nftFamily) sets() []nf.NFTSet {
	a := f.addrType
	return []nf.NFTSet{
		{Name: "cluster-ips", Type: a, Comment: "Active ClusterIPs"},
		{Name: "nodeport-ips", Type: a, Comment: "IPs that accept NodePort traffic"},
		{Name: "no-endpoint-services", Type: a + " . inet_proto . inet_service : verdict", Comment: "vmap to drop or reject packets to services with no endpoints"},
		{Name: "no-endpoint-nodeports", Type: "inet_proto . inet_service : verdict", Comment: "vmap to drop or reject packets to service nodeports with no endpoints"},
		{Name: "firewall-ips", Type: a + " . inet_proto . inet_service : verdict", Comment: "destinations that are subject to LoadBalancerSourceRanges"},
		{Name: "service-ips", Type: a + " . inet_proto . inet_service : verdict", Comment: "ClusterIP, ExternalIP and LoadBalancer IP traffic"},
		{Name: "service-nodeports", Type: "inet_proto . inet_service : verdict", Comment: "NodePort traffic"},
		{Name: affinitySet, Type: a, Dynamic: true, Timeout: 3 * time.Hour},
	}
}

const kubeProxySetsNFT = `
add set FAM kube-proxy cluster-ips { type ADDR ; comment "Active ClusterIPs" ; }
add set FAM kube-proxy nodeport-ips { type ADDR ; comment "IPs that accept NodePort traffic" ; }
add map FAM kube-proxy no-endpoint-services { type ADDR . inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to services with no endpoints" ; }
add map FAM kube-proxy no-endpoint-nodeports { type inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }
add map FAM kube-proxy firewall-ips { type ADDR . inet_proto . inet_service : verdict ; comment "destinations that are subject to LoadBalancerSourceRanges" ; }
add map FAM kube-proxy service-ips { type ADDR . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }
add map FAM kube-proxy service-nodeports { type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }
add set FAM kube-proxy affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { type ADDR ; flags dynamic,timeout ; timeout 10800s ; }
`

// elements are, by set, elements of each kind: addresses, concatenations
// with goto and drop verdicts, with and without comments.
func (f nftFamily) elements() map[string][]nf.NFTElement {
	return map[string][]nf.NFTElement{
		"cluster-ips":  {{Key: []string{f.clusterIP}}, {Key: []string{f.clusterIP2}}},
		"nodeport-ips": {{Key: []string{f.nodeIP}}},
		"no-endpoint-services": {
			{Key: []string{f.clusterIP2, "tcp", "80"}, Value: "goto reject-chain", Comment: "ns6/svc6:p80"},
			{Key: []string{f.externalIP, "udp", "53"}, Value: "drop", Comment: "ns7/svc7"},
		},
		"no-endpoint-nodeports": {
			{Key: []string{"tcp", "3001"}, Value: "drop", Comment: "ns2/svc2:p80"},
			{Key: []string{"sctp", "3002"}, Value: "goto reject-chain", Comment: "ns6/svc6:p80"},
		},
		"firewall-ips": {{Key: []string{f.lbIP, "tcp", "80"}, Value: "goto " + fwChain}},
		"service-ips": {
			{Key: []string{f.clusterIP, "tcp", "80"}, Value: "goto " + svcChain},
			{Key: []string{f.externalIP, "tcp", "80"}, Value: "goto " + extChain},
			{Key: []string{f.lbIP, "tcp", "80"}, Value: "goto " + extChain},
			{Key: []string{f.clusterIP, "udp", "256"}, Value: "goto " + svcChain},
		},
		"service-nodeports": {{Key: []string{"tcp", "3001"}, Value: "goto " + extChain}},
	}
}

const kubeProxyElementsNFT = `
add element FAM kube-proxy cluster-ips { CIP, CIP2 }
add element FAM kube-proxy nodeport-ips { NODEIP }
add element FAM kube-proxy no-endpoint-services { CIP2 . tcp . 80 comment "ns6/svc6:p80" : goto reject-chain , EIP . udp . 53 comment "ns7/svc7" : drop }
add element FAM kube-proxy no-endpoint-nodeports { tcp . 3001 comment "ns2/svc2:p80" : drop , sctp . 3002 comment "ns6/svc6:p80" : goto reject-chain }
add element FAM kube-proxy firewall-ips { LBIP . tcp . 80 : goto firewall-ULMVA6XW-ns1/svc1/tcp/p80 }
add element FAM kube-proxy service-ips { CIP . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 , EIP . tcp . 80 : goto external-ULMVA6XW-ns1/svc1/tcp/p80 , LBIP . tcp . 80 : goto external-ULMVA6XW-ns1/svc1/tcp/p80 , CIP . udp . 256 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }
add element FAM kube-proxy service-nodeports { tcp . 3001 : goto external-ULMVA6XW-ns1/svc1/tcp/p80 }
`

// script fills in the family's words and addresses in nft commands.
func (f nftFamily) script(commands string) string {
	return strings.NewReplacer("FAM", f.nft, "ADDR", f.addrType, "CIP2", f.clusterIP2, "CIP", f.clusterIP,
		"NODEIP", f.nodeIP, "EIP", f.externalIP, "LBIP", f.lbIP).Replace(commands)
}

func (f nftFamily) table() nf.NFTTable {
	return nf.NFTTable{Family: f.family, Name: "kube-proxy", Comment: "rules for kube-proxy"}
}

func (f nftFamily) set(name string) nf.NFTSet {
	for _, s := range f.sets() {
		if s.Name == name {
			return s
		}
	}
	panic("no set " + name)
}

// writeKubeProxyTable writes the whole table in one transaction.
func (f nftFamily) writeKubeProxyTable(t *testing.T, ns *netnstest.Namespace) {
	t.Helper()
	x := nf.NewNFTTransaction(f.table())
	must(t, x.AddTable())
	for _, c := range kubeProxyChains {
		must(t, x.AddChain(c))
	}
	elems := f.elements()
	for _, s := range f.sets() {
		must(t, x.AddSet(s))
	}
	for _, s := range f.sets() {
		must(t, x.AddElements(s, elems[s.Name]))
	}
	commit(t, ns, x)
}

const kubeProxyTableNFT = `add table FAM kube-proxy { comment "rules for kube-proxy" ; }` + kubeProxyChainsNFT + kubeProxySetsNFT + kubeProxyElementsNFT

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func commit(t *testing.T, ns *netnstest.Namespace, x *nf.NFTTransaction) {
	t.Helper()
	ns.Run(t, func() error { return x.Commit(context.Background()) })
}

// nftBed is two fresh namespaces: one written by NFTTransaction, one by nft -f.
func nftBed(t *testing.T) (writer, nft *netnstest.Namespace) {
	t.Helper()
	netnstest.RequireRoot(t)
	if _, err := exec.LookPath("nft"); err != nil {
		netnstest.Unavailable(t, "needs the nft binary (apt-get install nftables)")
	}
	return netnstest.New(t), netnstest.New(t)
}

// runNFT runs nft in ns with args, script on its standard input.
func runNFT(t *testing.T, ns *netnstest.Namespace, script string, args ...string) (out string, err error) {
	t.Helper()
	return ns.Output(t, script, "nft", args...)
}

func loadNFT(t *testing.T, ns *netnstest.Namespace, script string) {
	t.Helper()
	if out, err := runNFT(t, ns, script, "-f", "-"); err != nil {
		t.Fatalf("nft -f: %v: %s\n%s", err, out, script)
	}
}

func listTable(t *testing.T, ns *netnstest.Namespace, f nftFamily) string {
	t.Helper()
	out, err := runNFT(t, ns, "", "list", "table", f.nft, "kube-proxy")
	if err != nil {
		t.Fatalf("nft list table %s kube-proxy: %v: %s", f.nft, err, out)
	}
	return out
}

// requireSameListing compares the two namespaces' listings line by line.
func requireSameListing(t *testing.T, f nftFamily, writer, nft *netnstest.Namespace) string {
	t.Helper()
	got, want := listTable(t, writer, f), listTable(t, nft, f)
	gotLines, wantLines := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := range max(len(gotLines), len(wantLines)) {
		g, w := lineAt(gotLines, i), lineAt(wantLines, i)
		if g != w {
			t.Fatalf("line %d: the writer's table has\n\t%q\nnft -f's has\n\t%q\nwriter's listing:\n%s\nnft -f's listing:\n%s", i+1, g, w, got, want)
		}
	}
	return got
}

func lineAt(lines []string, i int) string {
	if i < len(lines) {
		return lines[i]
	}
	return "(none)"
}

// forEachFamilyWritten runs test, for each family, on a bed with kube-proxy's
// table written by NFTTransaction into one namespace and by nft -f into the other.
func forEachFamilyWritten(t *testing.T, test func(t *testing.T, f nftFamily, writer, nft *netnstest.Namespace)) {
	for _, f := range nftFamilies {
		t.Run(f.nft, func(t *testing.T) {
			writer, nft := nftBed(t)
			f.writeKubeProxyTable(t, writer)
			loadNFT(t, nft, f.script(kubeProxyTableNFT))
			test(t, f, writer, nft)
		})
	}
}

// TestNFTObjectsListAsNFTWrites: kube-proxy's table with its base chains,
// regular chains, sets, verdict maps and an affinity set, with elements of
// each kind, written in one transaction, lists as nft lists it when nft -f
// wrote it; each writes over the other's objects, changing nothing.
func TestNFTObjectsListAsNFTWrites(t *testing.T) {
	forEachFamilyWritten(t, func(t *testing.T, f nftFamily, writer, nft *netnstest.Namespace) {
		listing := requireSameListing(t, f, writer, nft)
		for _, want := range []string{
			"comment \"rules for kube-proxy\"",
			"type nat hook postrouting priority srcnat; policy accept;",
			"type " + f.addrType + " . inet_proto . inet_service : verdict",
			"flags dynamic,timeout\n\t\ttimeout 3h",
			f.clusterIP2 + " . tcp . 80 comment \"ns6/svc6:p80\" : goto reject-chain",
			"tcp . 3001 : goto " + extChain,
			"comment \"" + rejectComment + "\"",
		} {
			if !strings.Contains(listing, want) {
				t.Errorf("the listing has no %q:\n%s", want, listing)
			}
		}

		// A full sync adds everything again, and kube-proxy (through nft)
		// may take over a table kpipe wrote, or the other way round: the
		// kernel takes each add over the other's objects as the same objects.
		f.writeKubeProxyTable(t, nft)
		loadNFT(t, writer, f.script(kubeProxyTableNFT))
		if again := requireSameListing(t, f, writer, nft); again != listing {
			t.Fatalf("written again, the table lists\n%s\nnot as before\n%s", again, listing)
		}
	})
}

// TestNFTObjectsDelete: elements deleted, a chain flushed and deleted (with
// the map elements that went to it, in the same transaction), a map flushed
// and a set deleted, then the table deleted: each as nft does it.
func TestNFTObjectsDelete(t *testing.T) {
	forEachFamilyWritten(t, func(t *testing.T, f nftFamily, writer, nft *netnstest.Namespace) {
		x := nf.NewNFTTransaction(f.table())
		must(t, x.DeleteElements(f.set("firewall-ips"), []nf.NFTElement{{Key: []string{f.lbIP, "tcp", "80"}, Value: "goto " + fwChain}}))
		must(t, x.DeleteElements(f.set("service-ips"), []nf.NFTElement{{Key: []string{f.externalIP, "tcp", "80"}}, {Key: []string{f.clusterIP, "udp", "256"}}}))
		must(t, x.DeleteElements(f.set("cluster-ips"), []nf.NFTElement{{Key: []string{f.clusterIP2}}}))
		x.FlushChain(fwChain)
		x.DeleteChain(fwChain)
		x.FlushSet("no-endpoint-nodeports")
		x.DeleteSet(affinitySet)
		commit(t, writer, x)
		loadNFT(t, nft, f.script(`
delete element FAM kube-proxy firewall-ips { LBIP . tcp . 80 }
delete element FAM kube-proxy service-ips { EIP . tcp . 80, CIP . udp . 256 }
delete element FAM kube-proxy cluster-ips { CIP2 }
flush chain FAM kube-proxy firewall-ULMVA6XW-ns1/svc1/tcp/p80
delete chain FAM kube-proxy firewall-ULMVA6XW-ns1/svc1/tcp/p80
flush map FAM kube-proxy no-endpoint-nodeports
delete set FAM kube-proxy affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80
`))
		listing := requireSameListing(t, f, writer, nft)
		for _, gone := range []string{fwChain, affinitySet, f.externalIP + " . tcp . 80", "tcp . 3001 comment"} {
			if strings.Contains(listing, gone) {
				t.Errorf("%q is still there:\n%s", gone, listing)
			}
		}
		if !strings.Contains(listing, f.clusterIP+" . tcp . 80 : goto "+svcChain) {
			t.Errorf("an element not deleted is gone:\n%s", listing)
		}

		x = nf.NewNFTTransaction(f.table())
		x.DeleteTable()
		commit(t, writer, x)
		if out, err := runNFT(t, writer, "", "list", "tables"); err != nil || out != "" {
			t.Fatalf("after the table's delete, nft list tables: %v: %q", err, out)
		}
	})
}

// TestNFTTransactionAllOrNone: a transaction the kernel refuses a message of
// (an element going to a chain that is not there) changes nothing, and the
// error names what was refused.
func TestNFTTransactionAllOrNone(t *testing.T) {
	f := nftFamilies[0]
	writer, _ := nftBed(t)
	x := nf.NewNFTTransaction(f.table())
	must(t, x.AddTable())
	must(t, x.AddChain(nf.NFTChain{Name: "services"}))
	must(t, x.AddSet(f.set("service-ips")))
	must(t, x.AddElements(f.set("service-ips"), []nf.NFTElement{{Key: []string{f.clusterIP, "tcp", "80"}, Value: "goto no-such-chain"}}))
	var err error
	writer.Run(t, func() error { err = x.Commit(context.Background()); return nil })
	if err == nil || !strings.Contains(err.Error(), "add elements to service-ips") {
		t.Fatalf("Commit: %v, want the refusal of the element", err)
	}
	if out, err := runNFT(t, writer, "", "list", "tables"); err != nil || out != "" {
		t.Fatalf("after a refused transaction, nft list tables: %v: %q", err, out)
	}
}

// TestNFTElementsPastOneMessage: more elements than one netlink message holds
// (an attribute's length is 16 bits) are all written.
func TestNFTElementsPastOneMessage(t *testing.T) {
	f := nftFamilies[0]
	writer, _ := nftBed(t)
	const n = 10000
	elems := make([]nf.NFTElement, n)
	for i := range elems {
		elems[i] = nf.NFTElement{Key: []string{fmt.Sprintf("10.%d.%d.1", i/256, i%256), "tcp", "80"}, Value: "drop", Comment: "ns/svc:p80"}
	}
	x := nf.NewNFTTransaction(f.table())
	must(t, x.AddTable())
	must(t, x.AddSet(f.set("service-ips")))
	must(t, x.AddElements(f.set("service-ips"), elems))
	if x.Len() < 4 { // the table, the map and two messages of elements at least
		t.Fatalf("%d messages for %d elements of about 64 bytes each", x.Len(), n)
	}
	commit(t, writer, x)
	out, err := runNFT(t, writer, "", "list", "map", "ip", "kube-proxy", "service-ips")
	if err != nil {
		t.Fatalf("nft list map: %v: %s", err, out)
	}
	if got := strings.Count(out, ` . tcp . 80 comment "ns/svc:p80" : drop`); got != n {
		t.Fatalf("%d elements listed, want %d", got, n)
	}
	for _, want := range []string{"10.0.0.1 . tcp", "10.39.15.1 . tcp"} {
		if !strings.Contains(out, want) {
			t.Errorf("no element %q listed", want)
		}
	}
}

// TestNFTObjectsRefusedBeforeWriting: objects nft would refuse to parse are
// refused when added, before anything is sent.
func TestNFTObjectsRefusedBeforeWriting(t *testing.T) {
	x := nf.NewNFTTransaction(nftFamilies[0].table())
	svcIPs := nftFamilies[0].set("service-ips")
	for name, err := range map[string]error{
		"hook without type":     x.AddChain(nf.NFTChain{Name: "c", Hook: "input"}),
		"unknown hook":          x.AddChain(nf.NFTChain{Name: "c", Type: "filter", Hook: "ingress"}),
		"unknown chain type":    x.AddChain(nf.NFTChain{Name: "c", Type: "route", Hook: "output"}),
		"unknown key type":      x.AddSet(nf.NFTSet{Name: "s", Type: "ether_addr"}),
		"non-verdict map":       x.AddSet(nf.NFTSet{Name: "s", Type: "ipv4_addr : ipv4_addr"}),
		"comment too long":      x.AddSet(nf.NFTSet{Name: "s", Type: "ipv4_addr", Comment: strings.Repeat("x", 129)}),
		"IPv6 in an IPv4 key":   x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"fd00::1", "tcp", "80"}, Value: "drop"}}),
		"too few fields":        x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"10.0.0.1", "tcp"}, Value: "drop"}}),
		"port out of range":     x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"10.0.0.1", "tcp", "65536"}, Value: "drop"}}),
		"unknown protocol":      x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"10.0.0.1", "tcpx", "80"}, Value: "drop"}}),
		"no verdict in a map":   x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"10.0.0.1", "tcp", "80"}}}),
		"goto without chain":    x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"10.0.0.1", "tcp", "80"}, Value: "goto"}}),
		"value in a set":        x.AddElements(nf.NFTSet{Name: "s", Type: "ipv4_addr"}, []nf.NFTElement{{Key: []string{"10.0.0.1"}, Value: "drop"}}),
		"unknown verdict":       x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"10.0.0.1", "tcp", "80"}, Value: "reject"}}),
		"one bad of many elems": x.AddElements(svcIPs, []nf.NFTElement{{Key: []string{"10.0.0.1", "tcp", "80"}, Value: "drop"}, {Key: []string{"10.0.0.1", "tcp", "x"}, Value: "drop"}}),
	} {
		if err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if x.Len() != 0 {
		t.Errorf("%d messages written for refused objects", x.Len())
	}
}
