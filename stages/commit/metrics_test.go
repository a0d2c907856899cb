package commit

import (
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kpipe/kpipe/bus/bustest"
	nf "github.com/kpipe/kpipe/netfilter"
	"github.com/kpipe/kpipe/stages/commit/fakekernel"
	"github.com/kpipe/kpipe/stages/render/rendertest"
)

func value(t *testing.T, c prometheus.Metric) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	default:
		return float64(m.GetHistogram().GetSampleCount())
	}
}

func observations(t *testing.T, h *prometheus.HistogramVec, family string) float64 {
	t.Helper()
	return value(t, h.WithLabelValues(family).(prometheus.Metric))
}

// series counts the series a collector exposes.
func series(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 100)
	c.Collect(ch)
	close(ch)
	return len(ch)
}

// TestSyncMetricsPerFamily: a sync is observed under the stage's ip_family, as
// kube-proxy's per-family proxiers do, and no other family's series appears.
// iptables_total is what each table holds, iptables_last what the sync wrote:
// everything in a full sync, one service's chains in a partial one, nothing when
// nothing changed.
func TestSyncMetricsPerFamily(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	m := s.metrics
	stop := runStage(t, s)
	defer stop()
	base := rendertest.SyntheticState(20, 2)

	s.p.In.Put(planOf(base, 1, true))
	bustest.Take(t, s.p.Results, "result")
	if n := observations(t, m.SyncDuration, "IPv4"); n != 1 {
		t.Errorf("sync duration IPv4 observations = %v; want 1", n)
	}
	if n := observations(t, m.SyncFullDuration, "IPv4"); n != 1 {
		t.Errorf("full sync duration IPv4 observations = %v; want 1", n)
	}
	if v := value(t, m.LastSync.WithLabelValues("IPv4")); v == 0 {
		t.Error("last sync timestamp IPv4 not set")
	}
	total := value(t, m.RulesTotal.WithLabelValues(nf.TableNAT, "IPv4"))
	if last := value(t, m.RulesLast.WithLabelValues(nf.TableNAT, "IPv4")); total == 0 || last != total {
		t.Errorf("after a full sync nat rules total %v, written %v; want equal and not 0", total, last)
	}

	s.p.In.Put(planOf(with(base, nil, nil, "svc5"), 2, false))
	bustest.Take(t, s.p.Results, "result")
	if last := value(t, m.RulesLast.WithLabelValues(nf.TableNAT, "IPv4")); last == 0 || last >= total {
		t.Errorf("after a partial sync of one service, nat rules written = %v; want some, fewer than %v", last, total)
	}
	if n := observations(t, m.SyncPartialDuration, "IPv4"); n != 1 {
		t.Errorf("partial sync duration IPv4 observations = %v; want 1", n)
	}
	s.p.In.Put(planOf(with(base, nil, nil, "svc5"), 3, false))
	bustest.Take(t, s.p.Results, "result")
	if last := value(t, m.RulesLast.WithLabelValues(nf.TableNAT, "IPv4")); last != 0 {
		t.Errorf("after a sync that changed nothing, nat rules written = %v; want 0", last)
	}

	for name, c := range map[string]prometheus.Collector{"duration": m.SyncDuration, "full": m.SyncFullDuration,
		"partial": m.SyncPartialDuration, "last timestamp": m.LastSync} {
		if n := series(c); n != 1 {
			t.Errorf("%s: %d series after IPv4 syncs; want only IPv4's", name, n)
		}
	}
}

// TestRestoreFailureMetrics: every failed commit counts as a restore failure of
// its family; a failed partial one also as a partial restore failure.
func TestRestoreFailureMetrics(t *testing.T) {
	k := fakekernel.New()
	s := testStage(k)
	m := s.metrics
	stop := runStage(t, s)
	defer stop()
	base := rendertest.SyntheticState(5, 1)
	s.p.In.Put(planOf(base, 1, true))
	bustest.Take(t, s.p.Results, "result")

	// A service added: a write (a service deleted could be written by the
	// delete-only fast path, and the full sync would then find nothing to write).
	k.BeforeRestore = func(int, string) error { return errors.New("injected: restore failed") }
	s.p.In.Put(planOf(with(base, []int{7}, nil, ""), 2, false))
	if r := bustest.Take(t, s.p.Results, "result"); r.OK {
		t.Fatal("partial sync succeeded; want a failure")
	}
	s.p.In.Put(planOf(with(base, []int{7}, nil, ""), 3, true))
	if r := bustest.Take(t, s.p.Results, "result"); r.OK {
		t.Fatal("full sync succeeded; want a failure")
	}
	if v := value(t, m.RestoreFailures.WithLabelValues("IPv4")); v != 2 {
		t.Errorf("restore failures IPv4 = %v; want 2", v)
	}
	if v := value(t, m.PartialRestoreFailures.WithLabelValues("IPv4")); v != 1 {
		t.Errorf("partial restore failures IPv4 = %v; want 1", v)
	}
	if n := series(m.RestoreFailures); n != 1 {
		t.Errorf("restore failures: %d series; want only IPv4's", n)
	}
}
