package supervise

import (
	"math"
	"testing"
	"time"
)

func TestBackoffDelay(t *testing.T) {
	const ms = time.Millisecond
	b := Backoff{Initial: 100 * ms, Max: time.Second, Factor: 2, Jitter: 0.2}
	// A fixed random source makes the jitter deterministic: 0.5 is no jitter, 0 is
	// the low end (-20%), and just under 1 the high end (+20%).
	at := func(v float64) func() float64 { return func() float64 { return v } }
	for _, tc := range []struct {
		n    int
		rnd  float64
		want time.Duration
	}{
		{1, 0.5, 100 * ms},
		{2, 0.5, 200 * ms},
		{3, 0.5, 400 * ms},
		{4, 0.5, 800 * ms},
		{5, 0.5, time.Second}, // capped
		{50, 0.5, time.Second},
		{math.MaxInt, 0.5, time.Second}, // no overflow
		{0, 0.5, 100 * ms},              // n < 1 counts as the first restart
		{1, 0, 80 * ms},
		{3, 0, 320 * ms},
		{5, 0, 800 * ms},
		{1, 0.75, 110 * ms},
		{3, 0.25, 360 * ms},
	} {
		if got := b.Delay(tc.n, at(tc.rnd)); got != tc.want {
			t.Errorf("Delay(%d) with rnd %v = %v, want %v", tc.n, tc.rnd, got, tc.want)
		}
	}
	if got := b.Delay(5, at(math.Nextafter(1, 0))); got <= time.Second || got > 1200*ms {
		t.Errorf("capped Delay at the top of the jitter = %v, want in (1s, 1.2s]", got)
	}
}

func TestBackoffDefaults(t *testing.T) {
	half := func() float64 { return 0.5 }
	var b Backoff
	if got := b.Delay(1, half); got != 100*time.Millisecond {
		t.Errorf("default first delay = %v, want 100ms", got)
	}
	if got := b.Delay(2, half); got != 200*time.Millisecond {
		t.Errorf("default second delay = %v, want 200ms (factor 2)", got)
	}
	if got := b.Delay(100, half); got != 10*time.Second {
		t.Errorf("default cap = %v, want 10s", got)
	}
	if got := b.Delay(1, func() float64 { return 0 }); got != 80*time.Millisecond {
		t.Errorf("default jitter low end = %v, want 80ms (-20%%)", got)
	}
	none := Backoff{Jitter: -1}
	if got := none.Delay(1, func() float64 { return 0 }); got != 100*time.Millisecond {
		t.Errorf("negative Jitter: delay = %v, want exactly 100ms", got)
	}
	constant := Backoff{Factor: 1}
	if got := constant.Delay(10, half); got != 100*time.Millisecond {
		t.Errorf("Factor 1: delay = %v, want 100ms every time", got)
	}
}

func TestBackoffDelayDefaultRandom(t *testing.T) {
	b := Backoff{Initial: time.Second, Max: time.Second}
	for range 100 {
		if d := b.Delay(1, nil); d < 800*time.Millisecond || d > 1200*time.Millisecond {
			t.Fatalf("Delay with the default random source = %v, want within ±20%% of 1s", d)
		}
	}
}
