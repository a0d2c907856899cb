#!/bin/sh
# iptables-wrapper: the iptables, iptables-save, iptables-restore, ip6tables,
# ip6tables-save and ip6tables-restore of kpipe's image, as
# kubernetes-sigs/iptables-wrappers is kube-proxy's. Whoever runs one of them
# first (kpipe's `iptables -V`, which decides how kpipe writes its rules, or a
# person in the container) gets the backend the host uses, legacy or nft: the
# wrapper finds it, points all six at it and runs the command there; from then
# on they are the backend's own tools. So the image works however it is
# started (kubeadm's DaemonSet runs /usr/local/bin/kube-proxy directly). Rules
# written with the other backend would be invisible to the host's tools and
# fight its own.
#
#   /usr/sbin/iptables-wrapper --install   link the six commands beside it to it (the Dockerfile does)
#   /usr/sbin/iptables-wrapper             print the backend it would pick; change nothing
#
# The backends are xtables-legacy-multi and xtables-nft-multi beside it
# (Debian's iptables package puts them in /usr/sbin).
#
# The rule is kube-proxy's image's: the kubelet's KUBE-IPTABLES-HINT or
# KUBE-KUBELET-CANARY chain in the mangle table says which backend the host
# uses; without either, the backend holding more rules wins (nft on a tie).
set -eu

dir=$(dirname "$0")
name=$(basename "$0")
commands="iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore"

count() { # count PATTERN COMMAND...: lines of the commands' output matching PATTERN
	pattern=$1
	shift
	for cmd in "$@"; do
		# iptables-nft 1.8.3 could hang: bound it. Not our stdin: it is
		# iptables-restore's input.
		timeout 5 sh -c "$cmd" </dev/null 2>/dev/null || true
	done | grep -cE "$pattern" || true
}

save() { # save MODE FAMILY: the backend's iptables-save (FAMILY iptables) or ip6tables-save
	echo "$dir/xtables-$1-multi $2-save"
}

detect_mode() {
	hint='^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY)'
	for mode in nft legacy; do
		if [ "$(count "$hint" "$(save $mode iptables) -t mangle" "$(save $mode ip6tables) -t mangle")" -gt 0 ]; then
			echo "$mode"
			return
		fi
	done
	legacy=$(count '^-' "$(save legacy iptables)" "$(save legacy ip6tables)")
	nft=$(count '^-' "$(save nft iptables)" "$(save nft ip6tables)")
	if [ "$legacy" -gt "$nft" ]; then
		echo legacy
	else
		echo nft
	fi
}

link_all() { # link_all TARGET: point the six commands beside this script at TARGET
	for c in $commands; do
		# A rename replaces each link at once: a concurrent run finds the old
		# link or the new one, never none.
		ln -sf "$1" "$dir/.$c.$$" && mv -fT "$dir/.$c.$$" "$dir/$c" || return 1
	done
}

case " $commands " in
*" $name "*)
	mode=$(detect_mode)
	# Where the links cannot change (a read-only /usr/sbin) every run finds
	# the backend again: slower, still right.
	link_all "xtables-$mode-multi" ||
		echo "iptables-wrapper: cannot point $commands at xtables-$mode-multi" >&2
	exec "$dir/xtables-$mode-multi" "$name" "$@"
	;;
esac

case "${1:-}" in
--install)
	link_all "$name"
	;;
"")
	detect_mode
	;;
*)
	echo "usage: $0 [--install]; or run it as one of: $commands" >&2
	exit 2
	;;
esac
