package nftables

import (
	"context"
	"os/exec"
	"slices"
	"strings"
	"testing"

	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// The renderer's objects, written by the netlink writer, are what nft makes
// of the renderer's own dump: upstream's six services (TestOverallNFTablesRules)
// and the IPv6 golden's, written by NFTTransaction into one namespace and by
// `nft -f` of Dump() into another, list the same, line for line. (Rules are
// left out of both: the writer does not write rules yet.)
func TestRenderedObjectsWrittenAsNFTLoadsThem(t *testing.T) {
	netnstest.RequireRoot(t)
	if _, err := exec.LookPath("nft"); err != nil {
		netnstest.Unavailable(t, "needs the nft binary (apt-get install nftables)")
	}
	for name, table := range map[string]*Table{"ip": overallTable(), "ip6": ipv6Table()} {
		t.Run(name, func(t *testing.T) {
			writer, loader := netnstest.New(t), netnstest.New(t)
			x := nf.NewNFTTransaction(table.NFTTable())
			if err := table.AddObjects(x); err != nil {
				t.Fatal(err)
			}
			writer.Run(t, func() error { return x.Commit(context.Background()) })
			var script strings.Builder
			for _, l := range strings.SplitAfter(table.Dump(), "\n") {
				if !strings.HasPrefix(l, "add rule ") {
					script.WriteString(l)
				}
			}
			if out, err := loader.Output(t, script.String(), "nft", "-f", "-"); err != nil {
				t.Fatalf("nft -f of the dump: %v: %s", err, out)
			}
			family := nf.NFTFamily(table.Family)
			got, err := writer.Output(t, "", "nft", "list", "table", family, TableName)
			if err != nil {
				t.Fatal(err, got)
			}
			want, err := loader.Output(t, "", "nft", "list", "table", family, TableName)
			if err != nil {
				t.Fatal(err, want)
			}
			// The kernel lists objects in the order they were made: the
			// writer makes them in a fresh node's order, nft -f in the dump's.
			if g, w := objectsOf(got), objectsOf(want); !slices.Equal(g, w) {
				t.Fatalf("written by NFTTransaction:\n%s\nloaded by nft -f:\n%s", got, want)
			}
			if !strings.Contains(got, "goto service-") || !strings.Contains(got, "elements = {") {
				t.Fatalf("the listing has no elements going to service chains:\n%s", got)
			}
		})
	}
}

// objectsOf splits an `nft list table` listing into its table's objects (each
// set, map and chain with its lines), sorted: the listing without the order in
// which they were made.
func objectsOf(listing string) []string {
	var objects []string
	var cur strings.Builder
	for _, l := range strings.Split(listing, "\n") {
		switch {
		case strings.HasPrefix(l, "\tset ") || strings.HasPrefix(l, "\tmap ") || strings.HasPrefix(l, "\tchain "):
			cur.Reset()
			cur.WriteString(l + "\n")
		case cur.Len() > 0 && l == "\t}":
			objects = append(objects, cur.String()+l)
			cur.Reset()
		case cur.Len() > 0:
			cur.WriteString(l + "\n")
		case l != "" && l != "}":
			objects = append(objects, l) // the table's own lines
		}
	}
	slices.Sort(objects)
	return objects
}
