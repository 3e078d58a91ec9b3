#!/bin/bash
# Started by srun (see job.sh) once per task: 2 nodes x 2 tasks = 4 training processes.
# Usage: train.sh [train.py arguments...]
# job_env.sh already activated the venv and put the course on PYTHONPATH in the batch shell;
# srun hands that environment to every task.
set -euo pipefail

# exec: python replaces this shell, so the signals srun forwards reach python itself.
exec python "$COURSE_ROOT/lessons/03_ddp_mnist/train.py" \
    --epochs "${EPOCHS:-3}" \
    ${CHECKPOINT:+--checkpoint "$CHECKPOINT"} \
    "$@"  # extra arguments given to job.sh after the number of epochs
