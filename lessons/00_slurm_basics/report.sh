#!/bin/bash
# Runs after the sweep: submitted with a dependency, it waits (PENDING, reason Dependency)
# until every array task ended well, then collects their results.
#
#   sweep=$(sbatch --parsable lessons/00_slurm_basics/sweep.sh)      (from the course root)
#   sbatch --dependency=afterok:$sweep lessons/00_slurm_basics/report.sh $sweep
#
# --mail-type=END,FAIL: SLURM mails the submitting user (or --mail-user) when the job ends.
#SBATCH --job-name=report
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=100M
#SBATCH --time=00:02:00
#SBATCH --mail-type=END,FAIL
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

sweep=${1:?usage: sbatch --dependency=afterok:<sweep job id> report.sh <sweep job id>}
results=runs/sweep-$sweep
[[ -d $results ]] || { echo "error: no results of array job $sweep in $PWD/$results: give the sweep's job id" >&2; exit 2; }

echo "job $SLURM_JOB_ID: results of array job $sweep"
sort -g -k2 "$results"/task-*.txt | awk '{ print "lr=" $1 " final loss " $2 }'
echo "best: lr=$(sort -g -k2 "$results"/task-*.txt | head -n1 | cut -d' ' -f1)"

# The accounting database keeps every job after it ended: state, exit code, time, memory.
# slurmctld sends the records in the background, a moment after each job ends: wait (20 s at
# most) until every task of the array (<id>_<index>) is there, and say so if one is missing.
files=("$results"/task-*.txt)
for _ in $(seq 40); do
    listed=$(sacct -n -X -j "$sweep" --format=JobID%30 2>/dev/null | grep -c "^ *${sweep}_" || true)
    (( listed >= ${#files[@]} )) && break
    sleep 0.5
done
(( listed >= ${#files[@]} )) ||
    echo "note: after 20 s sacct lists $listed of the ${#files[@]} tasks of array job $sweep (accounting slow or off)"
echo "== sacct -j $sweep"
sacct -j "$sweep" --format=JobID,JobName,State,ExitCode,Elapsed,MaxRSS 2>&1 || true
echo "== seff ${sweep}_0"
if command -v seff > /dev/null; then
    seff "${sweep}_0" 2>&1 || true
else
    # seff (from Slurm's contribs) is not everywhere; sacct has the same figures.
    echo "seff is not installed here; the same figures from sacct:"
    sacct -j "${sweep}_0" --format=JobID,Elapsed,TotalCPU,MaxRSS,ReqMem,State 2>&1 || true
fi
