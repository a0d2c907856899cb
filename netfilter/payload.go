package netfilter

import (
	"bytes"

	"github.com/kpipe/kpipe/bus"
)

// Assemble turns a table payload into iptables-restore input. Chains in the
// payload's Delete list and in extraDeletes are declared (which empties them) and
// then removed; with --noflush nothing else in the table is touched.
func Assemble(tp bus.TablePayload, extraDeletes []string) []byte {
	var b bytes.Buffer
	b.Grow(len(tp.Rules) + 64*(len(tp.Declare)+len(tp.Delete)+len(extraDeletes)) + 32)
	b.WriteString("*" + tp.Table + "\n")
	deletes := append(append([]string{}, tp.Delete...), extraDeletes...)
	for _, chains := range [][]string{tp.Declare, deletes} {
		for _, c := range chains {
			b.WriteString(":" + c + " - [0:0]\n")
		}
	}
	b.Write(tp.Rules)
	for _, c := range deletes {
		b.WriteString("-X " + c + "\n")
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}
