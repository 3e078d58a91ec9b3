#!/bin/bash
# FAILURE: two worlds on one node with the same MASTER_PORT, as when every job script carries
# the same fixed `export MASTER_PORT=29500` and two jobs share a node. Slurm never looks at
# ports: the second rank 0 cannot open the port and torch raises EADDRINUSE. Plain torch here
# (env://, RANK and WORLD_SIZE by hand), without common/, which would refuse the taken port first.
#
#   sbatch lessons/06_diagnosing_hangs/port_taken.sh         (from the course root)
#
# Fix: a port per job, derived from the job id (common.env's master_port_for_job, or
# MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000)) in the job script).
#
#SBATCH --job-name=port-taken
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G
#SBATCH --time=00:02:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

MASTER_ADDR=$(hostname)
export MASTER_ADDR MASTER_PORT=29500   # the mistake: the same fixed port in every job

# One world: rank 0 of WORLD_SIZE=1 joins (opening the port), holds it for HOLD seconds, leaves.
world() {
    srun --ntasks=1 --overlap --cpus-per-task=1 env RANK=0 WORLD_SIZE=1 WORLD_NAME="$1" HOLD="$2" \
        python -c '
import os, time
import torch.distributed as dist
name, hold = os.environ["WORLD_NAME"], os.environ["HOLD"]
where = os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"]
print(f"{name}: rank 0 of 1 opens {where}", flush=True)
dist.init_process_group("gloo", init_method="env://")
print(f"{name}: joined, holding the port for {hold} s", flush=True)
time.sleep(float(hold))
dist.destroy_process_group()
print(f"{name}: done", flush=True)
'
}

echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: two worlds, both MASTER_PORT=$MASTER_PORT"
world "world A" 6 &
sleep 3   # A has the port by now
world "world B" 0 || echo "== world B failed (exit $?)"
wait
