package testbed

import "testing"

func TestSum(t *testing.T) {
	m := parseMetrics(`# HELP x_total A counter.
# TYPE x_total counter
x_total 3
x_total_extra 100
y_total{ip_family="IPv4",table="nat"} 5
y_total{ip_family="IPv6",table="nat"} 7
y_total{ip_family="IPv4",table="filter",note="a b"} 11
`)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"x_total", nil, 3},
		{"x_total_extra", nil, 100},
		{"x", nil, 0},
		{"y_total", nil, 23},
		{"y_total", map[string]string{"ip_family": "IPv4"}, 16},
		{"y_total", map[string]string{"ip_family": "IPv4", "table": "nat"}, 5},
		{"y_total", map[string]string{"table": "mangle"}, 0},
		{"y_total", map[string]string{"note": "a b"}, 11},
	} {
		if got := Sum(m, c.name, c.labels); got != c.want {
			t.Errorf("%s%v: %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}
