package bus_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

func TestPlanTableFindsTheTableByName(t *testing.T) {
	p := &bus.Plan{Tables: []bus.TablePayload{{Table: "nat", RuleCount: 1}, {Table: "filter", RuleCount: 2}}}
	if tp := p.Table("filter"); tp == nil || tp.RuleCount != 2 {
		t.Fatalf("Table(filter) = %+v; want the filter payload", tp)
	}
	if tp := p.Table("nat"); tp == nil || tp.RuleCount != 1 {
		t.Fatalf("Table(nat) = %+v; want the nat payload", tp)
	}
	// The plan's own payload, not a copy: a change through it is the plan's.
	p.Table("nat").Dropped = []string{"KUBE-SVC-X"}
	if len(p.Tables[0].Dropped) != 1 {
		t.Error("Table returned a copy of the payload")
	}
	if tp := p.Table("mangle"); tp != nil {
		t.Errorf("Table(mangle) = %+v; want nil", tp)
	}
}

func TestNoLocalPlusAndMinus(t *testing.T) {
	a, b := bus.NoLocal{Internal: 3, External: 5}, bus.NoLocal{Internal: 1, External: 2}
	if got, want := a.Plus(b), (bus.NoLocal{Internal: 4, External: 7}); got != want {
		t.Errorf("%v.Plus(%v) = %v; want %v", a, b, got, want)
	}
	if got, want := a.Minus(b), (bus.NoLocal{Internal: 2, External: 3}); got != want {
		t.Errorf("%v.Minus(%v) = %v; want %v", a, b, got, want)
	}
}

// TestNamesOfIsSortedAndBounded: a set of names is told in order, at most
// bus.MaxNames of them, with how many there are.
func TestNamesOfIsSortedAndBounded(t *testing.T) {
	if got := bus.NamesOf(map[string]bool{"ns/b:http": true, "ns/a:dns": true}); !slices.Equal(got.First, []string{"ns/a:dns", "ns/b:http"}) || got.Total != 2 {
		t.Errorf("NamesOf two names = %+v, want them sorted, total 2", got)
	}
	set := map[string]bool{}
	for i := range bus.MaxNames + 50 {
		set[fmt.Sprintf("ns/svc-%04d:http", i)] = true
	}
	got := bus.NamesOf(set)
	if len(got.First) != bus.MaxNames || got.First[0] != "ns/svc-0000:http" || got.First[bus.MaxNames-1] != fmt.Sprintf("ns/svc-%04d:http", bus.MaxNames-1) || got.Total != bus.MaxNames+50 {
		t.Errorf("NamesOf %d names = %d first (%s..%s), total %d; want the first %d in order, total %d",
			len(set), len(got.First), got.First[0], got.First[len(got.First)-1], got.Total, bus.MaxNames, len(set))
	}
}
