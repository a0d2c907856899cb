package netfilter

import (
	"bytes"
	"encoding/binary"
	"net/netip"
)

// The x_tables info structures iptables-nft 1.8.9 hands to nft_compat for the
// matches and targets kpipe writes, in the revisions it picks on a current
// kernel. Each is laid out as the kernel's uapi header declares it, in the
// host's byte order (fields the header marks __be are big-endian), and padded
// to XT_ALIGN (8 bytes) as iptables sends it.

var ne = binary.NativeEndian

// xtAlign is XT_ALIGN: x_tables structures are padded to 8 bytes.
func xtAlign(n int) int { return (n + 7) &^ 7 }

// xtStatisticRandomInfo is struct xt_statistic_info (rev 0) in random mode:
// u16 mode, u16 flags, u32 probability (then the rest of the nth union), and
// u32 nth.count, and the kernel's master pointer, 8-aligned: 24 bytes.
func xtStatisticRandomInfo(probability uint32, invert bool) []byte {
	b := make([]byte, 24)
	ne.PutUint16(b[0:], 0) // XT_STATISTIC_MODE_RANDOM
	if invert {
		ne.PutUint16(b[2:], 1) // XT_STATISTIC_INVERT
	}
	ne.PutUint32(b[4:], probability)
	// libxt_statistic's final check sets nth.count = every - packet whatever
	// the mode, and every shares its place with probability.
	ne.PutUint32(b[12:], probability)
	return b
}

// xtPortsInfo is struct xt_tcp or xt_udp (rev 0) matching any port, as
// `-m tcp` or `-m udp` alone leaves it: spts and dpts {0, 0xffff}.
func xtPortsInfo(size int) []byte {
	b := make([]byte, xtAlign(size))
	ne.PutUint16(b[2:], 0xffff) // spts[1]
	ne.PutUint16(b[6:], 0xffff) // dpts[1]
	return b
}

const (
	xtTCPSize = 12 // struct xt_tcp
	xtUDPSize = 10 // struct xt_udp
)

// xtSCTPInfo is struct xt_sctp_info (rev 0): u16 dpts[2], u16 spts[2],
// u32 chunkmap[64], u32 chunk_match_type, 4 × {u8, u8, u8} flag_info, int
// flag_count, u32 flags, u32 invflags: 292 bytes. dport 0 matches any port.
func xtSCTPInfo(dport uint16) []byte {
	b := make([]byte, xtAlign(292)) // libxt_sctp leaves unused ports at 0
	for i := range 4 {
		b[268+3*i] = 0xff // flag_info[i].chunktype: unused
	}
	if dport != 0 {
		ne.PutUint16(b[0:], dport)
		ne.PutUint16(b[2:], dport)
		ne.PutUint32(b[284:], 0x02) // flags: XT_SCTP_DEST_PORTS
	}
	return b
}

// xtConntrackStateInfo is struct xt_conntrack_mtinfo3 (rev 3) with --ctstate
// only: eight nf_inet_addr (128 bytes), u32 expires_min/max, u16 l4proto, four
// __be16 ports, u16 match_flags, invert_flags, state_mask, status_mask, four
// u16 high ports: 164 bytes.
func xtConntrackStateInfo(states uint16, invert bool) []byte {
	b := make([]byte, xtAlign(164))
	const stateFlag = 1 << 0 // XT_CONNTRACK_STATE
	ne.PutUint16(b[146:], stateFlag)
	if invert {
		ne.PutUint16(b[148:], stateFlag)
	}
	ne.PutUint16(b[150:], states)
	return b
}

// xtAddrtypeInfo is struct xt_addrtype_info_v1 (rev 1): u16 source, u16 dest,
// u32 flags (XT_ADDRTYPE_INVERT_SOURCE 1, _DEST 2, LIMIT_IFACE_IN 4, _OUT 8).
func xtAddrtypeInfo(src, dst uint16, flags uint32) []byte {
	b := make([]byte, 8)
	ne.PutUint16(b[0:], src)
	ne.PutUint16(b[2:], dst)
	ne.PutUint32(b[4:], flags)
	return b
}

// recent's check_set bits.
const (
	recentCheck  = 1 << 0 // XT_RECENT_CHECK
	recentSet    = 1 << 1 // XT_RECENT_SET
	recentUpdate = 1 << 2 // XT_RECENT_UPDATE
	recentRemove = 1 << 3 // XT_RECENT_REMOVE
	recentReap   = 1 << 5 // XT_RECENT_REAP
)

// xtRecentInfo is struct xt_recent_mtinfo_v1 (rev 1): u32 seconds, u32
// hit_count, u8 check_set, u8 invert, char name[200], u8 side, then an
// nf_inet_addr mask (4-aligned): 228 bytes.
func xtRecentInfo(seconds, hits uint32, checkSet uint8, name string, side uint8, mask []byte) []byte {
	b := make([]byte, xtAlign(228))
	ne.PutUint32(b[0:], seconds)
	ne.PutUint32(b[4:], hits)
	b[8] = checkSet // b[9], invert: kpipe never inverts recent
	copy(b[10:210], name)
	b[210] = side
	copy(b[212:228], mask)
	return b
}

// recentMask is libxt_recent's default --mask: every byte of the
// nf_inet_addr set, whatever the family.
var recentMask = bytes.Repeat([]byte{0xff}, 16)

// xtNFAcctInfo is struct xt_nfacct_match_info (rev 0): char name[32] and the
// kernel's pointer to the object: 40 bytes.
func xtNFAcctInfo(name string) []byte {
	b := make([]byte, 40)
	copy(b, name)
	return b
}

// NAT range flags (NF_NAT_RANGE_*).
const (
	natMapIPs         = 1 << 0
	natProtoSpecified = 1 << 1
	natRandom         = 1 << 2
	natPersistent     = 1 << 3
	natRandomFully    = 1 << 4
)

// xtNATRange2 is struct nf_nat_range2 (DNAT rev 2): u32 flags, nf_inet_addr
// min and max, __be16 min, max and base port: 44 bytes.
func xtNATRange2(flags uint32, addr netip.Addr, port uint16) []byte {
	b := make([]byte, xtAlign(44))
	ne.PutUint32(b[0:], flags)
	if addr.IsValid() {
		copy(b[4:20], addr.AsSlice())
		copy(b[20:36], addr.AsSlice())
	}
	binary.BigEndian.PutUint16(b[36:], port)
	binary.BigEndian.PutUint16(b[38:], port)
	return b
}

// xtMasqueradeIPv4 is struct nf_nat_ipv4_multi_range_compat (MASQUERADE rev 0
// for IPv4): u32 rangesize (1), then one range: u32 flags, __be32 min_ip and
// max_ip, __be16 min and max port: 20 bytes.
func xtMasqueradeIPv4(flags uint32) []byte {
	b := make([]byte, xtAlign(20))
	ne.PutUint32(b[0:], 1)
	ne.PutUint32(b[4:], flags)
	return b
}

// xtMasqueradeIPv6 is struct nf_nat_range (MASQUERADE rev 0 for IPv6): u32
// flags, nf_inet_addr min and max, __be16 min and max port: 40 bytes.
func xtMasqueradeIPv6(flags uint32) []byte {
	b := make([]byte, 40)
	ne.PutUint32(b[0:], flags)
	return b
}

// xtMarkInfo is struct xt_mark_tginfo2 (MARK rev 2): the new mark is
// (mark & ^mask) ^ value.
func xtMarkInfo(value, mask uint32) []byte {
	b := make([]byte, 8)
	ne.PutUint32(b[0:], value)
	ne.PutUint32(b[4:], mask)
	return b
}

// REJECT's --reject-with for IPv4 (enum ipt_reject_with) and IPv6 (enum
// ip6t_reject_with), by the names iptables takes.
var (
	rejectWithIPv4 = map[string]uint32{
		"icmp-net-unreachable": 0, "icmp-host-unreachable": 1, "icmp-proto-unreachable": 2,
		"icmp-port-unreachable": 3, "icmp-net-prohibited": 5, "icmp-host-prohibited": 6,
		"tcp-reset": 7, "icmp-admin-prohibited": 8,
	}
	rejectWithIPv6 = map[string]uint32{
		"icmp6-no-route": 0, "icmp6-adm-prohibited": 1, "icmp6-addr-unreachable": 3,
		"icmp6-port-unreachable": 4, "tcp-reset": 6, "icmp6-policy-fail": 7, "icmp6-reject-route": 8,
	}
)

// xtRejectInfo is struct ipt_reject_info or ip6t_reject_info (rev 0): the enum.
func xtRejectInfo(with uint32) []byte {
	b := make([]byte, 8)
	ne.PutUint32(b[0:], with)
	return b
}
