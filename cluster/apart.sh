#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# Run COMMAND where cluster/up.sh starts a second local cluster, beside the one this machine
# runs, neither seeing the other:
#     bash cluster/apart.sh DIR COMMAND...
# (as root, from anywhere; DIR an absolute path, made if missing, holds that cluster's state,
# logs and database, and may be reused). CI runs the other Slurm versions' lane so
# (`bash cluster/apart.sh /var/lib/course-apart make test-slurm`), while the other lanes use
# the cluster of this machine.
#
# COMMAND runs in namespaces of its own, from which up.sh, down.sh, the tests and the lessons
# work as on a machine of their own:
# - network: the cluster's bridge, addresses and ports (slurmctld, slurmdbd, MariaDB) are its own;
# - PID: its processes see only each other (up.sh refuses to start beside "a slurmctld not started
#   by cluster/up.sh", and looks in its own PID namespace only); when COMMAND ends, all end;
# - cgroup: a group of its own in each cgroup v1 hierarchy (course-apart-<pid>), seen inside as
#   the hierarchy's root, where slurmd makes its slurm_<node> groups;
# - mount: private copies of the paths the cluster writes (lib.sh): /etc/slurm, /etc/hosts,
#   /usr/local/bin (the other versions' client commands), /run (pid files, munge's socket, the
#   nodes' network namespaces), /var/lib/course-cluster and its lock, /var/mail, /tmp (with the
#   tests' cluster lock, /tmp/course-cluster.lock), /dev/shm, and the course's runs/ and
#   checkpoints/ (named after job ids, which the two clusters hand out apart).
# Everything else is shared: the course and its venv, /var/tmp (the tests' files for jobs), the
# Slurm roots and the container image (read only), munge's key, the users.
# At the end, down.sh stops what COMMAND left running; the exit status is COMMAND's.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
COURSE=$(dirname "$HERE")
# shellcheck source=lib.sh
source "$HERE/lib.sh"

usage="usage: bash cluster/apart.sh DIR COMMAND...   (DIR: an absolute path for the second cluster's files)"
case ${1:-} in
-h | --help)
    echo "$usage"
    exit 0
    ;;
esac
[[ $# -ge 2 ]] || die "$usage"
DIR=$1
shift
[[ $DIR == /* ]] || die "DIR '$DIR' is not an absolute path ($usage)"
case $DIR/ in
/tmp/* | /run/* | /dev/shm/* | "$CLUSTER_ROOT"/*) die "DIR '$DIR': not under /tmp, /run, /dev/shm or $CLUSTER_ROOT, which it replaces inside" ;;
esac
[[ $(id -u) -eq 0 ]] || die "run as root: it makes namespaces and mounts, as up.sh starts daemons"

if [[ ${COURSE_APART_INSIDE:-} != 1 ]]; then
    command -v unshare >/dev/null || die "unshare (util-linux) is missing"
    mkdir -p "$DIR"/{etc-slurm,cluster,local-bin,mail,tmp,runs,checkpoints} /etc/slurm \
        "$CLUSTER_ROOT" "$COURSE/runs" "$COURSE/checkpoints"
    touch "$DIR/cluster.lock" "$LOCK_FILE"
    chmod 1777 "$DIR/tmp"
    # Groups an apart.sh killed before its end left (course-apart-<its pid>, that pid gone):
    # removed when empty, so that no one takes them for this run's.
    for stale in "$CGROUP_ROOT"/*/course-apart-*; do
        if [[ -d $stale ]] && ! kill -0 "${stale##*-}" 2>/dev/null; then
            find "$stale" -depth -type d -exec rmdir {} + 2>/dev/null || true
        fi
    done
    # A group of its own in each cgroup v1 hierarchy: the namespace's processes start in it.
    group=course-apart-$$
    hierarchies=()
    for h in "$CGROUP_ROOT"/*; do
        [[ -f $h/tasks ]] || continue
        mkdir -p "$h/$group"
        if [[ -f $h/cpuset.cpus ]]; then
            cat "$h/cpuset.cpus" >"$h/$group/cpuset.cpus"
            cat "$h/cpuset.mems" >"$h/$group/cpuset.mems"
        fi
        hierarchies+=("$h")
    done
    # Its mount namespace is where a 22.05 slurmd runs: made on the CPU that keeps its id below
    # every later one's (lowest_ns_cpu in lib.sh says why); inside, it checks, and exits 75 if
    # another CPU took a new block of ids meanwhile (rare), to be made again.
    rm -f "$DIR/started"
    for try in 1 2 3 4 5; do
        read -r cpu below cpus < <(lowest_ns_cpu)
        for h in "${hierarchies[@]}"; do echo "$BASHPID" >"$h/$group/tasks"; done
        COURSE_APART_INSIDE=1 COURSE_APART_GROUP=$group COURSE_APART_CPUS=$cpus \
            COURSE_APART_BELOW=$((try < 5 ? below : 0)) taskset -c "$cpu" unshare --mount --net \
            --pid --cgroup --fork --mount-proc --propagation private \
            bash "${BASH_SOURCE[0]}" "$DIR" "$@" &
        inner=$!
        for h in "${hierarchies[@]}"; do echo "$BASHPID" >"$h/tasks"; done
        rc=0
        wait "$inner" || rc=$?
        if ((rc != 75)) || [[ -e $DIR/started ]]; then break; fi
    done
    rm -f "$DIR/started"
    # Every process of the namespace has been killed with it, but a killed process leaves its
    # group only once it has exited, and on a loaded machine that can take seconds (rmdir says
    # EBUSY meanwhile; a group was left behind so in CI): tried again for up to 60 s.
    for ((i = 0; i < 120; i++)); do
        left=()
        for h in "${hierarchies[@]}"; do
            [[ -d $h/$group ]] || continue
            find "$h/$group" -depth -type d -exec rmdir {} + 2>/dev/null || true
            [[ -d $h/$group ]] && left+=("$h/$group")
        done
        ((${#left[@]} == 0)) && break
        sleep 0.5
    done
    if ((${#left[@]})); then
        echo "apart.sh: cgroups still busy after 60 s, left in place: ${left[*]}" >&2
        rc=$((rc ? rc : 1))
    fi
    exit "$rc"
fi

# Inside: a new mount namespace (private propagation), network, PID and cgroup namespace.
taskset -pc "$COURSE_APART_CPUS" $$ >/dev/null
if ((COURSE_APART_BELOW > 0)) && (($(ns_id /proc/self/ns/mnt) >= COURSE_APART_BELOW)); then
    exit 75
fi
: >"$DIR/started"
for h in "$CGROUP_ROOT"/*; do
    if [[ -d $h/$COURSE_APART_GROUP ]]; then mount --bind "$h/$COURSE_APART_GROUP" "$h"; fi
done
ip link set lo up
mount -t tmpfs -o mode=0755 course-apart-run /run
mkdir -p /run/lock /run/netns /run/munge
mount -t tmpfs -o mode=1777 course-apart-shm /dev/shm
mount --bind "$DIR/tmp" /tmp
mount --bind "$DIR/etc-slurm" /etc/slurm
awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0==b{skip=1} !skip{print} $0==e{skip=0}' \
    "$HOSTS_FILE" >"$DIR/hosts"
mount --bind "$DIR/hosts" "$HOSTS_FILE"
# This machine's /usr/local/bin without the client commands of the version its cluster runs.
find "$DIR/local-bin" -mindepth 1 -delete
cp -a /usr/local/bin/. "$DIR/local-bin/"
for name in $SLURM_CLIENTS; do
    if grep -qF "$CLIENT_MARK" "$DIR/local-bin/$name" 2>/dev/null; then rm -f "$DIR/local-bin/$name"; fi
done
mount --bind "$DIR/local-bin" "$CLIENT_DIR"
chown --reference="$MAIL_DIR" "$DIR/mail"
chmod --reference="$MAIL_DIR" "$DIR/mail"
mount --bind "$DIR/mail" "$MAIL_DIR"
mount --bind "$DIR/cluster" "$CLUSTER_ROOT"
mount --bind "$DIR/cluster.lock" "$LOCK_FILE"
mount --bind "$DIR/runs" "$COURSE/runs"
mount --bind "$DIR/checkpoints" "$COURSE/checkpoints"
unset COURSE_APART_INSIDE COURSE_APART_GROUP COURSE_APART_CPUS COURSE_APART_BELOW

rc=0
"$@" || rc=$?
if [[ -s $RUN_DIR/daemons ]]; then bash "$HERE/down.sh" || rc=$((rc ? rc : 1)); fi
exit "$rc"
