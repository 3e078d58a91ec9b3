#!/bin/bash
# Started by srun once per task: print, in one line, where SLURM put this task.
#
#   srun bash lessons/00_slurm_basics/whoami.sh
#
# Every variable here is set by srun for each task; none of them exists in the batch script
# itself (it is not a task of a step that srun started).
set -euo pipefail

# One echo per line: tasks on several nodes write into the same output file at once.
echo "step ${SLURM_STEP_ID} task ${SLURM_PROCID}/${SLURM_NTASKS} on $(hostname):" \
     "node index ${SLURM_NODEID}, local index ${SLURM_LOCALID}," \
     "CPUs ${SLURM_CPUS_PER_TASK:-1}, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-none}"
