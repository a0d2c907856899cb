package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"
)

// A change is one kind of API write to a service, after which the kernel
// must show the service as its want says; with dispatch, also whether its
// chain is reached (kernel.holds).
type change struct {
	name     string
	make     func(ctx context.Context, s *benchService) error
	dispatch bool
}

func (w *workload) replacement() change {
	return change{name: "endpoint replaced", make: w.replaceEndpoint}
}

// The kinds of change measured one by one: an endpoint removed and one added
// (to the same service, which is whole again after the two), a Service
// deleted and created again (its EndpointSlice stays).
func (w *workload) endpointKinds() []change {
	return []change{{name: "endpoint removed", make: w.removeEndpoint}, {name: "endpoint added", make: w.addEndpoint}}
}

func (w *workload) serviceKinds() []change {
	return []change{
		{name: "service deleted", make: w.deleteService, dispatch: true},
		{name: "service added", make: w.createService, dispatch: true},
	}
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
	seen, err = k.waitFor(s, limit, alive, c.dispatch)
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
	out, err := changeSeries(ctx, k, alive, gap, seriesBudget, w.svcs, w.replacement())
	if err != nil {
		return nil, err
	}
	return out[0], nil
}

// changeSeries makes up to changeCount rounds of the changes cs (fewer past
// budget, at least minChanges), each round to a random one of svcs, each
// change gap after the proxy finished the one before (kernel.settle; back to
// back, gap 0: after the one before showed), and returns, for
// each of cs, how long each took from the API write to the kernel, sorted.
// A round that fails is still made whole (the rest of its changes, not
// waited for), so that the next proxy's run finds every service as before.
func changeSeries(ctx context.Context, k kernel, alive func() error, gap, budget time.Duration, svcs []*benchService, cs ...change) ([][]time.Duration, error) {
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
		s := svcs[rand.IntN(len(svcs))]
		for i, c := range cs {
			time.Sleep(gap)
			t, wrote, seen, err := measure(ctx, k, alive, 2*time.Minute, s, c)
			if err != nil {
				return nil, errors.Join(fmt.Errorf("%s: %w", c.name, err), finish(ctx, s, cs[i+1:]))
			}
			api[i] = append(api[i], wrote)
			out[i] = append(out[i], seen.Sub(t))
			if gap > 0 {
				k.settle(t)
			}
		}
	}
	for _, d := range out {
		slices.Sort(d)
	}
	return out, nil
}

// finish makes the changes cs to s without waiting for the kernel.
func finish(ctx context.Context, s *benchService, cs []change) error {
	var errs []error
	for _, c := range cs {
		errs = append(errs, c.make(ctx, s))
	}
	return errors.Join(errs...)
}
