#!/bin/bash
# Job, steps and tasks: one job (this script), several job steps (each `srun`), each step
# running some tasks (processes) on the job's nodes.
#
#   sbatch lessons/00_slurm_basics/anatomy.sh                        (from the course root)
#   sbatch --export=ALL,GREETING=hello lessons/00_slurm_basics/anatomy.sh
#
# The #SBATCH lines are the job's request. sbatch reads them up to the first command line;
# options given on the sbatch command line win over them.
#SBATCH --job-name=anatomy
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=2
#SBATCH --gres=gpu:2
#SBATCH --mem=1G
#SBATCH --time=00:02:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
whoami_sh=$COURSE_ROOT/lessons/00_slurm_basics/whoami.sh

# The batch script is not a task of any srun: it runs once, on the first node of the job.
echo "== the job: $SLURM_JOB_ID ($SLURM_JOB_NAME), batch script on $(hostname)"
echo "nodes $SLURM_JOB_NODELIST ($SLURM_JOB_NUM_NODES), tasks $SLURM_NTASKS" \
     "($SLURM_TASKS_PER_NODE per node), CPUs per task $SLURM_CPUS_PER_TASK," \
     "GPUs per node ${SLURM_GPUS_ON_NODE:-0}, memory per node ${SLURM_MEM_PER_NODE:-?} MB"
echo "working directory $PWD (--chdir), submitted from $SLURM_SUBMIT_DIR"
# sbatch passes the submitting shell's environment on (--export=ALL, the default).
echo "GREETING=${GREETING:-<not set>}"
# sbatch gives the batch script task variables too (sbatch(1), OUTPUT ENVIRONMENT VARIABLES), as
# if it were task 0: a program started here without srun takes itself for rank 0 of SLURM_NTASKS.
echo "in the batch script: SLURM_PROCID=${SLURM_PROCID:-<not set>}" \
     "SLURM_LOCALID=${SLURM_LOCALID:-<not set>} SLURM_NODEID=${SLURM_NODEID:-<not set>}" \
     "SLURM_NTASKS=$SLURM_NTASKS SLURM_STEP_ID=${SLURM_STEP_ID:-<not set>}"

# Slurm 22.05 to 23.02: srun does not inherit --cpus-per-task from the job, so pass it on.
echo "== step 0: srun with the job's shape (2 nodes x 2 tasks)"
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" bash "$whoami_sh"

# Inside a job, srun takes the job's task counts as its defaults (from SLURM_NTASKS and
# SLURM_NTASKS_PER_NODE): a step of another shape names both.
echo "== step 1: srun --ntasks=2 --ntasks-per-node=1 (one task per node, e.g. a launcher per node)"
srun --ntasks=2 --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash "$whoami_sh"

echo "== step 2: srun --gpus-per-task=1 (each task gets its own GPU)"
srun --gpus-per-task=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash "$whoami_sh"

# %N in an output pattern is the node name, %t the task number, %j the job id: one file per
# task here. (sbatch's own --output is opened once, on the first node.) A relative path is
# relative to the job's working directory.
logs=runs/anatomy-$SLURM_JOB_ID
mkdir -p "$logs"
echo "== step 3: srun --output=$logs/%N-%t.out"
srun --output="$logs/%N-%t.out" hostname
for f in "$logs"/*.out; do echo "$(basename "$f"): $(cat "$f")"; done

# A step running in the background, and what SLURM says about the job meanwhile (once SLURM
# lists the step: starting it takes a moment).
srun --nodes=1 --ntasks=1 --cpus-per-task=1 sleep 3 &
for _ in $(seq 20); do
    squeue --noheader --steps --jobs "$SLURM_JOB_ID" | grep -q "$SLURM_JOB_ID\.4 " && break
    sleep 0.25
done
echo "== squeue --steps: the job's steps while step 4 runs"
squeue --steps --jobs "$SLURM_JOB_ID"
wait
echo "== scontrol show job: what SLURM recorded for the request"
scontrol show job --oneliner "$SLURM_JOB_ID" | tr ' ' '\n' \
    | grep -E '^(JobState|NumNodes|NumTasks|CPUs/Task|TRES|MinMemoryNode|TimeLimit|Features|WorkDir|StdOut)='
