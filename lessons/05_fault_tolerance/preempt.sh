#!/bin/bash
# Lesson 05: an urgent job that takes the GPUs of a running job (preemption).
#
# Partition "urgent" has a higher PriorityTier than the default partition; with
# PreemptType=preempt/partition_prio and PreemptMode=REQUEUE a job here that needs resources
# held by a job of the default partition preempts it: SLURM sends that job SIGTERM, gives it
# the partition's GraceTime to save (scontrol show partition), kills what is left, and puts it
# back in the queue. requeue.sh saves within the grace time and resumes when it runs again.
#
#   sbatch lessons/05_fault_tolerance/requeue.sh      # the job that will be preempted
#   sbatch lessons/05_fault_tolerance/preempt.sh      # while it runs
#
#SBATCH --job-name=ft-urgent
#SBATCH --partition=urgent
#SBATCH --nodes=2
#SBATCH --gres=gpu:2               # every GPU of both nodes: the running job must make room
#SBATCH --time=00:05:00
set -euo pipefail
# A site with --export=NONE would start the srun steps below without PATH (the course's job_env.sh,
# which this script does not need, says why): give them this script's environment.
[[ ${SLURM_EXPORT_ENV:-ALL} == ALL* ]] || export SLURM_EXPORT_ENV=ALL

echo "=== urgent job $SLURM_JOB_ID starts $(date -u '+%F %T') UTC on $SLURM_JOB_NODELIST"
# shellcheck disable=SC2016  # expanded by the shell of each task, on its node
srun --ntasks-per-node=1 bash -c 'echo "$(hostname): urgent work with GPUs ${CUDA_VISIBLE_DEVICES:-none}"'
echo "=== $(date -u '+%T') urgent job $SLURM_JOB_ID finished"
