package metrics

import (
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// fakeNFAcct holds packet counters by object name; a name it lacks is an error.
type fakeNFAcct map[string]uint64

func (f fakeNFAcct) Packets(object string) (uint64, error) {
	if v, ok := f[object]; ok {
		return v, nil
	}
	return 0, errors.New("no such nfacct object")
}

// The counters are read at each scrape; one whose object cannot be read is
// absent from the scrape, as in kube-proxy, while the other is still there.
func TestNFAcctReadAtScrape(t *testing.T) {
	counters := fakeNFAcct{"invalid": 3}
	reg := prometheus.NewRegistry()
	reg.MustRegister(NFAcct{Reader: counters, InvalidDropped: "invalid", LocalhostNodePorts: "localhost", Log: slog.New(slog.DiscardHandler)})
	scrape := func(want string) {
		t.Helper()
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
			"kubeproxy_iptables_ct_state_invalid_dropped_packets_total", "kubeproxy_iptables_localhost_nodeports_accepted_packets_total"); err != nil {
			t.Error(err)
		}
	}
	scrape(`# HELP kubeproxy_iptables_ct_state_invalid_dropped_packets_total [ALPHA] packets dropped by iptables to work around conntrack problems
# TYPE kubeproxy_iptables_ct_state_invalid_dropped_packets_total counter
kubeproxy_iptables_ct_state_invalid_dropped_packets_total 3
`)
	counters["invalid"], counters["localhost"] = 10, 4
	scrape(`# HELP kubeproxy_iptables_ct_state_invalid_dropped_packets_total [ALPHA] packets dropped by iptables to work around conntrack problems
# TYPE kubeproxy_iptables_ct_state_invalid_dropped_packets_total counter
kubeproxy_iptables_ct_state_invalid_dropped_packets_total 10
# HELP kubeproxy_iptables_localhost_nodeports_accepted_packets_total [ALPHA] Number of packets accepted on nodeports of loopback interface
# TYPE kubeproxy_iptables_localhost_nodeports_accepted_packets_total counter
kubeproxy_iptables_localhost_nodeports_accepted_packets_total 4
`)
}
