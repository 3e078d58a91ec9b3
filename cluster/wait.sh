#!/bin/bash
# Wait for a job to end and exit with its exit status, as `sbatch --wait` does, but looking at
# the job every half second instead of after 2, 10, 42, 74... s (sbatch's own back-off).
#     job=$(sbatch --parsable job.sh) && bash cluster/wait.sh "${job%%;*}"
# A requeued job is waited for until its last run ends. A job ended by a signal gives 1.
set -euo pipefail

job=${1:-}
[[ $job =~ ^[0-9]+(_[0-9]+)?$ ]] || {
    echo "usage: bash cluster/wait.sh JOBID   (JOBID: what sbatch --parsable printed, got '${job}')" >&2
    exit 2
}

# exit_status STATUS:SIGNAL -> what sbatch --wait returns for it.
exit_status() {
    local status=${1%%:*} sig=${1#*:}
    [[ $status =~ ^[0-9]+$ && ($sig == "$1" || $sig == 0) ]] || {
        echo 1
        return
    }
    echo "$status"
}

last_state=""
last_code=""
while true; do
    if record=$(scontrol show job -o "$job" 2>/dev/null); then
        [[ $record =~ (^|[[:space:]])JobState=([A-Z_]+) ]] && last_state=${BASH_REMATCH[2]}
        [[ $record =~ (^|[[:space:]])ExitCode=([0-9:]+) ]] && last_code=${BASH_REMATCH[2]}
        case $last_state in
        COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | PREEMPTED | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE)
            exit "$(exit_status "$last_code")"
            ;;
        esac
    else
        # The record is gone (MinJobAge after the end): ask the accounting database.
        ended=$(sacct -n -X -P -j "$job" -o ExitCode 2>/dev/null | tail -n 1)
        [[ -n $ended ]] && exit "$(exit_status "$ended")"
        echo "cluster/wait.sh: job $job is not known to slurmctld (wrong id, or it ended long ago)" >&2
        exit 2
    fi
    sleep 0.5
done
