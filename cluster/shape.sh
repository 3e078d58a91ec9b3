#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# Limit the bandwidth of every node's link on the local cluster, or lift the limit, to see how
# a job (lesson 06's all_reduce benchmark, say) behaves on a slower network.
#
#   bash cluster/shape.sh 1gbit      # each node's eth0, both directions, at most 1 Gbit/s
#   bash cluster/shape.sh off        # back to the unshaped link
#
# A token bucket (tc's tbf) on both ends of each node's veth pair: the end on the bridge limits
# what reaches the node, the node's eth0 what leaves it. Only bandwidth: this kernel has no
# netem, so added latency cannot be shown. down.sh removes the links, and the limits with them.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

usage="Usage: bash cluster/shape.sh RATE|off   (RATE as tc writes it: 100mbit, 1gbit, 10gbit)"
[[ $# -eq 1 ]] || die "$usage"
rate=$1
[[ $rate == off || $rate =~ ^[1-9][0-9]*(kbit|mbit|gbit)$ ]] ||
    die "RATE '$rate' is not a number followed by kbit, mbit or gbit, nor 'off'. $usage"
[[ $(id -u) -eq 0 ]] || die "run as root: it changes the nodes' network devices"
command -v tc >/dev/null || die "tc (iproute2) is not installed; apt-get install iproute2"

mapfile -t nodes < <(ip netns list 2>/dev/null | awk -v p="^${NETNS_PREFIX}[0-9]+$" '$1 ~ p {print $1}' | sort -V)
[[ ${#nodes[@]} -gt 0 ]] || die "no node namespaces ($NETNS_PREFIX*): start the cluster with cluster/up.sh"

for ns in "${nodes[@]}"; do
    n=${ns#"$NETNS_PREFIX"}
    for dev in "$VETH_PREFIX$n" "eth0@$ns"; do
        cmd=(tc)
        name=$dev
        if [[ $dev == eth0@* ]]; then
            cmd=(ip netns exec "$ns" tc)
            name=eth0
        fi
        # Remove what is there (nothing, or an earlier limit), then add the new one.
        "${cmd[@]}" qdisc del dev "$name" root 2>/dev/null || true
        if [[ $rate != off ]]; then
            # burst: enough bytes for one 64 KB segment and then some at any of these rates.
            "${cmd[@]}" qdisc add dev "$name" root tbf rate "$rate" burst 256kb latency 50ms ||
                die "tc could not limit $name of $ns to $rate"
        fi
    done
done
if [[ $rate == off ]]; then
    note "links of ${#nodes[@]} node(s) unshaped"
else
    note "links of ${#nodes[@]} node(s) limited to $rate each way (bash cluster/shape.sh off to undo)"
fi
