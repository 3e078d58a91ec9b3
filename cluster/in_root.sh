#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# Run a daemon of the local cluster from a Slurm version's root (cluster/slurm_root.sh), as a
# host that runs that Debian release: cluster/up.sh starts every daemon of such a version with
#   [nsenter --net=<node's namespace>] bash cluster/in_root.sh ROOT HOSTNAME PATH... -- COMMAND...
# It makes the daemon a private mount namespace and a UTS namespace of its own (see
# new_namespace), binds this machine's /proc, /sys and /dev there, and every PATH (the users'
# files, the course, Python, the cluster's state and logs, /etc/passwd and /etc/hosts, munge's
# socket, ...) onto the same path in ROOT, makes ROOT the namespace's root (pivot_root, not
# chroot: a job may create namespaces of its own, as Charliecloud's ch-run does, which the
# kernel refuses to a chrooted process), names the host HOSTNAME and runs COMMAND.
# Those mounts exist only in that namespace: they go away with the daemon and its jobs.
set -euo pipefail

# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

die() {
    echo "in_root.sh: error: $*" >&2
    exit 1
}

# new_namespace TRY ARGS...: run this script again with ARGS in a new private mount namespace
# (and UTS namespace) whose id is lower than that of every mount namespace made after it, on the
# CPU lib.sh's lowest_ns_cpu picks (it says why); the daemon then runs on all CPUs again.
new_namespace() {
    local try=$1 cpu below cpus
    shift
    read -r cpu below cpus < <(lowest_ns_cpu)
    exec taskset -c "$cpu" unshare --uts --mount --propagation private \
        "$BASH" "$0" --in-namespace "$try" "$cpus" "$below" "$@"
}

if [[ ${1:-} != --in-namespace ]]; then
    new_namespace 1 "$@"
fi
try=$2 cpus=$3 below=$4
shift 4
# Everything below mounts and pivots: never in the caller's own namespace (this machine's).
[[ $(readlink /proc/self/ns/mnt) != "$(readlink /proc/$PPID/ns/mnt)" ]] ||
    die "--in-namespace is for in_root.sh itself: run it without"
taskset -pc "$cpus" $$ >/dev/null
if ((below > 0)) && (($(ns_id /proc/self/ns/mnt) >= below)); then
    # Another CPU took a new block meanwhile (rare): again, from this namespace.
    ((try < 5)) && new_namespace $((try + 1)) "$@"
    echo "in_root.sh: warning: no mount namespace with the lowest id after $try tries:" \
        "a job's private /tmp may fail (ns base mount failed)" >&2
fi

[[ $# -ge 4 ]] || die "usage: in_root.sh ROOT HOSTNAME PATH... -- COMMAND..."
root=$1 host=$2
shift 2
[[ -x $root/usr/bin/env ]] || die "$root is not a root made by cluster/slurm_root.sh"
binds=()
while [[ $# -gt 0 && $1 != -- ]]; do
    binds+=("$1")
    shift
done
[[ ${1:-} == -- && $# -ge 2 ]] || die "no command after --"
shift

hostname "$host"
# pivot_root needs the new root to be a mount point.
mount --bind "$root" "$root"
for d in /proc /sys /dev; do
    mount --rbind "$d" "$root$d"
done
# A fresh /run (the root's daemons' run-time files), with munge's socket from this machine.
mount -t tmpfs -o mode=755 tmpfs "$root/run"
for p in "${binds[@]}"; do
    [[ -e $p ]] || continue
    if [[ -d $p ]]; then
        mkdir -p "$root$p"
        mount --rbind "$p" "$root$p"
    else
        mkdir -p "$(dirname "$root$p")"
        [[ -e $root$p ]] || : >"$root$p"
        mount --bind "$p" "$root$p"
    fi
done
mkdir "$root/run/old-root"
cd "$root"
pivot_root . run/old-root
# From here on the programs are the root's own.
exec chroot . /bin/sh -c 'umount -l /run/old-root && rmdir /run/old-root && exec "$@"' sh "$@"
