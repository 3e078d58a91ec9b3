#!/bin/bash
# Lesson 10, parts 1 and 2: the step fit.py estimates, run for real in one allocation of 2 nodes
# x 2 tasks: 1 process (no FSDP), FSDP2 over 2 ranks (one node), FSDP2 over 4 (two nodes), each
# without and with activation checkpointing. Every rank prints the estimate beside the peak the
# profiler measured.
#
#   sbatch lessons/10_fit_and_keep/fit.sh                  # from the course root
#   MODEL=tiny sbatch lessons/10_fit_and_keep/fit.sh       # the tests' model (seconds a step)
#   AC=on sbatch lessons/10_fit_and_keep/fit.sh            # with activation checkpointing only
#   sbatch lessons/10_fit_and_keep/fit.sh --batch 8        # more arguments: step.py
#
# CPU nodes (gloo), as on the course's local cluster. On GPU nodes ask for one GPU per task
# (`#SBATCH --gpus-per-task=1`): step.py then measures the GPU's allocator and uses NCCL.
#SBATCH --job-name=fit
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G                   # per node
#SBATCH --time=00:10:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks"
# Each step is a world of its own: its tasks find rank 0 and the port from the step's own
# SLURM_STEP_* variables (common/env.py), one step after the other. So nothing here exports
# MASTER_ADDR: the job's first node is not where a one-node step has to run.
case ${AC:-both} in
    both) acs=(off on) ;;
    off | on) acs=("$AC") ;;
    *) echo "error: AC='$AC' is not one of both, off, on: pass e.g. AC=on (activation checkpointing only)" >&2; exit 2 ;;
esac
for ac in "${acs[@]}"; do
    flags=()
    [[ $ac == on ]] && flags=(--ac)
    for shape in "1 1" "1 2" "2 4"; do
        read -r nodes tasks <<< "$shape"
        echo "--- step: $nodes node(s), $tasks task(s), activation checkpointing $ac"
        # (Slurm 22.05 to 23.02: pass --cpus-per-task to srun.)
        srun --nodes="$nodes" --ntasks="$tasks" --ntasks-per-node=2 --cpus-per-task="$SLURM_CPUS_PER_TASK" \
            python "$COURSE_ROOT/lessons/10_fit_and_keep/step.py" --model "${MODEL:-lesson}" "${flags[@]}" "$@"
    done
done
