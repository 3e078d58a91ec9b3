#!/bin/bash
# Hello all_reduce by hand: the job script works out where the processes meet, by_hand.py
# reads SLURM's variables itself. One SLURM task per GPU; three steps, one per init method.
#
#   sbatch lessons/01_hello_allreduce/by_hand.sh                   (from the course root)
#   sbatch lessons/01_hello_allreduce/by_hand.sh tcp               (only the methods named)
#
#SBATCH --job-name=by-hand
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=2
#SBATCH --mem=8G
#SBATCH --time=00:05:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

methods=("$@")
[[ ${#methods[@]} -gt 0 ]] || methods=(env tcp file)
for method in "${methods[@]}"; do
    [[ $method == env || $method == tcp || $method == file ]] \
        || { echo "error: unknown init method '$method': give env, tcp and/or file" >&2; exit 2; }
done

# Rank 0 runs on the first node of the job: that is where everybody meets.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# Any free port will do, as long as every task uses the same one. Derived from the job id, two
# jobs sharing a node do not pick the same port.
MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
export MASTER_ADDR MASTER_PORT
echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks, MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"

# file:// needs a path every node sees (the submit directory is on the shared filesystem),
# new for every run.
dist_file=$SLURM_SUBMIT_DIR/runs/by-hand-$SLURM_JOB_ID.init
mkdir -p "$(dirname "$dist_file")"
rm -f "$dist_file"

for method in "${methods[@]}"; do
    echo "== init_method $method"
    srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
        python "$COURSE_ROOT/lessons/01_hello_allreduce/by_hand.py" --init "$method" \
        --dist-file "$dist_file"
    rm -f "$dist_file"
done
