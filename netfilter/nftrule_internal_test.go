package netfilter

import (
	"errors"
	"strings"
	"testing"

	"github.com/kpipe/kpipe/bus"
)

// TestUntranslatableSaysWhy: a rule the netlink writer cannot encode exactly
// as iptables-nft is ErrUntranslatable (iptables-restore then writes it), naming
// its line and what it could not encode.
func TestUntranslatableSaysWhy(t *testing.T) {
	for _, tc := range []struct {
		family     bus.Family
		rule, want string
	}{
		{bus.IPv4, "-A KUBE-X -m multiport --dports 80,81 -j RETURN", `match "multiport"`},
		{bus.IPv4, "-A KUBE-X -p tcp --dport 80 -j RETURN", "--dport without -m tcp"},
		{bus.IPv4, "-A KUBE-X -g KUBE-Y", "-g KUBE-Y"},
		{bus.IPv4, "-A KUBE-X -j FORWARD", "-j FORWARD"},
		{bus.IPv4, "-A FORWARD -j KUBE-X", `chain "FORWARD"`},
		{bus.IPv4, "-A KUBE-X -d fd00::1 -j RETURN", "address fd00::1/128 in IPv4"},
		{bus.IPv6, "-A KUBE-X -j DNAT --to-destination 10.0.0.1:80", "--to-destination 10.0.0.1:80 in IPv6"},
		{bus.IPv4, "-A KUBE-X ! -s 0.0.0.0/0 -j RETURN", "! -s 0.0.0.0/0"},
		{bus.IPv4, "-A KUBE-X -j REJECT --reject-with icmp6-no-route", `--reject-with "icmp6-no-route"`},
	} {
		payload := "*nat\n:KUBE-X - [0:0]\n" + tc.rule + "\nCOMMIT\n"
		_, err := translatePayload(tc.family, []byte(payload))
		if !errors.Is(err, ErrUntranslatable) || !strings.Contains(err.Error(), "line 3: ") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v %q: %v; want ErrUntranslatable at line 3 with %q", tc.family, tc.rule, err, tc.want)
		}
	}
	if _, err := translatePayload(bus.IPv4, []byte("*nat\n:KUBE-X - [0:0]\n-A KUBE-X -p tcp -m tcp --dport 80 -j RETURN\nCOMMIT\n")); err != nil {
		t.Errorf("a rule it translates: %v", err)
	}
}
