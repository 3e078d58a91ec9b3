#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# Start (or confirm) the local SLURM cluster: munge, one slurmctld and one
# slurmd per node, all on this machine, each node with its own hostname.
# Returns once every node is idle. See cluster/README.md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"
# Its pieces, each one idea; they define what this file runs, and source nothing themselves.
# shellcheck source=up_options.sh
source "$HERE/up_options.sh"
# shellcheck source=up_host.sh
source "$HERE/up_host.sh"
# shellcheck source=up_config.sh
source "$HERE/up_config.sh"
# shellcheck source=up_network.sh
source "$HERE/up_network.sh"
# shellcheck source=up_daemons.sh
source "$HERE/up_daemons.sh"

parse_args "$@"
[[ $(id -u) -eq 0 ]] || die "run as root: it starts system daemons and writes /etc/slurm and /etc/hosts"

CTL_NAME=course-ctl
# Each node is a separate host on a private network (see start_network): node N has the address
# CLUSTER_NET.N on its own eth0, and the controller, in this machine's namespace, CLUSTER_NET.254
# on the bridge. Every slurmd listens on SLURM's usual port, 6818, on its own address.
CTL_ADDR=$CLUSTER_NET.254
CTL_PORT=6817
# Seconds a preempted job of partition "local" has between SIGTERM and SIGKILL.
GRACE_S=30
SHAPE="nodes=$NODES gpus-per-node=$GPUS cpus-per-node=$CPUS mem-per-node=$MEM slurm=$SLURM_VERSION"
[[ $SITE == strict ]] || SHAPE+=" site=$SITE"
# The root this version's daemons run from (cluster/slurm_root.sh); none for this machine's own.
SLURM_ROOT=""
[[ -n $(slurm_suite "$SLURM_VERSION") ]] && SLURM_ROOT=$SLURM_CACHE/$SLURM_VERSION
GPU_DEV_PREFIX=/dev/course-gpu
STUDENT=student

mkdir -p "$CLUSTER_ROOT"
take_lock
if [[ -n $SLURM_ROOT && ! -f $SLURM_ROOT/.course-slurm-root ]] && ((CHECK_ONLY)); then
    note "not up in this shape ($SHAPE): no root for Slurm $SLURM_VERSION yet"
    exit 1
fi
((CHECK_ONLY)) || install_packages
((CHECK_ONLY)) || ensure_student
if [[ -n $SLURM_ROOT ]] && ((!CHECK_ONLY)); then
    bash "$HERE/slurm_root.sh" "$SLURM_VERSION" >/dev/null || exit 1
fi
render_configs

if already_up; then
    note "already up ($SHAPE)"
    exit 0
fi
if ((CHECK_ONLY)); then
    note "not up in this shape ($SHAPE)"
    exit 1
fi

# Everything the cluster needs from this machine, checked before anything is stopped or started.
check_cgroups
check_client_dir
check_network

start_time=$EPOCHREALTIME
note "starting ($SHAPE)"
stop_cluster keep-munge
check_no_strays

mkdir -p "$LOG_DIR" "$RUN_DIR" "$CLUSTER_ROOT/state" "$CLUSTER_ROOT/spool" /etc/slurm
touch "$RUN_DIR/daemons"
: >"$RUN_DIR/uts"
for f in slurmctld.log slurmdbd.log mariadb.log start.log; do : >"$LOG_DIR/$f"; done
rm -f "$LOG_DIR"/slurmd-node*.log

write_hosts
write_configs
rm -rf "${NODE_DISK_DIR:?}"
mkdir -p "$NODE_DISK_DIR"
# One mailbox per user (see cluster/mailprog.sh), which slurmctld runs directly.
mkdir -p "$MAIL_DIR"
[[ -x $HERE/mailprog.sh ]] || chmod 755 "$HERE/mailprog.sh"
for ((g = 0; g < GPUS; g++)); do
    # Spare character devices (same numbers as /dev/null) stand in for GPUs.
    [[ -c $GPU_DEV_PREFIX$g ]] || mknod -m 666 "$GPU_DEV_PREFIX$g" c 1 3
done

# Never leave a half-started cluster: whatever fails from here stops what was started.
started_ok=0
on_exit() {
    if ((!started_ok)); then
        trap - EXIT
        note "stopping what was started"
        stop_cluster all || true
    fi
}
trap on_exit EXIT
if [[ -n $SLURM_ROOT ]]; then
    write_clients
    root_binds
fi
start_network >>"$LOG_DIR/start.log" 2>&1 ||
    die "network: could not create the bridge and namespaces; see $LOG_DIR/start.log"
start_munge
start_accounting
SLURM_CONF_TEXT=${SLURM_CONF_TEXT/FirstJobId=1/FirstJobId=$(first_job_id)}
printf '%s\n' "$SLURM_CONF_TEXT" >"$SLURM_CONF"
register_cluster
start_slurm
wait_idle
started_ok=1
echo "$SHAPE" >"$CLUSTER_ROOT/shape"
elapsed=$(awk -v a="$start_time" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.1f", b-a}')
note "up in $elapsed s: $SHAPE; logs in $LOG_DIR"
if [[ $SITE == rank0-elsewhere ]] && ! version_at_least 26.05; then
    note "site rank0-elsewhere: Slurm $SLURM_VERSION lays a step's tasks out in host list order, not by topology (26.05 does): task 0 stays on the first node; --distribution=arbitrary moves it (cluster/README.md)"
fi
