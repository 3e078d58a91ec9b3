#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# A node of the local cluster crashes as a real one does, power or network gone: nothing on it
# says goodbye. Every process of the node stops where it is (SIGSTOP) and the node's link goes
# down, so no socket closes (a killed process's kernel would close its sockets, and the peers
# would know within milliseconds) and nothing answers the peers' packets. With --back the node
# comes back as from a reboot: its processes are killed, its slurmd goes on, the link comes up,
# and slurmd registers again as a starting slurmd does (SIGHUP: it reconfigures and registers;
# without it, slurmctld had not asked the DOWN node again two minutes later), and
# ReturnToService=2 puts the node back in service. Unlike a reboot, the slurmd is the same
# process: what a starting slurmd cleans up (a killed job's private /tmp) stays
# (cluster/README.md).
#
#   bash cluster/crash_node.sh node2          # node2 stops answering
#   bash cluster/crash_node.sh --back node2   # node2 comes back, empty
#
# What the rest of the cluster sees: a collective with a peer there waits for its own timeout;
# slurmctld sets the node DOWN once it has not answered for SlurmdTimeout (60 s here, 300 s by
# Slurm's default) and ends or requeues the node's jobs (NODE_FAIL). Root's tool: it signals the
# node's processes and changes its network device.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

usage="Usage: bash cluster/crash_node.sh [--back] NODE   (a node of the running cluster, e.g. node2)"
back=0
if [[ ${1:-} == --back ]]; then
    back=1
    shift
fi
[[ $# -eq 1 ]] || die "$usage"
node=$1
[[ $node =~ ^node[1-9][0-9]*$ ]] || die "NODE '$node' is not a node's name such as node2. $usage"
[[ $(id -u) -eq 0 ]] || die "run as root: it signals the node's processes and takes its link down"
ns=$NETNS_PREFIX${node#node}
ip netns list 2>/dev/null | awk '{print $1}' | grep -qxF "$ns" ||
    die "no network namespace $ns: $node is not a node of the running cluster (cluster/up.sh)"

# The node's processes are those in its network namespace: its slurmd, the slurmstepds and the
# jobs' tasks.
mapfile -t pids < <(ip netns pids "$ns")
slurmd="" others=()
for pid in "${pids[@]}"; do
    if [[ $(ps -o comm= -p "$pid" 2>/dev/null) == slurmd ]]; then slurmd=$pid; else others+=("$pid"); fi
done
[[ -n $slurmd ]] || die "no slurmd runs in $ns: $node is not up (cluster/up.sh starts it)"

if ((back)); then
    ((${#others[@]} == 0)) || kill -KILL "${others[@]}" 2>/dev/null || true
    kill -CONT "$slurmd"
    ip -n "$ns" link set eth0 up
    kill -HUP "$slurmd"
    echo "=== $(date -u '+%T') $node back: ${#others[@]} processes killed, link up, its slurmd registers again"
else
    kill -STOP "$slurmd" "${others[@]}"
    ip -n "$ns" link set eth0 down
    echo "=== $(date -u '+%T') $node crashed: its slurmd and ${#others[@]} other processes stopped, link down"
fi
