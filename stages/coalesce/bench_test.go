package coalesce_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/metrics"
	"github.com/kpipe/kpipe/stages/coalesce"
)

// BenchmarkEventWhileManyPending is the cost of one change while 10,000 services
// wait for their first commit (a first sync at 10k services): it must not grow
// with the number of pending services.
func BenchmarkEventWhileManyPending(b *testing.B) {
	in := bus.NewChangeQueue()
	fam := coalesce.Pipeline{Family: bus.IPv4, Out: bus.NewMailbox[*bus.Snapshot](), Results: bus.NewMailbox[bus.Result](),
		Resync: bus.NewResyncFlag(), Resend: bus.NewResendFlag()}
	s := coalesce.NewStage(coalesce.Params{Config: coalesce.Config{SyncPeriod: time.Hour}, In: in, Replay: bus.NewReplayFlag(),
		Families: []coalesce.Pipeline{fam}, Env: bus.Envs{Metrics: metrics.New(prometheus.NewRegistry()), Board: bus.NewBoard()}.For(bus.Coalesce)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	var services []*bus.Service
	for i := range 10000 {
		services = append(services, svc(bus.ServiceKey{Namespace: "ns", Name: fmt.Sprintf("s%d", i)}, "10.96.0.1"))
	}
	sendTaken(b, in, replayOf(services...)) // its snapshot stays unanswered: everything stays pending
	b.ResetTimer()
	i := 0
	for b.Loop() {
		i++
		k := services[i%len(services)].ServiceKey
		sendTaken(b, in, bus.Change{Kind: bus.ServiceChanged, Key: k, Service: svc(k, "10.96.0.2")})
	}
}
