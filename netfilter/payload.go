package netfilter

import (
	"bytes"

	"github.com/kpipe/kpipe/bus"
)

// Assemble turns chains to rewrite and chains to delete into iptables-restore
// input for table. With --noflush nothing else in the table is touched.
func Assemble(table string, chains []bus.Chain, deletes []string) []byte {
	size := 32
	for _, c := range chains {
		size += len(c.Rules) + len(c.Name) + 16
	}
	var b bytes.Buffer
	b.Grow(size + 64*len(deletes))
	b.WriteString("*" + table + "\n")
	for _, c := range chains {
		b.WriteString(":" + c.Name + " - [0:0]\n")
	}
	// A deleted chain is declared first (emptying it), so -X finds it empty.
	for _, c := range deletes {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	for _, c := range chains {
		b.WriteString(c.Rules)
	}
	for _, c := range deletes {
		b.WriteString("-X " + c + "\n")
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}
