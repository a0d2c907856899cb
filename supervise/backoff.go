package supervise

import (
	"math"
	"math/rand/v2"
	"time"
)

// Backoff says how long a supervisor waits before restarting a failed child.
// Zero fields take their defaults.
type Backoff struct {
	Initial time.Duration // delay before the first restart; default 100ms
	Max     time.Duration // cap on the delay, and the length of a stable run; default 10s
	Factor  float64       // growth per restart; default 2, values below 1 count as 1
	Jitter  float64       // ±fraction of random spread; default 0.2, negative for none
}

func (b Backoff) withDefaults() Backoff {
	if b.Initial <= 0 {
		b.Initial = 100 * time.Millisecond
	}
	if b.Max <= 0 {
		b.Max = 10 * time.Second
	}
	switch {
	case b.Factor == 0:
		b.Factor = 2
	case b.Factor < 1:
		b.Factor = 1
	}
	// Idempotent: a negative Jitter stays negative (none) rather than becoming 0 (default).
	switch {
	case b.Jitter == 0:
		b.Jitter = 0.2
	case b.Jitter > 1:
		b.Jitter = 1
	}
	return b
}

// Delay returns the delay before restart number n (n=1 is the first restart):
// Initial·Factor^(n-1) capped at Max, then spread by a random ±Jitter fraction so
// that stages failing together do not restart in lockstep (at the cap, the delay may
// reach Max·(1+Jitter)). rnd returns values in [0, 1); nil uses math/rand/v2.
func (b Backoff) Delay(n int, rnd func() float64) time.Duration {
	b = b.withDefaults()
	if rnd == nil {
		rnd = rand.Float64
	}
	n = max(n, 1)
	// Float arithmetic so that a large n saturates (to +Inf) instead of overflowing.
	d := float64(b.Initial) * math.Pow(b.Factor, float64(n-1))
	d = min(d, float64(b.Max))
	d *= 1 + max(b.Jitter, 0)*(2*rnd()-1)
	return time.Duration(d)
}
