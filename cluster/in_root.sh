#!/bin/bash
# Run a daemon of the local cluster from a Slurm version's root (cluster/slurm_root.sh), as a
# host that runs that Debian release: cluster/up.sh starts every daemon of such a version with
#   [nsenter --net=<node's namespace>] unshare --uts --mount --propagation private \
#       bash cluster/in_root.sh ROOT HOSTNAME PATH... -- COMMAND...
# In its own (private) mount namespace it binds this machine's /proc, /sys and /dev, and every
# PATH (the users' files, the course, Python, the cluster's state and logs, /etc/passwd and
# /etc/hosts, munge's socket, ...) onto the same path in ROOT, makes ROOT the namespace's root
# (pivot_root, not chroot: a job may create namespaces of its own, as Charliecloud's ch-run does,
# which the kernel refuses to a chrooted process), names the host HOSTNAME and runs COMMAND.
# Those mounts exist only in that namespace: they go away with the daemon and its jobs.
set -euo pipefail

die() {
    echo "in_root.sh: error: $*" >&2
    exit 1
}

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
