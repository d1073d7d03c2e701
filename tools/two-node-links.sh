#!/usr/bin/env bash
# Two "nodes" on this machine, joined by a rate-limited link: the kernel-shaped half of the
# two-level cluster (the software half is minidist.comm.topology).
#
#   sudo tools/two-node-links.sh up MBIT   # namespaces md2n1, md2n2 (10.78.0.11, .12 on eth0),
#                                          # a bridge md2br0 (10.78.0.1); every packet between the
#                                          # nodes crosses a veth shaped to MBIT Mbit/s each way
#   sudo tools/two-node-links.sh down      # delete namespaces, veths and bridge (idempotent)
#   tools/two-node-links.sh check          # exit 0 when this machine can do it (root, ip, tc, tbf)
#
# Inside a node, ranks talk over its own address, which the kernel routes through the
# namespace's loopback: unshaped, the fast "intra-node" link. Between nodes, packets leave by the
# namespace's eth0 (a veth) and enter the other namespace through the bridge: the qdisc `tbf`
# (token bucket filter) on both ends of each veth limits each direction to MBIT. This kernel has
# no `netem`, so the link cannot be given a delay: latency between nodes is loopback's plus
# queueing. Run a process on node N with `ip netns exec md2nN ...` and GLOO_SOCKET_IFNAME=eth0.
# Needs root; only the namespaces, veths and bridge named here are touched.
set -euo pipefail
BR=md2br0
NET=10.78.0

die() { echo "two-node-links: $*" >&2; exit 1; }

check() {
    [ "$(id -u)" = 0 ] || { echo "two-node-links: needs root" >&2; return 1; }
    command -v ip >/dev/null && command -v tc >/dev/null || { echo "two-node-links: needs ip and tc (iproute2)" >&2; return 1; }
    local probe=md2probe$$
    ip link add "$probe" type veth peer name "${probe}p" 2>/dev/null || { echo "two-node-links: cannot create veth links" >&2; return 1; }
    if ! tc qdisc add dev "$probe" root tbf rate 100mbit burst 64kb latency 100ms 2>/dev/null; then
        ip link del "$probe"; echo "two-node-links: the kernel has no tbf qdisc" >&2; return 1
    fi
    ip link del "$probe"
    ip netns add "$probe" 2>/dev/null || { echo "two-node-links: cannot create network namespaces" >&2; return 1; }
    ip netns del "$probe"
}

down() {
    for i in 1 2; do
        if [ -e "/run/netns/md2n$i" ]; then
            for pid in $(ip netns pids "md2n$i" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "md2n$i" 2>/dev/null || true
        fi
        ip link del "md2v$i" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
}

up() {
    local mbit=$1
    [[ "$mbit" =~ ^[0-9]+$ ]] && [ "$mbit" -gt 0 ] || die "up takes the rate in Mbit/s (a positive integer), got '$mbit'"
    check || exit 1
    down
    ip link add "$BR" type bridge
    ip addr add "$NET.1/24" dev "$BR"
    ip link set "$BR" up
    for i in 1 2; do
        local ns=md2n$i
        ip netns add "$ns"
        ip link add "md2v$i" type veth peer name "md2v${i}p"
        ip link set "md2v$i" master "$BR" up
        ip link set "md2v${i}p" netns "$ns"
        ip -n "$ns" link set "md2v${i}p" name eth0
        ip -n "$ns" addr add "$NET.1$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        # each direction: into the node (bridge-side end) and out of it (the node's eth0)
        tc qdisc add dev "md2v$i" root tbf rate "${mbit}mbit" burst 64kb latency 200ms
        ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "${mbit}mbit" burst 64kb latency 200ms
    done
    echo "two-node-links: md2n1 ($NET.11) and md2n2 ($NET.12), ${mbit} Mbit/s each way between them"
}

case "${1:-}" in
    up) up "${2:-}" ;;
    down) down ;;
    check) check ;;
    *) die "usage: $0 up MBIT | down | check" ;;
esac
