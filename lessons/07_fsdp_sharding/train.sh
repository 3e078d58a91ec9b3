#!/bin/bash
# Started by srun (see job.sh) once per task: 2 nodes x 2 tasks = 4 training processes, or
# 1 x 2 when the job came back on one node.
# Usage: train.sh [train.py arguments...]
# job_env.sh activated the venv and put the course on PYTHONPATH in the batch shell; srun hands
# that environment, and EPOCHS and CHECKPOINT_DIR, to every task.
set -euo pipefail

# exec: python replaces this shell, so the SIGUSR1 that srun passes on reaches python itself.
exec python "$COURSE_ROOT/lessons/07_fsdp_sharding/train.py" \
    --epochs "$EPOCHS" --checkpoint-dir "$CHECKPOINT_DIR" "$@"
