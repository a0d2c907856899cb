package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"
)

// A change is one kind of API write to a service, after which the kernel
// must show the service as its want says.
type change struct {
	name string
	make func(ctx context.Context, s *benchService) error
}

func (w *workload) replacement() change { return change{"endpoint replaced", w.replaceEndpoint} }

// The kinds of change measured one by one: an endpoint removed and one added
// (to the same service, which is whole again after the two), a Service
// deleted and created again (its EndpointSlice stays).
func (w *workload) endpointKinds() []change {
	return []change{{"endpoint removed", w.removeEndpoint}, {"endpoint added", w.addEndpoint}}
}

func (w *workload) serviceKinds() []change {
	return []change{{"service deleted", w.deleteService}, {"service added", w.createService}}
}

// measure makes c to s and waits, up to limit, for the kernel to show it:
// when the API write began, how long it took, and when the kernel was seen
// holding the change.
func measure(ctx context.Context, k kernel, alive func() error, limit time.Duration, s *benchService, c change) (began time.Time, wrote time.Duration, seen time.Time, err error) {
	began = time.Now()
	if err = c.make(ctx, s); err != nil {
		return began, 0, time.Time{}, err
	}
	wrote = time.Since(began)
	seen, err = k.waitFor(s, limit, alive)
	return began, wrote, seen, err
}

// changeOne replaces one endpoint of a random service and waits, up to
// limit, for the kernel to hold it (see measure).
func changeOne(ctx context.Context, w *workload, k kernel, alive func() error, limit time.Duration) (began time.Time, wrote time.Duration, seen time.Time, err error) {
	return measure(ctx, k, alive, limit, w.svcs[rand.IntN(len(w.svcs))], w.replacement())
}

// latencies makes a series of endpoint replacements (see changeSeries) and
// returns their latencies.
func latencies(ctx context.Context, w *workload, k kernel, alive func() error, gap time.Duration) ([]time.Duration, error) {
	out, err := changeSeries(ctx, w, k, alive, gap, seriesBudget, w.replacement())
	if err != nil {
		return nil, err
	}
	return out[0], nil
}

// changeSeries makes up to changeCount rounds of the changes cs (fewer past
// budget, at least minChanges), each round to a random service, each change
// gap after the previous one showed in the kernel, and returns, for each of
// cs, how long each took from the API write to the kernel, sorted.
func changeSeries(ctx context.Context, w *workload, k kernel, alive func() error, gap, budget time.Duration, cs ...change) ([][]time.Duration, error) {
	out := make([][]time.Duration, len(cs))
	api := make([][]time.Duration, len(cs)) // the API writes alone: the floor of every figure
	defer func() {
		for i, c := range cs {
			if d := api[i]; len(d) > 0 {
				slices.Sort(d)
				logf("%d API writes, %s (gap %v), took p50/p99 %s/%s ms", len(d), c.name, gap, ms(percentile(d, 50)), ms(percentile(d, 99)))
			}
		}
	}()
	began := time.Now()
	for range changeCount {
		if len(out[0]) >= minChanges && time.Since(began) > budget {
			break
		}
		s := w.svcs[rand.IntN(len(w.svcs))]
		for i, c := range cs {
			time.Sleep(gap)
			t, wrote, seen, err := measure(ctx, k, alive, 2*time.Minute, s, c)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", c.name, err)
			}
			api[i] = append(api[i], wrote)
			out[i] = append(out[i], seen.Sub(t))
		}
	}
	for _, d := range out {
		slices.Sort(d)
	}
	return out, nil
}
