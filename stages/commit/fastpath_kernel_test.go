package commit

import (
	"context"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"testing"

	"github.com/kpipe/kpipe/bus"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/netfilter/netnstest"
)

// deleteWatcher is the real kernel, with a look at it each time a delete-only
// transaction landed.
type deleteWatcher struct {
	nf.Tool
	landed func() error
	err    error
	count  int
}

func (d *deleteWatcher) DeleteRules(ctx context.Context, table string, rules []nf.RuleRef) error {
	err := d.Tool.DeleteRules(ctx, table, rules)
	if err == nil {
		d.count++
		if lerr := d.landed(); lerr != nil && d.err == nil {
			d.err = lerr
		}
	}
	return err
}

// kernelTables reads kpipe's chains of nat and filter back with iptables-save.
func kernelTables(ctx context.Context, tool nf.Tool) (map[string]map[string][]string, error) {
	out := map[string]map[string][]string{}
	for _, table := range []string{nf.TableNAT, nf.TableFilter} {
		saved, err := tool.Save(ctx, table)
		if err != nil {
			return nil, err
		}
		maps.DeleteFunc(saved, func(chain string, _ []string) bool { return nf.KindOf(chain) == nf.KindOther })
		for _, rules := range saved {
			for i, r := range rules {
				rules[i] = asWritten(r)
			}
		}
		out[table] = saved
	}
	return out, nil
}

// setXMark is how iptables-save prints every MARK target: --set-xmark value/mask.
var setXMark = regexp.MustCompile(`--set-xmark (0x[0-9a-f]+)/(0x[0-9a-f]+)`)

// asWritten is a rule iptables-save printed as kpipe writes it: its MARK
// targets as --or-mark (value and mask the same) or --xor-mark (no mask).
func asWritten(rule string) string {
	return setXMark.ReplaceAllStringFunc(rule, func(m string) string {
		v := setXMark.FindStringSubmatch(m)
		switch {
		case v[1] == v[2]:
			return "--or-mark " + v[1]
		case v[2] == "0x0":
			return "--xor-mark " + v[1]
		}
		return m
	})
}

// requireKernelIsThePlan checks that the kernel holds exactly plan's chains of
// kpipe's, each with the digest its rules give.
func requireKernelIsThePlan(ctx context.Context, tool nf.Tool, plan *bus.Plan) error {
	for _, tp := range plan.Tables {
		kernel, err := tool.Digests(ctx, tp.Table, nil)
		if err != nil {
			return err
		}
		maps.DeleteFunc(kernel, func(chain string, _ uint64) bool { return nf.KindOf(chain) == nf.KindOther })
		if got, want := slices.Sorted(maps.Keys(kernel)), slices.Sorted(maps.Keys(planned(tp))); !slices.Equal(got, want) {
			return fmt.Errorf("%s: the kernel has chains %v, the plan %v", tp.Table, got, want)
		}
		for _, c := range tp.Chains {
			if want, _ := tool.ExpectedDigest(ctx, tp.Table, c.Rules); kernel[c.Name] != want {
				return fmt.Errorf("%s %s: not as a fresh render has it", tp.Table, c.Name)
			}
		}
	}
	return nil
}

// TestFastPathInTheKernel: in a real kernel, endpoints removed from some
// services, a service deleted and one added. Right after the delete-only
// transaction, the kernel's rules, read back with iptables-save and traced,
// send no packet of a churned service un-DNATed or to an endpoint that went,
// and none where neither the old nor the new rules would; after the walked
// write the kernel holds what a fresh render has.
func TestFastPathInTheKernel(t *testing.T) {
	requireNFTables(t)
	base := churnState(30)
	next := with(withoutEndpoint(base, 1, "svc1", "svc2", "svc3"), []int{200}, []string{"svc4"}, "")
	last := withoutEndpoint(withoutEndpoint(withoutEndpoint(next, 3, "svc5"), -1, "svc6"), 1, "svc7")
	netnstest.New(t).Run(t, func() error {
		ctx := context.Background()
		tool := nf.Tool{Family: bus.IPv4}
		kernel := &deleteWatcher{Tool: tool}
		s := testStage(kernel)
		applied(t, s, planOf(base, 1, true))
		for i, step := range []struct {
			before, after bus.State
			gone          map[string]bool
		}{
			{base, next, map[string]bool{"svc1": true, "svc2": true, "svc3": true, "svc4": true}},
			{next, last, map[string]bool{"svc7": true}},
		} {
			before, after := planOf(step.before, uint64(i+1), true), planOf(step.after, uint64(i+2), false)
			kernel.landed = func() error {
				tables, err := kernelTables(ctx, tool)
				if err == nil {
					requireNoNewOutcome(t, tablesPlan(tables), before, after, servicesOf(step.before, step.after), step.gone)
				}
				return err
			}
			applied(t, s, after)
			if kernel.err != nil {
				return kernel.err
			}
			if kernel.count != i+1 {
				return fmt.Errorf("step %d: %d delete-only transactions in all; want %d", i+1, kernel.count, i+1)
			}
			if err := requireKernelIsThePlan(ctx, tool, after); err != nil {
				return fmt.Errorf("step %d, after the walked write: %w", i+1, err)
			}
		}
		return nil
	})
}
