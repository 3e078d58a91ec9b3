#!/bin/bash
# Lesson 11: torchft's recovery against lesson 05's restart, on the same model and the same
# failure (a node set DOWN, as an admin, or slurmctld for a node that stops answering, does it),
# and the loss of a torchft run that lost a group against one that did not. Run for the README,
# not in CI: about 6 minutes of the local cluster, as root (scontrol), from the course root:
#
#   bash lessons/11_torchft/compare.sh          # writes lessons/11_torchft/compare/
#
# Three runs, one after the other, each holding the cluster's lock (/tmp/course-cluster.lock)
# from its submission to its end: no other job shares the nodes, nobody else sets them DOWN.
#   ft-fail    the lighthouse and 2 groups (group.sh), group 1's node set DOWN once group 0
#              has logged step FAIL_AT; Slurm requeues group 1, which heals from group 0
#   l05-fail   lesson 05's requeue.sh on the same 2 nodes, one rank each (its global batch of
#              128 is 64 per rank, as torchft's is 64 per group), the second node set DOWN at
#              its step FAIL_AT
#   ft-steady  as ft-fail, without the failure
# Every line the jobs write is copied to OUT with the time this script read it (bash's
# EPOCHREALTIME), as are the DOWN and the node's return (timeline.txt); compare.py reads them
# back, prints the figures (figures.txt) and draws compare.png.
# SUBSET (12800 images: 100 steps per epoch), STEPS (torchft's, 800), FAIL_AT (150).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${1:-$ROOT/lessons/11_torchft/compare}
SUBSET=${SUBSET:-12800} STEPS=${STEPS:-800} FAIL_AT=${FAIL_AT:-150}
LOCK=/tmp/course-cluster.lock
GUARD_S=600  # a hang guard for each wait; the slow kind of machine takes twice as long
for name in SUBSET STEPS FAIL_AT; do
    [[ ${!name} =~ ^[1-9][0-9]*$ ]] || { echo "error: $name='${!name}' is not a whole number >= 1: e.g. SUBSET=12800 STEPS=800 FAIL_AT=150" >&2; exit 2; }
done
(( FAIL_AT < STEPS )) || { echo "error: FAIL_AT=$FAIL_AT must come before STEPS=$STEPS" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "error: setting a node DOWN needs root (scontrol update NodeName=... State=DOWN): run it as root on the cluster's host" >&2; exit 2; }
command -v sbatch >/dev/null || { echo "error: no sbatch here: start the local cluster first (make cluster-up)" >&2; exit 2; }
mkdir -p "$OUT" "$ROOT/runs"
rm -f "$OUT"/ft-fail-*.out "$OUT"/ft-steady-*.out "$OUT"/l05-fail-*.out "$OUT/timeline.txt"  # this script's own
work=$(mktemp -d "$ROOT/runs/compare.XXXXXX")  # the jobs' own output: on the shared filesystem
jobs=() tails=() down=""

note() { echo "$EPOCHREALTIME $*" | tee -a "$OUT/timeline.txt"; }

node_state() { sinfo -h -n "$1" -o %T; }

resume_if_down() {  # whatever happened: a node this script set DOWN is not left so
    [[ -n $down ]] || return 0
    local state; state=$(node_state "$down")
    if [[ $state == *down* || $state == *drain* ]]; then
        scontrol update NodeName="$down" State=RESUME && note "RESUME $down (it was $state)"
    fi
    down=""
}

cleanup() {
    local status=$?
    resume_if_down
    for job in "${jobs[@]}"; do scancel "$job" 2>/dev/null || true; done
    sleep 1  # the copies catch up with the last lines
    for pid in "${tails[@]}"; do kill "$pid" 2>/dev/null || true; done
    (( status == 0 )) || echo "error: compare.sh stopped (status $status); the jobs' output is in $work" >&2
}
trap cleanup EXIT

# Submit a job whose output is $work/NAME-<id>.out, copied as it grows, each line stamped, to
# $OUT/NAME-<id>.out. The job id is left in SUBMITTED.
submit() {
    local name=$1 out; shift
    SUBMITTED=$(sbatch --parsable --output="$work/$name-%j.out" "$@")
    SUBMITTED=${SUBMITTED%%;*}
    jobs+=("$SUBMITTED")
    out=$name-$SUBMITTED.out
    tail -n +1 -F -s 0.1 "$work/$out" 2>/dev/null > >(while IFS= read -r line; do
        printf '%s %s\n' "$EPOCHREALTIME" "$line"; done >"$OUT/$out") &
    tails+=($!)
}

wait_for() {  # wait_for WHAT COMMAND...: until the command succeeds, or the guard runs out
    local what=$1 deadline=$((SECONDS + GUARD_S)); shift
    until "$@"; do
        (( SECONDS < deadline )) || { echo "error: no $what after $GUARD_S s" >&2; exit 1; }
        sleep 0.1
    done
}
has_line() { grep -Eq -- "$2" "$1" 2>/dev/null; }
lines_at_least() { (( $(grep -Ec -- "$2" "$1" 2>/dev/null) >= $3 )); }
job_state_is() { [[ $(squeue -h -j "$1" -o %T 2>/dev/null) == "$2" ]]; }
job_gone() { [[ -z $(squeue -h -j "$1" -o %T 2>/dev/null) ]]; }

# fail NODE JOB: the node set DOWN, then its state polled until Slurm has it back by itself
# (ReturnToService=2 and a slurmd that still runs); resumed by hand if it is not back in 60 s.
fail() {
    local node=$1 job=$2 state t_end
    down=$node
    note "DOWN $node (job $job on it)"
    scontrol update NodeName="$node" State=DOWN Reason=lesson11-compare
    t_end=$((SECONDS + 60))
    while state=$(node_state "$node"); [[ $state == *down* || $state == *drain* ]]; do
        (( SECONDS < t_end )) || break
        sleep 0.1
    done
    note "state of $node: $state"
    resume_if_down
}

run_ft() {  # run_ft RUN yes|no
    local run=$1 failure=$2 lh g0 g1
    exec 9>"$LOCK"
    flock -w "$GUARD_S" 9 || { echo "error: $LOCK stayed locked for $GUARD_S s" >&2; exit 1; }
    note "$run: lock taken"
    mkdir -p "$work/$run"
    export FT_DIR=$work/$run
    submit "$run-lighthouse" lessons/11_torchft/lighthouse.sh; lh=$SUBMITTED
    # As the README starts them: Slurm holds each group until the lighthouse's job has started.
    # Without group.sh's checkpoints (CKPT_EVERY=0): what is compared is torchft's heal against
    # lesson 05's restart, and a requeued group that loaded one would heal from its step, not 0.
    export CKPT_EVERY=0
    SUBSET=$SUBSET STEPS=$STEPS submit "$run-g0" --dependency=after:"$lh" \
        lessons/11_torchft/group.sh 0 --log-every 1
    g0=$SUBMITTED
    wait_for "group 0 running" job_state_is "$g0" RUNNING  # on the lighthouse's node
    SUBSET=$SUBSET STEPS=$STEPS submit "$run-g1" --dependency=after:"$lh" \
        lessons/11_torchft/group.sh 1 --log-every 1
    g1=$SUBMITTED
    if [[ $failure == yes ]]; then
        wait_for "group 0's step $FAIL_AT" has_line "$OUT/$run-g0-$g0.out" "\] step $FAIL_AT/"
        fail "$(squeue -h -j "$g1" -o %N)" "$g1"
    fi
    wait_for "group 0's end" job_gone "$g0"
    wait_for "group 1's end" job_gone "$g1"
    note "$run: job $g1 Restarts=$(scontrol show job -o "$g1" | grep -o 'Restarts=[0-9]*' | cut -d= -f2)"
    scancel "$lh"
    wait_for "the lighthouse's end" job_gone "$lh"
    flock -u 9
    note "$run: lock released"
}

run_l05() {
    local run=l05-fail job nodes
    exec 9>"$LOCK"
    flock -w "$GUARD_S" 9 || { echo "error: $LOCK stayed locked for $GUARD_S s" >&2; exit 1; }
    note "$run: lock taken"
    CHECKPOINT=$work/l05.pt SUBSET=$SUBSET submit "$run" --ntasks-per-node=1 \
        lessons/05_fault_tolerance/requeue.sh 2 --log-every 1
    job=$SUBMITTED
    wait_for "lesson 05's step $FAIL_AT" lines_at_least "$OUT/$run-$job.out" "^[0-9.]+ step " "$FAIL_AT"
    nodes=$(squeue -h -j "$job" -o %N)
    fail "$(scontrol show hostnames "$nodes" | tail -n 1)" "$job"
    wait_for "lesson 05's end" job_gone "$job"
    note "$run: job $job Restarts=$(scontrol show job -o "$job" | grep -o 'Restarts=[0-9]*' | cut -d= -f2)"
    flock -u 9
    note "$run: lock released"
}

note "SUBSET=$SUBSET STEPS=$STEPS FAIL_AT=$FAIL_AT"
run_ft ft-fail yes
run_l05
run_ft ft-steady no
sleep 1
"$ROOT/.venv/bin/python" "$ROOT/lessons/11_torchft/compare.py" "$OUT" | tee "$OUT/figures.txt"
