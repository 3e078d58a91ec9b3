#!/bin/bash
# The --task-epilog of the idle step that local_copy.sh starts on every node of a lesson 08 job:
# slurmstepd runs it on the node when that step's task has ended, however the job ended, with
# the job's environment. It removes the job's node-local copy of the data, and only that: a
# path named after this job (mnist-files-<job id>), whatever else COURSE_LOCAL_DATA may hold.
dir=${COURSE_LOCAL_DATA:-}
if [[ -n ${SLURM_JOB_ID:-} && $dir == /*/mnist-files-"$SLURM_JOB_ID" ]]; then
    rm -rf -- "$dir"
fi
