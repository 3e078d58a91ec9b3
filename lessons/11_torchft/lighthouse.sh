#!/bin/bash
# Lesson 11: the lighthouse, torchft's coordinator, as a one-task job of its own.
#
# Every replica group sends it a heartbeat (every 100 ms) and asks it, at every step, which
# groups are alive (the quorum). It answers once at least --min_replicas groups have asked, more
# than half of the groups that still heartbeat have asked, and every group that heartbeats has
# asked or the join timeout is over. It holds no training state: the weights live in the groups.
# Start it first, then the groups (group.sh), which Slurm starts only once it runs:
#
#   lh=$(sbatch --parsable lessons/11_torchft/lighthouse.sh) && echo "lighthouse: job $lh"
#   sbatch --dependency=after:$lh lessons/11_torchft/group.sh 0
#   scancel $lh                                       # when the groups are done
#
# It writes "http://<node>:<port> <its job id>" to $FT_DIR/lighthouse once it listens, and
# removes that file when it starts (an earlier lighthouse's address) and when it ends: group.sh
# takes an address only while squeue shows its job running.
# FT_DIR: the folder, on a filesystem every node mounts, where it writes its address (default
# <course>/runs/torchft). MIN_REPLICAS (default 1): the fewest groups that may step together.
# JOIN_TIMEOUT_MS (default 5000): how long a new quorum waits for a group that heartbeats but
# has not asked yet (one that is still starting, say).
#
#SBATCH --job-name=ft-lighthouse
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=1G
#SBATCH --time=01:00:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

FT_DIR=${FT_DIR:-$COURSE_ROOT/runs/torchft}
MIN_REPLICAS=${MIN_REPLICAS:-1}
JOIN_TIMEOUT_MS=${JOIN_TIMEOUT_MS:-5000}
for name in MIN_REPLICAS JOIN_TIMEOUT_MS; do
    [[ ${!name} =~ ^[1-9][0-9]*$ ]] || { echo "error: $name='${!name}' is not a whole number >= 1: e.g. MIN_REPLICAS=1 JOIN_TIMEOUT_MS=5000" >&2; exit 2; }
done
command -v torchft_lighthouse >/dev/null || { echo "error: torchft_lighthouse is not in the venv ($(command -v python), $(python -c 'import platform; print("CPython", platform.python_version(), "on", platform.system(), platform.machine())')): torchft 0.2.0 has wheels for CPython 3.10-3.13 on Linux x86_64 only; on such a node: pip install -r requirements.txt" >&2; exit 2; }
mkdir -p "$FT_DIR"
# An address left by an earlier lighthouse goes now; ours when this job ends (scancel's SIGTERM
# included: bash runs the EXIT trap once the lighthouse has stopped), if it is still ours.
rm -f "$FT_DIR/lighthouse"
remove_address() {
    local job
    job=$(cut -d' ' -f2 "$FT_DIR/lighthouse" 2>/dev/null) || return 0
    [[ $job == "$SLURM_JOB_ID" ]] && rm -f "$FT_DIR/lighthouse" && echo "address removed from $FT_DIR/lighthouse"
    return 0
}
trap remove_address EXIT

# A port of its own, derived from the job id as the lessons' MASTER_PORT is (common/env.py):
# the compute nodes must reach it (the site's firewall between nodes), and the address is the
# node's name, which the groups' nodes resolve.
eval "$(python -m common.env --export)"
address=http://$SLURMD_NODENAME:$MASTER_PORT
echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURMD_NODENAME: lighthouse $address," \
     "min_replicas $MIN_REPLICAS, join timeout ${JOIN_TIMEOUT_MS} ms"
# Written once it listens, then renamed into place: a group never reads half an address.
( for _ in $(seq 100); do
      if python - "$SLURMD_NODENAME" "$MASTER_PORT" <<'PY'
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
except OSError:
    sys.exit(1)
PY
      then echo "$address $SLURM_JOB_ID" >"$FT_DIR/lighthouse.tmp.$SLURM_JOB_ID" && mv "$FT_DIR/lighthouse.tmp.$SLURM_JOB_ID" "$FT_DIR/lighthouse" && echo "address written to $FT_DIR/lighthouse (job $SLURM_JOB_ID)" && exit 0
      fi
      sleep 0.2
  done; echo "error: the lighthouse did not listen on $address within 20 s" >&2 ) &

# The lighthouse logs every quorum request (several lines per step); keep the lines that say
# something: a new quorum (its id changes) and what is not INFO.
torchft_lighthouse --min_replicas "$MIN_REPLICAS" --join_timeout_ms "$JOIN_TIMEOUT_MS" \
    --quorum_tick_ms 100 --bind "0.0.0.0:$MASTER_PORT" 2>&1 \
    | grep --line-buffered -v -e 'Received quorum request' -e 'Quorum status' -e 'Quorum! Quorum'
