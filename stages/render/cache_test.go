package render

import (
	"fmt"
	"hash/fnv"
	"maps"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"testing"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

// TestRendererCacheMatchesFreshRender drives a Renderer through random changes the
// way coalesce makes them (a changed object is a new value) and checks that every
// plan equals what a fresh Render of the same snapshot gives.
func TestRendererCacheMatchesFreshRender(t *testing.T) {
	rnd := rand.New(rand.NewPCG(1, 2))
	cfg := baseConfig()
	st := rendertest.SyntheticState(40, 3)
	st.Node = node()
	rr := NewRenderer(cfg)
	var last *bus.Plan
	for step := range 300 {
		was := st
		st = mutate(rnd, st, step)
		snap := &bus.Snapshot{Generation: uint64(step), State: st, Full: step%50 == 0}
		got, want := rr.Render(snap), Render(cfg, snap)
		if last != nil {
			checkDropped(t, step, last, got, sameNode(was.Node, st.Node))
		}
		last = got
		if g, w := payload(got), payload(want); g != w {
			t.Fatalf("step %d: cached render differs from a fresh one:\n%s", step, diff(w, g))
		}
		if !maps.Equal(chainHashes(got), chainHashes(want)) {
			t.Fatalf("step %d: chain hashes differ", step)
		}
		if !maps.EqualFunc(got.UDP, want.UDP, slices.Equal) || !maps.Equal(got.HealthChecks.Services, want.HealthChecks.Services) ||
			got.NoLocalEndpoints != want.NoLocalEndpoints || !reflect.DeepEqual(got.Unserved, want.Unserved) {
			t.Fatalf("step %d: cached render's UDP front-ends, health checks, counts or unserved ports differ from a fresh one:\n%v %v %v %v\n%v %v %v %v", step,
				got.UDP, got.HealthChecks.Services, got.NoLocalEndpoints, got.Unserved, want.UDP, want.HealthChecks.Services, want.NoLocalEndpoints, want.Unserved)
		}
		for i := range got.Tables {
			if got.Tables[i].RuleCount != want.Tables[i].RuleCount {
				t.Fatalf("step %d: %s rule count %d, fresh %d", step, got.Tables[i].Table, got.Tables[i].RuleCount, want.Tables[i].RuleCount)
			}
		}
	}
}

// checkDropped: each table's Dropped are chains of the last plan that this
// one does not have, and all of them unless the renderer started over (a node
// that shapes every rule changed).
func checkDropped(t *testing.T, step int, last, now *bus.Plan, complete bool) {
	t.Helper()
	for i, tp := range now.Tables {
		names := func(tp bus.TablePayload) map[string]bool {
			m := map[string]bool{}
			for _, c := range tp.Chains {
				m[c.Name] = true
			}
			return m
		}
		before, after := names(last.Tables[i]), names(tp)
		var want []string
		for name := range before {
			if !after[name] {
				want = append(want, name)
			}
		}
		slices.Sort(want)
		for _, d := range tp.Dropped {
			if !before[d] || after[d] {
				t.Fatalf("step %d: %s Dropped names %s: in the last plan %v, in this one %v", step, tp.Table, d, before[d], after[d])
			}
		}
		if complete && !slices.Equal(tp.Dropped, want) {
			t.Fatalf("step %d: %s Dropped %v, want %v", step, tp.Table, tp.Dropped, want)
		}
	}
}

// mutate returns a new state with one random change, sharing everything else.
func mutate(rnd *rand.Rand, st bus.State, step int) bus.State {
	out := st
	out.Services = maps.Clone(st.Services)
	out.Slices = maps.Clone(st.Slices)
	key := bus.ServiceKey{Namespace: fmt.Sprintf("ns%d", rnd.IntN(40)%100), Name: fmt.Sprintf("svc%d", rnd.IntN(40))}
	switch rnd.IntN(9) {
	case 0: // delete the service
		delete(out.Services, key)
	case 1: // (re)create it with other features
		s := &bus.Service{ServiceKey: key, ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 1, byte(step)})},
			Ports: []bus.Port{{Name: "http", Protocol: bus.TCP, Port: 80, NodePort: int32(30000 + step)}}}
		s.ExternalPolicyLocal = rnd.IntN(2) == 0
		s.AffinitySeconds = int32(rnd.IntN(2) * 60)
		out.Services[key] = s
	case 2, 3: // new endpoints, some local
		sl := &bus.EndpointSlice{Service: key, Name: key.Name + "-1", Family: bus.IPv4,
			Ports: []bus.EndpointPort{{Name: "http", Protocol: bus.TCP, Port: 8080}, {Name: "dns", Protocol: bus.UDP, Port: 5353}}}
		for i := range rnd.IntN(4) {
			nodeName := "node-b"
			if rnd.IntN(2) == 0 {
				nodeName = testNode
			}
			sl.Items = append(sl.Items, bus.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 244, byte(step), byte(i)}), Ready: rnd.IntN(4) > 0, Serving: true, Terminating: rnd.IntN(4) == 0, NodeName: nodeName})
		}
		out.Slices[key] = map[string]*bus.EndpointSlice{sl.Name: sl}
	case 4: // endpoints gone
		delete(out.Slices, key)
	case 5: // the node changed (zone)
		n := *st.Node
		n.Zone = fmt.Sprintf("zone-%d", rnd.IntN(2))
		out.Node = &n
	case 6: // the host's addresses changed (NodePorts answer on them)
		out.LocalAddrs = []netip.Addr{netip.AddrFrom4([4]byte{192, 168, 0, byte(1 + rnd.IntN(3))})}
	case 7, 8: // a UDP front-end two services share (an external IP), or a NodePort service in a new bucket
		s := &bus.Service{ServiceKey: key, ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 97, byte(step), 1})},
			ExternalIPs: []netip.Addr{netip.AddrFrom4([4]byte{192, 0, 2, byte(rnd.IntN(2))})},
			Ports:       []bus.Port{{Name: "dns", Protocol: bus.UDP, Port: 53, NodePort: int32(31000 + step)}}}
		out.Services[key] = s
	}
	return out
}

func chainHashes(p *bus.Plan) map[string]uint64 {
	out := map[string]uint64{}
	for _, tp := range p.Tables {
		for _, c := range tp.Chains {
			out[tp.Table+"/"+c.Name] = c.Hash
		}
	}
	return out
}

// TestNodeUpdateKeepsTheCache: watch sends a new Node value on every kubelet
// status update; one that changes nothing rules depend on must not make every
// service render again (it used to: the Node was compared by pointer).
func TestNodeUpdateKeepsTheCache(t *testing.T) {
	st := rendertest.SyntheticState(5, 2)
	st.Node = node()
	rr := NewRenderer(baseConfig())
	rr.Render(full(st))
	key := bus.ServiceKey{Namespace: "ns1", Name: "svc1"}
	before := rr.cache[key]
	same := *st.Node // an equal value at another address
	st.Node = &same
	rr.Render(full(st))
	if rr.cache[key] != before {
		t.Error("an equal Node value threw the render cache away")
	}
	moved := same
	moved.Zone = "zone-b"
	st.Node = &moved
	rr.Render(full(st))
	if rr.cache[key] == before {
		t.Error("a Node in another zone kept the cached rules")
	}
}

// TestChainHashIsFNV1a: chain hashes are hash/fnv's 64-bit FNV-1a of the rules.
func TestChainHashIsFNV1a(t *testing.T) {
	for _, s := range []string{"", "-A KUBE-SERVICES -j RETURN\n", "ä\x00\xff"} {
		h := fnv.New64a()
		h.Write([]byte(s))
		if got, want := fnv64a(s), h.Sum64(); got != want {
			t.Errorf("fnv64a(%q) = %x, want %x", s, got, want)
		}
	}
}

// TestRendererAddsManyServicesInOrder: services added many at a time, their
// keys between the cached ones, come out in the order a fresh render gives.
func TestRendererAddsManyServicesInOrder(t *testing.T) {
	cfg := baseConfig()
	all := rendertest.SyntheticState(300, 2)
	all.Node = node()
	keys := slices.SortedFunc(maps.Keys(all.Services), bus.ServiceKey.Compare)
	rr := NewRenderer(cfg)
	st := all
	st.Services = map[bus.ServiceKey]*bus.Service{}
	// Every third service at first, then every other one, then all: each step
	// adds many, with keys between the cached ones.
	for step, every := range []int{3, 2, 1} {
		next := st
		next.Services = maps.Clone(st.Services)
		for i, key := range keys {
			if i%every == 0 {
				next.Services[key] = all.Services[key]
			}
		}
		st = next
		snap := &bus.Snapshot{Generation: uint64(step), State: st}
		if g, w := payload(rr.Render(snap)), payload(Render(cfg, snap)); g != w {
			t.Fatalf("step %d (%d services): cached render differs from a fresh one:\n%s", step, len(st.Services), diff(w, g))
		}
	}
}
