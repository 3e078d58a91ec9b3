#!/bin/bash
# Lesson 11: one replica group of torchft training, as a job of its own.
#
# A group must be able to fail and be replaced alone: in one job, Slurm would end every step
# of the job when one node fails. So each group is a job, on its node, and the lighthouse
# (lighthouse.sh) tells the groups about one another. Start the lighthouse, then the groups,
# which Slurm keeps pending until the lighthouse's job has started (--dependency=after):
#
#   lh=$(sbatch --parsable lessons/11_torchft/lighthouse.sh) && echo "lighthouse: job $lh"
#   sbatch --dependency=after:$lh lessons/11_torchft/group.sh 0    # group 0 of 2
#   sbatch --dependency=after:$lh lessons/11_torchft/group.sh 1    # group 1 of 2, another node
#   scancel --signal=KILL <group 1's job>.0        # its training killed; group 0 trains on alone
#   sbatch lessons/11_torchft/group.sh 1           # its replacement heals from group 0
#   scancel <group 1's job>                        # SIGTERM: the group saves and leaves
#   SUBSET=4096 STEPS=500 sbatch lessons/11_torchft/group.sh 0   # quicker: fewer images, steps
#   sbatch --ntasks=2 lessons/11_torchft/group.sh 0    # a group of 2 ranks, the model sharded
#
# A job of one task runs train_ft.py (a group is one process); a job of several tasks (one per
# GPU: --ntasks=<GPUs in all> --gres=gpu:<a node's GPUs>, with --nodes=N for N nodes; not
# --ntasks-per-node, which this header's --ntasks=1 overrides) runs train_ft_fsdp.py, whose
# ranks shard the model inside the group (FSDP2) while torchft averages across groups.
# Arguments: the group's index, then train_ft.py's own (--batch-size, --lr ...). With
# --slow-factor F (lesson 12), a group whose node computes F times slower than the other groups'
# leaves (status 3), and this script submits its replacement, without that node. A group that
# starts on a node where another group of the run runs does the same before it trains.
# FT_GROUPS (default 2): how many groups share the data. STEPS (default 2000): the quorum's
# last step. SUBSET=N: only the first N training images.
# FT_DIR: a folder every node mounts (default <course>/runs/torchft), where the lighthouse writes
# "<its address> <its job id>" and the groups keep groups/ (each one's nodes) and checkpoints/:
# the quorum's first group writes one every CKPT_EVERY steps (default 100; 0: none), and a
# group that starts loads the newest, so a run whose groups all ended goes on from there (a new
# run: a new FT_DIR, or remove checkpoints/). The group takes the address once squeue shows
# that job running, waiting up to FT_WAIT_S seconds (default 30: a lighthouse still starting, a
# shared filesystem slow to show the file). Or TORCHFT_LIGHTHOUSE=http://<host>:<port> names
# it directly.
#
#SBATCH --job-name=ft-group
#SBATCH --nodes=1
#SBATCH --ntasks=1                 # one process per group here; --ntasks=N: a group of N ranks
#SBATCH --gres=gpu:2               # all of a local node's GPUs: one group per node, so a node lost is one group (nodes of more GPUs: --gres=gpu:<all>, or a group that shares a node moves: below)
#SBATCH --cpus-per-task=2
#SBATCH --mem=4G
#SBATCH --time=00:30:00
#SBATCH --requeue                  # a node failure puts the group back in the queue, also where the site's default is JobRequeue=0
#SBATCH --open-mode=append         # a run Slurm requeued (its node failed) adds to the same file
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

FT_GROUP=${1:-${FT_GROUP:-}}
(( $# )) && shift  # what is left in "$@" goes on to train_ft.py
train_args=("$@")  # given again, as they were, to a replacement on another node (below)
GROUPS_N=${FT_GROUPS:-2}
[[ $GROUPS_N =~ ^[1-9][0-9]*$ ]] || { echo "error: FT_GROUPS='$GROUPS_N' is not a whole number of groups >= 1: e.g. FT_GROUPS=2" >&2; exit 2; }
[[ $FT_GROUP =~ ^[0-9]+$ && $FT_GROUP -lt $GROUPS_N ]] || { echo "error: the group index '$FT_GROUP' is not one of 0..$((GROUPS_N - 1)): pass it first (sbatch lessons/11_torchft/group.sh 0), and FT_GROUPS=N for N groups" >&2; exit 2; }
STEPS=${STEPS:-2000}
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "error: STEPS='$STEPS' is not a whole number of steps >= 1: e.g. STEPS=2000" >&2; exit 2; }
course_subset || exit 2
[[ -n ${SUBSET:-} ]] && set -- --train-subset "$SUBSET" "$@"
FT_DIR=${FT_DIR:-$COURSE_ROOT/runs/torchft}
CKPT_EVERY=${CKPT_EVERY:-100}
[[ $CKPT_EVERY =~ ^[0-9]+$ ]] || { echo "error: CKPT_EVERY='$CKPT_EVERY' is not a whole number of steps: e.g. CKPT_EVERY=100, or 0 for no checkpoints" >&2; exit 2; }
script=train_ft.py ranks_option=""
if ((${SLURM_NTASKS:-1} > 1)); then
    # Several ranks: train_ft_fsdp.py; each rank writes its own shards of the checkpoints.
    script=train_ft_fsdp.py ranks_option="--ntasks=$SLURM_NTASKS"
fi
((CKPT_EVERY == 0)) || set -- --ckpt-dir "$FT_DIR/checkpoints" --ckpt-every "$CKPT_EVERY" "$@"

# A group that must leave its nodes goes on as a new job (a running job's ExcNodeList cannot be
# changed: lesson 12's job.sh says why) that asks for what this job got (its size, and
# course_same_request's options: common/job_env.sh), given what this job was given (--export: a
# site's default may be --export=NONE), and its output in a file named as this job's.
# avoided: the nodes in $1 and those this job already avoided; nodes_left: the partition's
# nodes without those in $1.
avoided() {
    local before
    before=$(scontrol show job -o "$SLURM_JOB_ID" | sed -n 's/.* ExcNodeList=\([^ ]*\) .*/\1/p')
    [[ $before == "(null)" ]] && before=
    scontrol show hostnames "${before:+$before,}$1" | sort -u | paste -sd,
}
nodes_left() {
    sinfo -h -N -p "$SLURM_JOB_PARTITION" -o %N | sort -u | grep -cvxF -f <(tr , '\n' <<<"$1") || true
}
replace() {
    local record out base request same
    record=$(scontrol show job -o "$SLURM_JOB_ID")
    out=$(sed -n 's/.* StdOut=\([^ ]*\).*/\1/p' <<<"$record")
    base=${out##*/}  # its file name: this job's id there becomes the new job's (%j)
    request=$(course_same_request)  # also what sbatch's command line gave, not kept with the script
    mapfile -t same <<<"$request"
    [[ $lighthouse_job == given ]] || unset TORCHFT_LIGHTHOUSE  # the replacement reads the file
    sbatch --parsable --exclude="$1" --nodes="$SLURM_NNODES" --ntasks="${SLURM_NTASKS:-1}" "${same[@]}" \
        --export="ALL,FT_GROUPS=$GROUPS_N,STEPS=$STEPS,FT_DIR=$FT_DIR,CKPT_EVERY=$CKPT_EVERY${SUBSET:+,SUBSET=$SUBSET}" \
        ${out:+--output="${out%/*}/${base//$SLURM_JOB_ID/%j}"} \
        "$COURSE_ROOT/lessons/11_torchft/group.sh" "$FT_GROUP" "${train_args[@]}"
}

# The lighthouse's address: given, or the one in the file its job writes, once squeue shows that
# job running (an address whose job has ended would only fail later, in train_ft.py's check).
FT_WAIT_S=${FT_WAIT_S:-30}
[[ $FT_WAIT_S =~ ^[0-9]+$ ]] || { echo "error: FT_WAIT_S='$FT_WAIT_S' is not a whole number of seconds: e.g. FT_WAIT_S=30" >&2; exit 2; }
lighthouse_job="given"
if [[ -z ${TORCHFT_LIGHTHOUSE:-} ]]; then
    file=$FT_DIR/lighthouse line="" address="" lighthouse_job="" state=""
    for ((i = 0; i <= FT_WAIT_S * 5; i++)); do
        ((i == 0)) || sleep 0.2
        line=$(cat "$file" 2>/dev/null) || continue
        read -r address lighthouse_job <<<"$line" || true
        [[ -n $lighthouse_job ]] || continue
        state=$(squeue -h -j "$lighthouse_job" -o %T 2>&1 | head -n 1) || true
        [[ $state == RUNNING ]] && break
    done
    if [[ -z $address ]]; then
        echo "error: no lighthouse address in $file after $FT_WAIT_S s: start it first (sbatch lessons/11_torchft/lighthouse.sh), with the same FT_DIR, or export TORCHFT_LIGHTHOUSE=http://<host>:<port>" >&2
        exit 2
    elif [[ -z $lighthouse_job ]]; then
        echo "error: $file holds '$address' and no job id (lighthouse.sh writes '<address> <job id>'): start the lighthouse with lighthouse.sh and the same FT_DIR, or export TORCHFT_LIGHTHOUSE=http://<host>:<port>" >&2
        exit 2
    elif [[ $state != RUNNING ]]; then
        echo "error: $file names $address of lighthouse job $lighthouse_job, which is not running (squeue: ${state:-no answer}) after $FT_WAIT_S s: start a lighthouse (sbatch lessons/11_torchft/lighthouse.sh) with the same FT_DIR, or export TORCHFT_LIGHTHOUSE=http://<host>:<port>" >&2
        exit 2
    fi
    TORCHFT_LIGHTHOUSE=$address
fi
# torchft's own (Rust) log lines: warnings and errors only (RUST_LOG; its default is every
# quorum of every step).
export TORCHFT_LIGHTHOUSE FT_GROUP RUST_LOG=${RUST_LOG:-warn}

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) run ${SLURM_RESTART_COUNT:-0} on $SLURMD_NODENAME:" \
     "group $FT_GROUP of $GROUPS_N, lighthouse $TORCHFT_LIGHTHOUSE (job $lighthouse_job)"
# One node lost must end one group: this header's --gres=gpu:2 is all of a local node's GPUs,
# but on nodes of 4 or 8 GPUs two groups fit on one node. Each group notes its nodes in FT_DIR,
# under a lock so that of two groups starting together the second sees the first, and a group
# that finds a running group of the run on one of its nodes moves: its replacement is a new job
# without those nodes (replace, below), and this one ends before it joins the training.
mkdir -p "$FT_DIR/groups"
exec 9>>"$FT_DIR/groups/.lock"
flock -w 30 9 || echo "warning: no lock on $FT_DIR/groups/.lock (flock: a filesystem without locks?): two groups starting together may not see each other" >&2
mine=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
echo "$SLURM_JOB_ID $SLURM_JOB_NODELIST" >"$FT_DIR/groups/$FT_GROUP"
shared="" other=""
for file in "$FT_DIR"/groups/[0-9]*; do
    [[ ${file##*/} == "$FT_GROUP" ]] && continue
    read -r job nodes <"$file" || continue
    [[ $(squeue -h -j "$job" -o %T 2>/dev/null) == RUNNING ]] || continue
    on=$(grep -xF -f <(scontrol show hostnames "$nodes") <<<"$mine" | paste -sd,) || true
    [[ -n $on ]] && shared=${shared:+$shared,}$on other="group ${file##*/} (job $job)"
done
if [[ -n $shared ]]; then
    excluded=$(avoided "$shared")
    if (($(nodes_left "$excluded") >= SLURM_NNODES)); then
        next=$(replace "$excluded")
        rm -f "$FT_DIR/groups/$FT_GROUP"  # the replacement writes its own
        echo "=== $(date -u '+%T') $other runs on $shared too, where a node lost would end both groups: group $FT_GROUP goes on as job $next, without $excluded"
        exit 0
    fi
    echo "warning: $other runs on $shared too: a node lost would end both groups, and partition $SLURM_JOB_PARTITION has no other node for this one; training on. Give each group all of a node's GPUs (sbatch --gres=gpu:<a node's GPUs> ${ranks_option:+$ranks_option }lessons/11_torchft/group.sh $FT_GROUP), or more nodes" >&2
fi
exec 9>&-
# scancel and the time limit send SIGTERM to this shell as well as to the tasks (a preemption
# first to the tasks alone): train_ft.py leaves between two steps, saves and ends with status
# 75. Trapped here so that this shell waits for that rather than end first, and knows it.
terminated=""
trap 'terminated=yes' TERM
status=0
# --kill-on-bad-exit: a rank that dies ends the group's other ranks at once (they would wait in
# the group's collectives until their timeout); the other groups go on without this one.
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python "$COURSE_ROOT/lessons/11_torchft/$script" --group "$FT_GROUP" --groups "$GROUPS_N" --steps "$STEPS" "$@" || status=$?
if ((status == 0)); then
    # srun ends with 0 also when Slurm ended the step itself (the node failed): then the job
    # has been requeued (its Restarts went up), and the training did not finish.
    read -r state restarts <<<"$(course_job_state)"
    if ((${restarts:-0} > ${SLURM_RESTART_COUNT:-0})); then
        echo "=== $(date -u '+%T') job $SLURM_JOB_ID was requeued by Slurm (JobState=$state, Restarts=$restarts: its node failed): it runs again and heals from the live groups"
        exit 0
    fi
    echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished"
fi
if ((status > 128 && ${SLURM_NTASKS:-1} > 1)) && [[ -z $terminated ]]; then
    # srun's status is the highest signal among its tasks' ends (_task_finish in Slurm's
    # src/srun/launch.c): a rank that died, and the others ended by --kill-on-bad-exit (its
    # SIGTERM, or SIGKILL after KillWait for a rank that waits on the dead one), give 143 as a
    # SIGTERM to the job would, or 137. This shell got no SIGTERM: a rank failed.
    echo "=== $(date -u '+%T') a rank of group $FT_GROUP failed (srun's lines above) and srun ended the others: job $SLURM_JOB_ID ends here, the other groups go on. To bring the group back: sbatch $ranks_option lessons/11_torchft/group.sh $FT_GROUP${train_args[*]:+ ${train_args[*]}}"
    exit 1
fi
if ((status == 75 || status == 143)); then
    # The group left on SIGTERM (143: before train_ft.py set its handler). Within a preemption's
    # grace time the job still runs: requeued here (Slurm 22.05 does not requeue a job that ends
    # within it; 24.05 and later do it themselves, which this sees). After a cancel or at the
    # time limit it ends, and says how to bring the group back (common/job_env.sh).
    course_requeue_or_end "$status" "heals from the live groups (or resumes from $FT_DIR/checkpoints)" \
        "sbatch ${ranks_option:+$ranks_option }lessons/11_torchft/group.sh $FT_GROUP${train_args[*]:+ ${train_args[*]}}"
fi
((status == 3)) || exit "$status"

# Status 3: train_ft.py --slow-factor found this group's node slow (lesson 12), and the group
# left the quorum. Its replacement avoids this node and the nodes this job already avoided, and
# heals from the live groups: no checkpoint, no dependency on this job.
excluded=$(avoided "$SLURMD_NODENAME")
if (($(nodes_left "$excluded") < SLURM_NNODES)); then
    echo "error: without $excluded, partition $SLURM_JOB_PARTITION has too few nodes for group $FT_GROUP: not resubmitted. Ask the site to look at $SLURMD_NODENAME; the other groups go on: sbatch --exclude=$excluded ${ranks_option:+$ranks_option }lessons/11_torchft/group.sh $FT_GROUP ${train_args[*]}" >&2
    exit 3
fi
next=$(replace "$excluded")
echo "=== $(date -u '+%T') moved off $SLURMD_NODENAME: group $FT_GROUP goes on as job $next, without $excluded"
exit 3
