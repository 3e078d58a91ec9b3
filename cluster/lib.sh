#!/bin/bash
# shellcheck disable=SC2034  # variables used by the scripts that source this file
# Shared by cluster/up.sh and cluster/down.sh (sourced, not run).

# Everything the cluster writes at run time lives under this one directory,
# so that down.sh can remove it and the next up.sh starts clean.
CLUSTER_ROOT=${COURSE_CLUSTER_ROOT:-/var/lib/course-cluster}
LOG_DIR=$CLUSTER_ROOT/log
RUN_DIR=$CLUSTER_ROOT/run
SLURM_CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
CGROUP_CONF=/etc/slurm/cgroup.conf
JOB_CONTAINER_CONF=/etc/slurm/job_container.conf
CLI_FILTER_CONF=/etc/slurm/cli_filter.lua
TOPOLOGY_CONF=/etc/slurm/topology.conf
# Site pyxis and pyxis-hook: the TaskProlog slurm.conf names (from cluster/task_prolog.sh.in).
TASK_PROLOG=/etc/slurm/task_prolog.sh
# Node N's local disk: the jobs' private /tmp and /dev/shm live under NODE_DISK_DIR/nodeN.
NODE_DISK_DIR=$CLUSTER_ROOT/nodes
CGROUP_ROOT=/sys/fs/cgroup
SLURMDBD_CONF=/etc/slurm/slurmdbd.conf
# The accounting database outlives down.sh: job records and job ids survive a restart.
DB_DIR=$CLUSTER_ROOT/db
DB_SOCKET=$DB_DIR/mysqld.sock
DB_PORT=6833
DBD_PORT=6819
# Mail that jobs send (--mail-type) is appended to MAIL_DIR/<user> (mbox format).
MAIL_DIR=/var/mail
HOSTS_FILE=/etc/hosts
HOSTS_BEGIN="# BEGIN course-cluster (managed by cluster/up.sh)"
HOSTS_END="# END course-cluster"
MUNGE_PIDFILE=/run/munge/munged.pid
# The nodes' network: one private /24 on a bridge in this machine's namespace, which holds the
# controller's address (.254); node N is .N, in its own network namespace NETNS_PREFIX<N>, whose
# end of a veth pair is called eth0 (the root end is VETH_PREFIX<N>, attached to the bridge).
CLUSTER_NET=${COURSE_CLUSTER_NET:-10.213.0}
BRIDGE=course-br0
NETNS_PREFIX=course-node
VETH_PREFIX=course-v
LOCK_FILE=$CLUSTER_ROOT.lock

# Slurm versions the cluster runs (up.sh --slurm VERSION). The default is this machine's own
# packages (Debian 12: 22.05); any other version's daemons run from a Debian root made once with
# debootstrap (cluster/slurm_root.sh) and cached in SLURM_CACHE/VERSION. To add one, add a line
# to slurm_suite: the Debian release whose slurm-wlm packages are that version.
SLURM_DEFAULT=22.05
SLURM_VERSIONS="22.05 24.11 26.05"
SLURM_CACHE=${COURSE_SLURM_CACHE:-/var/cache/course-slurm}
slurm_suite() {
    case $1 in
    22.05) echo "" ;; # this machine's packages
    24.11) echo trixie ;;
    26.05) echo forky ;;
    *) return 1 ;;
    esac
}
# version_at_least X.Y: the version up.sh runs (SLURM_VERSION) is X.Y or newer.
version_at_least() {
    # shellcheck disable=SC2153  # SLURM_VERSION: set by the script that sources this file
    local have=${SLURM_VERSION//./} want=${1//./}
    ((10#$have >= 10#$want))
}
# While a version from a root runs, its client commands (sbatch, srun, ...) are small scripts in
# CLIENT_DIR, which comes before /usr/bin on PATH: each runs that root's program with the root's
# own loader and libraries (see write_clients in up_config.sh). down.sh and a 22.05 up.sh remove them.
CLIENT_DIR=/usr/local/bin
CLIENT_MARK="# course-cluster: Slurm client"
SLURM_CLIENTS="sacct sacctmgr salloc sattach sbatch sbcast scancel scontrol sdiag sinfo sprio squeue sreport srun sshare sstat strigger"

die() {
    echo "cluster: error: $*" >&2
    exit 1
}

note() {
    echo "cluster: $*" >&2
}

# start_daemon LOG CMD...: run CMD (which daemonizes itself) with stdin from
# /dev/null, output appended to LOG, and every other inherited file descriptor
# closed, so that no daemon keeps a caller's lock file (flock) open for ever.
start_daemon() {
    local log=$1
    shift
    (
        local fd
        for fd in /proc/"$BASHPID"/fd/*; do
            fd=${fd##*/}
            if ((fd > 2)); then
                eval "exec $fd>&-" 2>/dev/null || true
            fi
        done
        exec "$@" </dev/null >>"$log" 2>&1
    )
}

# The id the kernel gave mount namespace FILE (ioctl NS_GET_MNTNS_ID; perl is part of every
# Debian system), or nothing where the kernel has no such ioctl (before 6.8).
ns_id() {
    perl -e 'open(my $f, "<", $ARGV[0]) or exit 1; my $b = "\0" x 8;
        ioctl($f, 0x8008b705, $b) or exit 1; print unpack("Q", $b), "\n"' "$1" 2>/dev/null || true
}

# lowest_ns_cpu: "CPU BELOW CPUS": where to make a mount namespace in which a slurmd runs (in_root.sh,
# apart.sh), so that its id is lower than that of every mount namespace made after it: CPU,
# the lowest next id of the other CPUs (0: no check needed) and this process's CPU list, to
# run on again once the namespace is made.
# Why: job_container/tmpfs (the per-job /tmp) keeps a job's mount namespace by bind-mounting
# /proc/<pid>/ns/mnt, from slurmstepd in the daemon's namespace, and the kernel refuses that
# unless the job's namespace has the higher id (mnt_ns_loop in fs/namespace.c): "_create_ns: ns
# base mount failed: Invalid argument" in slurmd's log, and the job fails. From Linux 6.18 on,
# each CPU hands out mount namespace ids from a block of 4096 of its own, so a namespace made
# later on another CPU can have a lower id. (A slurmd in this machine's own namespace, the
# oldest, never meets it.) So: take one id on each CPU, make the namespace on the CPU whose next
# id is the lowest, and check in it that its id is below BELOW (else make it again).
lowest_ns_cpu() {
    local cpus part a b cpu ids=() list=() low=0 below="" i
    cpus=$(taskset -pc $BASHPID)
    cpus=${cpus##*: }
    for part in ${cpus//,/ }; do
        a=${part%-*} b=${part#*-}
        for ((cpu = a; cpu <= b; cpu++)); do list+=("$cpu"); done
    done
    if ((${#list[@]} > 1)) && [[ -n $(ns_id /proc/self/ns/mnt) ]]; then
        for cpu in "${list[@]}"; do
            ids+=("$(taskset -c "$cpu" unshare --mount --propagation unchanged \
                "$BASH" -c "$(declare -f ns_id); ns_id /proc/self/ns/mnt")")
        done
        for i in "${!ids[@]}"; do
            if ((ids[i] < ids[low])); then low=$i; fi
        done
        for i in "${!ids[@]}"; do
            if ((i != low)) && [[ -z $below || ${ids[i]} -lt $below ]]; then below=${ids[i]}; fi
        done
        cpu=${list[low]}
    else
        cpu=$cpus # one CPU, or a kernel whose namespace ids only grow: any will do
    fi
    echo "$cpu ${below:-0} $cpus"
}

# Take the cluster's own lock so that two up/down runs never interleave.
# A second up.sh/down.sh waits for the first (COURSE_CLUSTER_LOCK_WAIT_S, default 300 s).
take_lock() {
    local wait_s=${COURSE_CLUSTER_LOCK_WAIT_S:-300}
    exec 9>"$LOCK_FILE"
    flock -n 9 && return 0
    note "another cluster/up.sh or down.sh is running; waiting for it (at most $wait_s s)"
    flock -w "$wait_s" 9 ||
        die "another cluster/up.sh or down.sh still holds $LOCK_FILE after $wait_s s; try again when it ends"
}

# This shell's PID namespace. The daemons and tasks of this cluster run in it; a cluster that
# cluster/apart.sh runs beside runs in its own, which this one's /proc shows too. PIDs (pid_max
# is 32768 here) and namespace numbers are reused once freed: without this check, a recorded
# pid or a node's UTS namespace number taken again by the other cluster's slurmd had down.sh
# stop that slurmd (seen in CI, on node2 of the second cluster, 3 s after it started).
OWN_PID_NS=$(readlink /proc/self/ns/pid 2>/dev/null || true)

# in_own_pid_ns PID: PID runs in this shell's PID namespace.
in_own_pid_ns() {
    [[ -z $OWN_PID_NS || $(readlink "/proc/$1/ns/pid" 2>/dev/null) == "$OWN_PID_NS" ]]
}

# pid_alive PID [NAME]: PID runs (is not a zombie) and, if given, is called NAME and runs in this
# shell's PID namespace. A killed daemon can stay a zombie for a while when nothing reaps it.
pid_alive() {
    local pid=$1 name=${2:-} stat comm state
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    comm=${stat#*(}
    comm=${comm%)*}
    state=${stat##*) }
    state=${state%% *}
    [[ $state != Z && (-z $name || $comm == "$name") ]] || return 1
    [[ -z $name ]] || in_own_pid_ns "$pid"
}

# Lines "name pid" of every daemon up.sh started (RUN_DIR/daemons).
recorded_daemons() {
    [[ -f $RUN_DIR/daemons ]] && cat "$RUN_DIR/daemons"
    return 0
}

# UTS namespaces of our nodes (RUN_DIR/uts): any process inside one of them
# belongs to a node of this cluster (slurmstepd, job tasks).
processes_in_node_namespaces() {
    local ns patterns=() path
    [[ -s $RUN_DIR/uts ]] || return 0
    while read -r ns; do
        # find -lname takes a glob: escape the brackets of "uts:[4026532177]".
        ns=${ns//[/\\[}
        patterns+=(${patterns[0]+-o} -lname "${ns//]/\\]}")
    done <"$RUN_DIR/uts"
    # One find instead of a readlink per process: fast even with many processes.
    find /proc/[0-9]*/ns -maxdepth 1 -name uts \( "${patterns[@]}" \) 2>/dev/null |
        while read -r path; do
            path=${path#/proc/}
            if in_own_pid_ns "${path%%/*}"; then echo "${path%%/*}"; fi
        done
}

# stop_pids SIGNAL_WAIT_SECONDS PID...: TERM, wait, then KILL what is left.
stop_pids() {
    local wait_s=$1 pid left i
    shift
    [[ $# -gt 0 ]] || return 0
    kill -TERM "$@" 2>/dev/null || true
    for ((i = 0; i < wait_s * 10; i++)); do
        left=()
        for pid in "$@"; do
            pid_alive "$pid" && left+=("$pid")
        done
        [[ ${#left[@]} -eq 0 ]] && return 0
        sleep 0.1
    done
    kill -KILL "${left[@]}" 2>/dev/null || true
    sleep 0.2
}

# our_client NAME: NAME is one of the client scripts up.sh wrote (not someone else's program).
our_client() {
    [[ -f $CLIENT_DIR/$1 ]] && grep -qF "$CLIENT_MARK" "$CLIENT_DIR/$1" 2>/dev/null
}

# client_path NAME: the Slurm command NAME of the version the cluster runs now (for timeout).
client_path() {
    if our_client "$1"; then echo "$CLIENT_DIR/$1"; else echo "$1"; fi
}

remove_clients() {
    local name
    for name in $SLURM_CLIENTS; do
        if our_client "$name"; then rm -f "${CLIENT_DIR:?}/$name"; fi
    done
}

# Stop everything up.sh started, by recorded pid; then remove run-time state.
# job_container/tmpfs mounts each node's directory on itself and, per job, the job's namespace
# and its /tmp under it (in this machine's mount namespace, where slurmd runs): unmount them all,
# deepest first, so that nothing of a stopped cluster stays mounted.
# Several passes: a mount propagated from a job's namespace that was still being torn down can
# show up after the first (seen under load: a job's /tmp left mounted after down.sh).
node_disk_mounts() {
    awk -v d="$NODE_DISK_DIR/" 'index($5, d) == 1 || $5 == substr(d, 1, length(d) - 1) {print $5}' \
        /proc/self/mountinfo | sort -r
}
unmount_node_disks() {
    local mnt pass
    for pass in 1 2 3 4 5; do
        [[ -z $(node_disk_mounts) ]] && return 0
        ((pass > 1)) && sleep 1
        node_disk_mounts | while read -r mnt; do
            umount -l "$mnt" 2>/dev/null || true
        done
    done
}

# stop_cluster all | keep-munge: "keep-munge" leaves our munged running (a restart needs it again)
# and put its record in KEPT_MUNGE for up.sh to write back.
KEPT_MUNGE=""
stop_cluster() {
    local name n pid stray keep_munge=0
    [[ ${1:-} == keep-munge ]] && keep_munge=1
    if [[ -f $RUN_DIR/daemons ]]; then
        # Cancel jobs first so slurmd can clean up its steps while it still runs.
        if pid_alive "$(awk '$1=="slurmctld"{print $2}' "$RUN_DIR/daemons")" slurmctld; then
            local part
            for part in local urgent; do
                timeout 10 "$(client_path scancel)" --full --quiet --partition="$part" >/dev/null 2>&1 || true
            done
        fi
        # Job steps and tasks first, then the SLURM daemons together (each takes
        # about 2 s to exit), and munge last.
        mapfile -t stray < <(processes_in_node_namespaces)
        local steps=()
        for pid in "${stray[@]}"; do
            pid_alive "$pid" slurmd || steps+=("$pid")
        done
        stop_pids 5 "${steps[@]}"
        # slurmctld sends its last job records to slurmdbd, which writes them to the database.
        local groups=("slurmd slurmctld" slurmdbd mariadbd munged)
        if ((keep_munge)); then
            groups=("slurmd slurmctld" slurmdbd mariadbd)
            KEPT_MUNGE=$(awk '$1=="munged"' "$RUN_DIR/daemons")
            if [[ -n $KEPT_MUNGE ]] && ! pid_alive "${KEPT_MUNGE#munged }" munged; then
                KEPT_MUNGE=""
            fi
        fi
        for name in "${groups[@]}"; do
            local these=()
            while read -r n pid; do
                [[ " $name " == *" $n "* ]] && pid_alive "$pid" "$n" && these+=("$pid")
            done < <(recorded_daemons)
            stop_pids 10 "${these[@]}"
        done
        mapfile -t stray < <(processes_in_node_namespaces)
        stop_pids 2 "${stray[@]}"
        # Verify: nothing we started may survive.
        local survivors=()
        while read -r n pid; do
            [[ $n == munged ]] && ((keep_munge)) && continue
            pid_alive "$pid" "$n" && survivors+=("$n:$pid")
        done < <(recorded_daemons)
        mapfile -t stray < <(processes_in_node_namespaces)
        for pid in "${stray[@]}"; do
            survivors+=("$(cat "/proc/$pid/comm" 2>/dev/null):$pid")
        done
        if [[ ${#survivors[@]} -gt 0 ]]; then
            die "could not stop: ${survivors[*]}"
        fi
    fi
    stop_network
    unmount_node_disks
    remove_clients
    # The nodes' cgroup trees (slurmd removes the jobs' groups, not its own slurm_<node>).
    find "$CGROUP_ROOT"/*/slurm_node* -depth -type d -exec rmdir {} + 2>/dev/null || true
    rm -rf "${CLUSTER_ROOT:?}/state" "${CLUSTER_ROOT:?}/spool" "${CLUSTER_ROOT:?}/run" \
        "$CLUSTER_ROOT/shape"
    if [[ -n $KEPT_MUNGE ]]; then
        # Keep the record at once, so that a later down.sh still stops it.
        mkdir -p "$RUN_DIR"
        echo "$KEPT_MUNGE" >"$RUN_DIR/daemons"
    fi
    ((keep_munge)) || rm -f /run/munge/munged.pid
}

# Remove every namespace, veth pair and the bridge that up.sh made (by their names, which
# are ours), and wait until the kernel has let go of them.
stop_network() {
    local ns dev i
    for ns in $(ip netns list 2>/dev/null | awk -v p="^${NETNS_PREFIX}[0-9]+$" '$1 ~ p {print $1}'); do
        ip netns del "$ns" 2>/dev/null || true
    done
    # Deleting a namespace deletes its eth0 and with it the root end of the pair, but the
    # kernel does it in the background: wait for it, then remove whatever is left.
    for ((i = 0; i < 50; i++)); do
        [[ $(our_links) == *"$VETH_PREFIX"* ]] || break
        sleep 0.1
    done
    for dev in $(our_links); do
        ip link del "$dev" 2>/dev/null || true
    done
}

# The network devices of this machine's namespace that up.sh made.
our_links() {
    ip -o link show 2>/dev/null | awk -F': ' -v v="^${VETH_PREFIX}[0-9]+(@|$)" -v b="$BRIDGE" \
        '$2 ~ v || $2 == b {sub(/@.*/, "", $2); print $2}'
}

# /etc/hosts without up.sh's marked block.
hosts_without_block() {
    awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0==b{skip=1} !skip{print} $0==e{skip=0}' "$HOSTS_FILE"
}

# Write TEXT to /etc/hosts if it differs (in place: in a container the file may be a mount).
write_hosts_text() {
    [[ $1 == "$(<"$HOSTS_FILE")" ]] || printf '%s\n' "$1" >"$HOSTS_FILE"
}
