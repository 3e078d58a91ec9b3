# shellcheck shell=bash
# Sourced by lesson 08's job scripts (job.sh, bench.sh, scaling.sh) after the course's job_env.sh:
# sets LOCAL_DATA, the folder on every node's local disk that this job stages its data into
# (stage.sh makes it), and sees that it is removed on every node when the job ends, however it
# ends: done, failed, out of time, cancelled, preempted.
#
# Where: $SLURM_TMPDIR when the site gives each job a folder of its own (some sites set it), else
# /tmp. Where the site runs job_container/tmpfs (as the local cluster does), /tmp is already the
# job's own and vanishes with it. Elsewhere /tmp is one folder for every job and every user of
# the node: under a fixed name two jobs on one node would overwrite or delete each other's data,
# and a second user's job would be refused the first one's folder. So the folder is named after
# this job, and stage.sh makes it with mode 700 (nobody else may read or change it).
#
# Why a step and not a trap: when a job is cancelled or runs out of time, Slurm kills every step
# at once and starts no new one, so the batch script cannot run `srun rm` on the nodes then. It
# starts, before staging, a step of one idle task per node that lasts as long as the job, with
# --task-epilog: slurmstepd runs unstage.sh after that task has ended, however it ended (even by
# SIGKILL), on its node, and it removes the folder. At the end of the script (the EXIT trap),
# ending that step does the same.

LOCAL_DATA=${SLURM_TMPDIR:-/tmp}/mnist-files-$SLURM_JOB_ID
export COURSE_LOCAL_DATA=$LOCAL_DATA  # what unstage.sh removes
# --overlap: the idle task takes none of the CPUs, memory or GPUs that the other steps need.
# Its stderr goes nowhere: srun reports the task's end, by a signal, as an error.
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
    --cpus-per-task=1 --overlap --task-epilog="$COURSE_ROOT/lessons/08_data_pipeline/unstage.sh" \
    sleep infinity 2>/dev/null &
course_local_holder=$!

# Ends the idle step (srun turns SIGTERM into SIGKILL for its tasks) and waits until it has
# ended: srun returns after the task epilogs have run, so the folders are gone then.
course_local_cleanup() {
    kill "$course_local_holder" 2>/dev/null || true
    wait "$course_local_holder" 2>/dev/null || true
}
trap course_local_cleanup EXIT
