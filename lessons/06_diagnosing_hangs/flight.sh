#!/bin/bash
# WHICH COLLECTIVE: rank 1 skips step 2's all_reduce (a branch only it takes) and ends, while
# the others wait for it in that all_reduce. Every rank writes torch's flight recorder (the
# last collectives it called) to a file as it ends; torch's analyser then lines the files up
# and names the collective that rank 1 never joined. On gloo the analyser needs the dumps fixed
# first (fr_gloo_fix.py): the job shows the analyser on the dumps as written, then on the
# fixed copy.
#
#   sbatch lessons/06_diagnosing_hangs/flight.sh          (from the course root)
#
#SBATCH --job-name=flight
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G
#SBATCH --time=00:04:00
set -euo pipefail
# A failure should show in seconds here, not after torch's 10 minutes: every rendezvous and
# collective of this job gives up after COURSE_DIST_TIMEOUT seconds.
export COURSE_DIST_TIMEOUT=${COURSE_DIST_TIMEOUT:-20}

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
lesson=$COURSE_ROOT/lessons/06_diagnosing_hangs

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), COURSE_DIST_TIMEOUT=$COURSE_DIST_TIMEOUT s"

# The flight recorder: how many collectives each process keeps (torch's default, 2000, said
# out loud; 0 turns it off), and where each rank writes its record, <prefix><rank>: a folder
# every node sees, as the analyser needs all the files in one place (a job's /tmp is its
# node's own).
dumps=$COURSE_ROOT/runs/flight-$SLURM_JOB_ID
mkdir -p "$dumps"
export TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE=$dumps/rank_

echo "== the job: rank 1 skips step 2's all_reduce"
status=0
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python "$lesson/flight.py" --skip-rank 1 || status=$?
echo "== the job step ended with exit status $status; flight recorder files: $(cd "$dumps" && echo *)"

echo "== torch's analyser on the files as gloo wrote them (its last line)"
python -m torch.distributed.flight_recorder.fr_trace "$dumps" 2>&1 | tail -n 1 || true
echo "== torch's analyser on a copy fixed by fr_gloo_fix.py"
python "$lesson/fr_gloo_fix.py" "$dumps" "$dumps-fixed"
python -m torch.distributed.flight_recorder.fr_trace "$dumps-fixed"
rm -rf "$dumps" "$dumps-fixed"
exit "$status"
