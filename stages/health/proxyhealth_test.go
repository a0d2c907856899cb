package health

import (
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

func TestDecide(t *testing.T) {
	const timeout = 60 * time.Second
	started := time.Date(2025, 1, 2, 3, 0, 0, 0, time.UTC)
	now := started.Add(10 * time.Minute)
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	v4 := []bus.Family{bus.IPv4}
	dual := []bus.Family{bus.IPv4, bus.IPv6}

	tests := []struct {
		name        string
		reports     map[bus.StageName]bus.Report
		families    []bus.Family
		healthy     bool
		lastUpdated time.Time
		status      map[string]bool // per-family healthy
	}{{
		name:        "starting, nothing reported",
		families:    v4,
		healthy:     true,
		lastUpdated: started,
		status:      map[string]bool{"IPv4": true},
	}, {
		name:     "starting, change pending but not late",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"coalesce-ipv4": {PendingSince: ago(timeout - time.Second), LastQueued: ago(time.Second)},
		},
		healthy:     true,
		lastUpdated: started,
		status:      map[string]bool{"IPv4": true},
	}, {
		name:     "never synced, change pending too long",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"coalesce-ipv4": {PendingSince: ago(timeout + time.Second)},
		},
		healthy:     false,
		lastUpdated: started,
		status:      map[string]bool{"IPv4": false},
	}, {
		name:     "synced, nothing pending",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"coalesce-ipv4": {LastQueued: ago(5 * time.Minute)},
			"commit-ipv4":   {LastSync: ago(5 * time.Minute)},
		},
		healthy:     true,
		lastUpdated: ago(5 * time.Minute),
		status:      map[string]bool{"IPv4": true},
	}, {
		name:     "synced long ago, nothing pending since",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"commit-ipv4": {LastSync: ago(9 * time.Minute)},
		},
		healthy:     true,
		lastUpdated: ago(9 * time.Minute),
		status:      map[string]bool{"IPv4": true},
	}, {
		name:     "pending exactly the timeout",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"coalesce-ipv4": {PendingSince: ago(timeout)},
			"commit-ipv4":   {LastSync: ago(2 * timeout)},
		},
		healthy:     false,
		lastUpdated: ago(2 * timeout),
		status:      map[string]bool{"IPv4": false},
	}, {
		name:     "pending too long",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"coalesce-ipv4": {PendingSince: ago(3 * timeout)},
			"commit-ipv4":   {LastSync: ago(4 * timeout)},
		},
		healthy:     false,
		lastUpdated: ago(4 * timeout),
		status:      map[string]bool{"IPv4": false},
	}, {
		name:     "other family's report is ignored",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"coalesce-ipv6": {PendingSince: ago(3 * timeout)},
			"commit-ipv4":   {LastSync: ago(time.Minute)},
		},
		healthy:     true,
		lastUpdated: ago(time.Minute),
		status:      map[string]bool{"IPv4": true},
	}, {
		name:     "dual-stack, one family late",
		families: dual,
		reports: map[bus.StageName]bus.Report{
			"commit-ipv4":   {LastSync: ago(time.Minute)},
			"coalesce-ipv6": {PendingSince: ago(2 * timeout)},
			"commit-ipv6":   {LastSync: ago(3 * timeout)},
		},
		healthy:     false,
		lastUpdated: ago(time.Minute),
		status:      map[string]bool{"IPv4": true, "IPv6": false},
	}, {
		name:     "dual-stack, both synced",
		families: dual,
		reports: map[bus.StageName]bus.Report{
			"commit-ipv4": {LastSync: ago(2 * time.Minute)},
			"commit-ipv6": {LastSync: ago(time.Minute)},
		},
		healthy:     true,
		lastUpdated: ago(time.Minute),
		status:      map[string]bool{"IPv4": true, "IPv6": true},
	}, {
		name:     "node deleting does not make the proxy unhealthy",
		families: v4,
		reports: map[bus.StageName]bus.Report{
			"watch":       {NodeDeleting: true},
			"commit-ipv4": {LastSync: ago(time.Minute)},
		},
		healthy:     true,
		lastUpdated: ago(time.Minute),
		status:      map[string]bool{"IPv4": true},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := decide(tt.reports, tt.families, started, now, timeout)
			if got.Healthy != tt.healthy {
				t.Errorf("healthy = %v, want %v", got.Healthy, tt.healthy)
			}
			if !got.LastUpdated.Equal(tt.lastUpdated) {
				t.Errorf("lastUpdated = %v, want %v", got.LastUpdated, tt.lastUpdated)
			}
			if !got.CurrentTime.Equal(now) {
				t.Errorf("currentTime = %v, want %v", got.CurrentTime, now)
			}
			if got.NodeEligible != nil {
				t.Errorf("nodeEligible set by decide")
			}
			if len(got.Status) != len(tt.status) {
				t.Errorf("status = %v, want %v", got.Status, tt.status)
			}
			for fam, want := range tt.status {
				if st, ok := got.Status[fam]; !ok || st.Healthy != want {
					t.Errorf("status[%s] = %+v (present %v), want healthy %v", fam, st, ok, want)
				}
			}
		})
	}
}

func TestNodeEligible(t *testing.T) {
	tests := []struct {
		name    string
		reports map[bus.StageName]bus.Report
		want    bool
	}{
		{"starting, watch has not reported", nil, true},
		{"node seen", map[bus.StageName]bus.Report{"watch": {LastQueued: testNow}}, true},
		{"node deleting", map[bus.StageName]bus.Report{"watch": {NodeDeleting: true}}, false},
		{"another stage says node deleting", map[bus.StageName]bus.Report{"commit-ipv4": {NodeDeleting: true}}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := nodeEligible(tt.reports); got != tt.want {
				t.Errorf("nodeEligible = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestMergeChecks(t *testing.T) {
	a := bus.ServiceKey{Namespace: "ns", Name: "a"}
	b := bus.ServiceKey{Namespace: "ns", Name: "b"}
	c := bus.ServiceKey{Namespace: "ns", Name: "c"}
	got := mergeChecks(map[bus.Family]bus.HealthChecks{
		bus.IPv4: {Family: bus.IPv4, Services: map[bus.ServiceKey]bus.HealthCheck{
			a: {NodePort: 30001, LocalEndpoints: 2},
			b: {NodePort: 30002, LocalEndpoints: 0},
			c: {NodePort: 0, LocalEndpoints: 4},
		}},
		bus.IPv6: {Family: bus.IPv6, Services: map[bus.ServiceKey]bus.HealthCheck{
			a: {NodePort: 30001, LocalEndpoints: 1},
			b: {NodePort: 30002, LocalEndpoints: 3},
		}},
	})
	want := map[bus.ServiceKey]bus.HealthCheck{
		a: {NodePort: 30001, LocalEndpoints: 2},
		b: {NodePort: 30002, LocalEndpoints: 3},
	}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s: got %+v, want %+v", k, got[k], w)
		}
	}
}
