#!/bin/bash
# Lesson 12: lesson 03's training, watched for a sick node; when it names one, the job saves,
# and submits itself again without that node, to resume from the checkpoint elsewhere.
#
#   sbatch lessons/12_sick_node/job.sh                   # 600 steps on 2 nodes x 2 tasks
#   bash lessons/12_sick_node/slow_node.sh <jobid> node2 # then: node2's tasks made stragglers
#   sbatch lessons/12_sick_node/job.sh --fault nan --fault-node node2      # its data goes NaN
#   sbatch lessons/12_sick_node/job.sh --fault bitflip --fault-node node2  # a bit flips there
#   STEPS=300 SUBSET=4096 sbatch ...     # shorter: 300 steps on the first 4,096 images
#
# A real cluster has more nodes than a job takes; the local one needs a third node to move to:
# make cluster-up NODES=3 (the README says why).
#
#SBATCH --job-name=sick-node
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one training process) per GPU
#SBATCH --gres=gpu:2               # two GPUs per node
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G                  # per node
#SBATCH --time=00:30:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

STEPS=${STEPS:-600}
[[ $STEPS =~ ^[0-9]+$ && $STEPS -ge 1 ]] || { echo "error: STEPS='$STEPS' is not a whole number of steps >= 1: pass e.g. STEPS=600" >&2; exit 2; }
course_subset || exit 2  # SUBSET=N: the first N images of each set
train_args=("$@")        # given again, as they were, to the job that moves off a sick node
# One checkpoint for the run, whichever job of it is running: the first job names it after its
# id, and a job submitted to move off a sick node is given it (CHECKPOINT=...).
if [[ -z ${CHECKPOINT:-} ]]; then
    CHECKPOINT=$COURSE_ROOT/checkpoints/sick-$SLURM_JOB_ID.pt
    if [[ -e $CHECKPOINT ]]; then mv "$CHECKPOINT" "$CHECKPOINT.old"; fi
fi
report=$COURSE_ROOT/runs/sick-node-$SLURM_JOB_ID
rm -f "$report"

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) starts $(date -u '+%F %T') UTC on $SLURM_JOB_NODELIST"
echo "steps $STEPS, checkpoint $CHECKPOINT"
eval "$(python -m common.env --export)"

# In Slurm 22.05 to 23.02 srun does not inherit --cpus-per-task from the job (lesson 03's job.sh).
status=0
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python "$COURSE_ROOT/lessons/12_sick_node/train.py" \
    --steps "$STEPS" --checkpoint "$CHECKPOINT" --report "$report" "${SUBSET_ARGS[@]}" "$@" \
    || status=$?
[[ $status == 3 && -s $report ]] || { echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished with status $status"; exit "$status"; }

# Moving off the node. A running job's excluded nodes cannot be changed (scontrol update
# ExcNodeList= answers "Job is no longer pending execution": _update_job in
# src/slurmctld/job_mgr.c refuses exc_nodes unless IS_JOB_PENDING, in Slurm 22.05 to 26.05), so
# a new job is submitted with --exclude: the nodes this job already avoided plus the sick one.
# --dependency=afterany: it starts only once this job has ended and freed its nodes.
sick=$(<"$report")
record=$(scontrol show job -o "$SLURM_JOB_ID")
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$record" | grep -vx '(null)'; }
excluded=$(field ExcNodeList) || true
excluded=$(scontrol show hostnames "${excluded:+$excluded,}$sick" | sort -u | paste -sd,)
left=$(sinfo -h -N -p "$SLURM_JOB_PARTITION" -o %N | sort -u | grep -cvxF -f <(tr , '\n' <<<"$excluded")) || true
# The new job asks for what this one got: options given on sbatch's command line are not kept
# with the script, and submitted again with the header's alone, a job of 8 nodes of 8 GPUs would
# come back as 2 of 2. course_same_request (common/job_env.sh) reads them back from slurmctld.
request=$(course_same_request)
mapfile -t same <<<"$request"
same=(--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_NTASKS" --ntasks-per-node="$SLURM_NTASKS_PER_NODE" "${same[@]}")
if ((left < SLURM_NNODES)); then
    echo "error: without $excluded, partition $SLURM_JOB_PARTITION has $left node(s) and this job needs $SLURM_NNODES: not resubmitted. Ask the site to look at $sick; the checkpoint is kept: CHECKPOINT=$CHECKPOINT sbatch --exclude=$excluded $(printf '%q ' "${same[@]}")lessons/12_sick_node/job.sh ${train_args[*]}" >&2
    exit 3
fi
# The new job writes where this one writes, under its own id. Its variables are named in
# --export, so that they reach it also where a site's default is --export=NONE (sbatch(1); run
# on the local cluster's export-none profile by tests/test_site_profiles.py).
out=$(field StdOut) || true
base=${out##*/}  # its file name: this job's id there becomes the new job's (%j)
# --export=ALL hands on this shell's environment, common.env's exports above included: they
# describe this job (MASTER_ADDR is its first node, which the new job may not have), and an
# exported MASTER_ADDR wins over the new job's own nodes. The new job finds its own.
unset MASTER_ADDR MASTER_PORT NNODES NODE_RANK NPROC_PER_NODE
next=$(sbatch --parsable --exclude="$excluded" --dependency="afterany:$SLURM_JOB_ID" "${same[@]}" \
       --export="ALL,CHECKPOINT=$CHECKPOINT,STEPS=$STEPS${SUBSET:+,SUBSET=$SUBSET}" \
       ${out:+--output="${out%/*}/${base//$SLURM_JOB_ID/%j}"} \
       "$COURSE_ROOT/lessons/12_sick_node/job.sh" "${train_args[@]}")
echo "=== $(date -u '+%T') moved off $sick: job $next resumes from $CHECKPOINT without $excluded"
exit 3
