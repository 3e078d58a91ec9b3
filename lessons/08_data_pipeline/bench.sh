#!/bin/bash
# Lesson 08 benchmark job: how fast a DataLoader reads each form of the dataset, from the shared
# filesystem and from the node's local disk, with 0 to 4 workers (loader_bench.py), on one node.
# Prints figures and checks nothing; its output is stored beside the lesson (loader-bench-<jobid>.out).
#
#   sbatch lessons/08_data_pipeline/bench.sh                 # from the course root
#   sbatch lessons/08_data_pipeline/bench.sh --images 60000  # more arguments: loader_bench.py
#   FORMS=packed sbatch lessons/08_data_pipeline/bench.sh    # one form only
#
#SBATCH --job-name=loader-bench
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=4
#SBATCH --mem=8G
#SBATCH --time=00:20:00
#SBATCH --output=%x-%j.out        # loader-bench-<jobid>.out
set -euo pipefail

COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
LESSON=$COURSE_ROOT/lessons/08_data_pipeline
SHARED_DATA=${MNIST_FILES:-$COURSE_ROOT/data/mnist-files}
course_need_file "$SHARED_DATA/folder.tar" "prepare the files once, on the login node: PYTHONPATH=. python lessons/08_data_pipeline/mnist_files.py" || exit 2
echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST, $(sinfo --version)"

# How many CPUs srun counts for each task: a step of N tasks fits in this job's N CPUs only
# if srun counts 1 CPU per task. A plain srun of Slurm 22.05 to 23.02 does (it does not take
# the job's --cpus-per-task: lesson 00, section 6), and the step is created; with
# SRUN_CPUS_PER_TASK (or srun -c) it counts the job's value per task, and the step is refused.
n=$SLURM_CPUS_PER_TASK
counted() {
    if "$@" --ntasks="$n" true 2>/dev/null; then
        echo "$n tasks fit in the job's $n CPUs: 1 CPU counted per task"
    else
        echo "$n tasks refused: more than 1 CPU counted per task"
    fi
}
unset SRUN_CPUS_PER_TASK
echo "plain srun:                   $(counted srun)"
echo "SRUN_CPUS_PER_TASK=$n srun: $(SRUN_CPUS_PER_TASK=$n counted srun)"

# Where DataLoader workers hand over their batches: /dev/shm, here a tmpfs of the job's own.
echo "/dev/shm in this job: $(srun df -h --output=size,used,target /dev/shm | tail -n 1)"

# shellcheck source=lessons/08_data_pipeline/local_copy.sh
source "$LESSON/local_copy.sh"  # LOCAL_DATA: this job's folder on each node, removed at the end
FORMS=${FORMS:-packed folder}
for form in $FORMS; do
    bash "$LESSON/stage.sh" "$form" "$SHARED_DATA" "$LOCAL_DATA" sbcast
done
export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
srun python "$LESSON/loader_bench.py" --shared "$SHARED_DATA" --local "$LOCAL_DATA" \
    --forms "${FORMS// /,}" "$@"
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished"
