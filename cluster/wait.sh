#!/bin/bash
# Wait for a job to end and exit with its exit status, as `sbatch --wait` does, but looking at
# the job every half second instead of after 2, 10, 42, 74... s (sbatch's own back-off).
#     job=$(sbatch --parsable job.sh) && bash cluster/wait.sh "${job%%;*}"
# A requeued job is waited for until its last run ends; a job ended by a signal gives 1, as with
# sbatch --wait. The waiting is common/jobwait.py's, the one the notebooks and tests use (its
# docstring says why 1); it needs only Python's standard library, so any python3 runs it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m common.jobwait "$@"
