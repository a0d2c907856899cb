#!/bin/sh
# iptables-wrapper.sh: point iptables/ip6tables (and their -save/-restore) at
# the backend the host already uses, legacy or nft, then run the command
# given (kpipe's image runs kpipe through it). With no command, print the
# mode chosen and change nothing.
#
# The same rule as kube-proxy's image (kubernetes-sigs/iptables-wrappers):
# the kubelet's KUBE-IPTABLES-HINT or KUBE-KUBELET-CANARY chain in the mangle
# table says which backend the host uses; without either, the backend holding
# more rules wins (nft on a tie). Rules written with the other backend would
# be invisible to the host's tools and fight its own.
set -eu

count() { # count PATTERN COMMAND...: lines of the commands' output matching PATTERN
	pattern=$1
	shift
	for cmd in "$@"; do
		# iptables-nft 1.8.3 could hang: bound it.
		timeout 5 sh -c "$cmd" 2>/dev/null || true
	done | grep -cE "$pattern" || true
}

detect_mode() {
	hint='^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY)'
	if [ "$(count "$hint" 'iptables-nft-save -t mangle' 'ip6tables-nft-save -t mangle')" -gt 0 ]; then
		echo nft
		return
	fi
	if [ "$(count "$hint" 'iptables-legacy-save -t mangle' 'ip6tables-legacy-save -t mangle')" -gt 0 ]; then
		echo legacy
		return
	fi
	legacy=$(count '^-' iptables-legacy-save ip6tables-legacy-save)
	nft=$(count '^-' iptables-nft-save ip6tables-nft-save)
	if [ "$legacy" -gt "$nft" ]; then
		echo legacy
	else
		echo nft
	fi
}

mode=$(detect_mode)
if [ $# -eq 0 ]; then
	echo "$mode"
	exit 0
fi

# Debian's iptables package installs both backends under update-alternatives;
# the -save and -restore links follow iptables/ip6tables as slaves.
update-alternatives --set iptables "/usr/sbin/iptables-$mode" >/dev/null
update-alternatives --set ip6tables "/usr/sbin/ip6tables-$mode" >/dev/null
echo "iptables-wrapper: using iptables-$mode" >&2
exec "$@"
