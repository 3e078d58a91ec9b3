#!/bin/bash
# Started by srun (see job.sh) once per task: 2 nodes x 2 tasks = 4 training processes.
# Usage: train.sh [train.py arguments...]
# job_env.sh activated the venv and put the course on PYTHONPATH in the batch shell; srun hands
# that environment, and EPOCHS and CHECKPOINT, to every task.
set -euo pipefail

# exec: python replaces this shell, so signals that srun passes on reach python itself.
exec python "$COURSE_ROOT/lessons/03_ddp_mnist/train.py" \
    --epochs "$EPOCHS" --checkpoint "$CHECKPOINT" "$@"
