package coalesce

import (
	"math/rand/v2"
	"testing"
	"time"
)

// When the limiter says a token is available at some time, take at that time
// succeeds: a limiter that says "now" but refuses makes coalesce spin. Tokens
// are taken at odd times, so the bucket holds fractions the float arithmetic
// cannot represent exactly.
func TestLimiterKeepsItsWord(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, interval := range []time.Duration{time.Second, 300 * time.Millisecond, 7 * time.Millisecond, 1234567891} {
		now := time.Unix(1_700_000_000, 123_456_789)
		l := newLimiter(interval, 2, now)
		for i := range 10_000 {
			now = now.Add(time.Duration(r.Int64N(int64(interval))))
			at := l.next(now)
			if at.Before(now) {
				t.Fatalf("interval %v, take %d: next = %v, before now %v", interval, i, at, now)
			}
			if !l.take(at) {
				t.Fatalf("interval %v, take %d: next said %v, and take then refused", interval, i, at.Sub(now))
			}
			now = at
		}
	}
}
