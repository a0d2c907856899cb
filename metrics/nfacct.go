package metrics

import (
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
)

// PacketReader reads the packet counter of a named nfacct object (netfilter.NFAcct).
type PacketReader interface {
	Packets(object string) (uint64, error)
}

// NFAcct exports kube-proxy's two counters that live in the kernel: the packets
// counted by the rules in nfacct objects, read at each scrape. A counter whose
// object cannot be read is left out of the scrape, as kube-proxy leaves it out.
// They have no ip_family label: one object counts both families' packets.
type NFAcct struct {
	Reader PacketReader
	// InvalidDropped and LocalhostNodePorts name the objects the two counters read.
	InvalidDropped, LocalhostNodePorts string
	Log                                *slog.Logger
}

var (
	invalidDroppedDesc = prometheus.NewDesc("kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
		alpha("packets dropped by iptables to work around conntrack problems"), nil, nil)
	localhostNodePortsDesc = prometheus.NewDesc("kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
		alpha("Number of packets accepted on nodeports of loopback interface"), nil, nil)
)

// Describe implements prometheus.Collector.
func (n NFAcct) Describe(ch chan<- *prometheus.Desc) {
	ch <- invalidDroppedDesc
	ch <- localhostNodePortsDesc
}

// Collect implements prometheus.Collector.
func (n NFAcct) Collect(ch chan<- prometheus.Metric) {
	for desc, object := range map[*prometheus.Desc]string{invalidDroppedDesc: n.InvalidDropped, localhostNodePortsDesc: n.LocalhostNodePorts} {
		packets, err := n.Reader.Packets(object)
		if err != nil {
			// Start-up warned already when it could not create the object.
			n.Log.Debug("nfacct counter not exported", "counter", object, "err", err)
			continue
		}
		ch <- prometheus.MustNewConstMetric(desc, prometheus.CounterValue, float64(packets))
	}
}
