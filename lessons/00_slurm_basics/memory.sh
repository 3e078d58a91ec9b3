#!/bin/bash
# --mem: memory per node for the job. This job asks for 300 MB and then uses more, on purpose.
#
#   sbatch lessons/00_slurm_basics/memory.sh                         (from the course root)
#
# Where SLURM enforces memory (cgroups: TaskPlugin=task/cgroup with ConstrainRAMSpace=yes),
# the step's task is killed by the kernel's out-of-memory killer: the step ends OUT_OF_MEMORY
# and, as srun then fails, the job FAILED (a job ends OUT_OF_MEMORY only when its batch script
# itself goes over).
# Where it does not, nothing stops the job: it takes memory that other jobs on the node were
# promised. Either way, ask for what the job uses (seff shows it after a job ended).
#SBATCH --job-name=memory
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=300M
#SBATCH --time=00:02:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: --mem gives $SLURM_MEM_PER_NODE MB per node"
# Touch every page of 600 MB, 100 MB at a time: memory counts once it is written, not when
# it is reserved.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python -c '
import sys
chunks = []
for mb in range(100, 700, 100):
    chunks.append(bytearray(b"x") * (100 * 2**20))
    print(f"holding {mb} MB", flush=True)
print("still alive: this cluster does not enforce --mem", flush=True)
'
