package bus_test

import (
	"net/netip"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

// goneFrontEnd is the i-th distinct UDP front-end of a test: 10.96.x.y:53.
func goneFrontEnd(i int) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}), 53)
}

// TestMergeStaleFlowsBoundsGone: while conntrack cannot take them, commits' gone
// front-ends fold into one value that keeps at most bus.MaxGone of them, the most
// recently gone; one that went away again is as new as its last going, and one
// that came back is not gone.
func TestMergeStaleFlowsBoundsGone(t *testing.T) {
	const perCommit = 100
	commits := bus.MaxGone/perCommit + 50           // 5000 front-ends more than the bound
	back := goneFrontEnd(perCommit*(commits-1) - 1) // gone in the commit before last, back in the last
	again := goneFrontEnd(0)                        // gone in the first commit and again in the last

	m := bus.NewMergingMailbox(bus.MergeStaleFlows)
	for c := 0; c < commits; c++ {
		v := bus.StaleFlows{Family: bus.IPv4, Now: map[netip.AddrPort][]netip.AddrPort{}, Gone: map[netip.AddrPort]bool{}}
		for i := c * perCommit; i < (c+1)*perCommit; i++ {
			v.Gone[goneFrontEnd(i)] = true
		}
		if c == commits-1 {
			v.Now[back] = nil
			v.Gone[again] = true
		}
		m.Put(v)
	}
	got, _ := m.TryTake()

	if len(got.Gone) != bus.MaxGone {
		t.Fatalf("after %d front-ends went away, Gone holds %d; want the bound, %d", commits*perCommit, len(got.Gone), bus.MaxGone)
	}
	if got.Gone[back] {
		t.Errorf("%v is gone; want it not: it came back in the last commit", back)
	}
	if !got.Gone[again] {
		t.Errorf("%v is not gone; want it kept: it went away again in the last commit", again)
	}
	// The newest: all of the last commits' front-ends but the one back, then as many
	// of the earlier ones, newest first, as the bound has room for after again.
	newest := bus.MaxGone - 1 // room left by again
	kept := 0
	for i := commits*perCommit - 1; i >= 0 && kept < newest; i-- {
		if fe := goneFrontEnd(i); fe != back && fe != again {
			if !got.Gone[fe] {
				t.Fatalf("front-end %d of %d (%v) was forgotten; want the newest %d kept", i, commits*perCommit, fe, bus.MaxGone)
			}
			kept++
		}
	}
	// Every going (again's two) that is neither back nor kept was forgotten once.
	if want := commits*perCommit + 1 - 1 - bus.MaxGone; got.Forgotten != want {
		t.Errorf("Forgotten = %d; want %d", got.Forgotten, want)
	}
}
