#!/bin/bash
# Started by srun once per task: print, in one line, where SLURM put this task.
#
#   srun bash lessons/00_slurm_basics/whoami.sh
#
# srun sets these for each task of its step. The batch script is no task of any srun step, yet
# sbatch sets SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID there too, all 0 (anatomy.sh prints
# them); only SLURM_STEP_ID is missing.
set -euo pipefail

# One echo per line: tasks on several nodes write into the same output file at once.
echo "step ${SLURM_STEP_ID} task ${SLURM_PROCID}/${SLURM_NTASKS} on $(hostname):" \
     "node index ${SLURM_NODEID}, local index ${SLURM_LOCALID}," \
     "CPUs ${SLURM_CPUS_PER_TASK:-1}, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-none}"
