#!/bin/bash
# A preempted job that ends by itself within the grace time: is it requeued? (It is not, on
# Slurm 22.05: it ends COMPLETED with Restarts=0.) From the course root, holding the cluster
# lock, as root (the urgent job takes all of node1):
#     flock /tmp/course-cluster.lock bash lessons/05_fault_tolerance/signals/early_exit.sh
# The victim runs in partition local (GraceTime 30 s, PreemptMode=REQUEUE); its task exits 0
# on SIGTERM at once and the batch script then exits 0. Output: early-exit-<victim id>.log here.
set -u
here=lessons/05_fault_tolerance/signals
out=runs/early-exit
mkdir -p "$out"
t() { date -u '+%T.%N' | cut -c1-12; }
cat >"$out/victim.sh" <<'EOF'
#!/bin/bash
#SBATCH --job-name=early-exit --nodes=1 --nodelist=node1 --exclusive --time=00:10:00
t() { date -u '+%T.%N' | cut -c1-12; }
echo "$(t) run ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID in partition $SLURM_JOB_PARTITION"
# shellcheck disable=SC2016  # expanded by the task's shell
srun bash -c 't() { date -u "+%T.%N" | cut -c1-12; }
              trap "echo \"\$(t) task: SIGTERM, exiting 0 now\"; exit 0" TERM
              echo "$(t) task: running"; while true; do sleep 0.2; done'
echo "$(t) batch script: srun ended with $?; the job exits 0"
EOF
{
    echo "$(t) partition local: $(scontrol show partition local -o | grep -oE 'GraceTime=[0-9]+')," \
         "$(scontrol show config | grep -E '^PreemptMode' | tr -s ' ')"
    v=$(sbatch --parsable --output="$out/victim-%j.out" "$out/victim.sh"); v=${v%%;*}
    echo "$(t) submitted victim $v"
    for _ in $(seq 120); do
        grep -q "task: running" "$out/victim-$v.out" 2>/dev/null && break
        sleep 0.5
    done
    # shellcheck disable=SC2016  # expanded in the urgent job
    u=$(sbatch --parsable --partition=urgent --nodes=1 --nodelist=node1 --exclusive \
        --job-name=urgent --output="$out/urgent-%j.out" --wrap 'echo "$(date -u +%T) urgent job on $(hostname)"')
    u=${u%%;*}
    echo "$(t) submitted urgent $u"
    last=
    final=0
    # Up to a minute: long enough for a requeue to show (Restarts=1). Slurm requeues a job when
    # it ends, before it would show COMPLETED; once COMPLETED (or another final state) has held
    # for 5 s, nothing will requeue it.
    for _ in $(seq 120); do
        s=$(scontrol show job -o "$v" 2>/dev/null | grep -oE '(JobState|Restarts|ExitCode)=\S+' | tr '\n' ' ')
        [[ -n $s && $s != "$last" ]] && echo "$(t) victim: $s" && last=$s
        if [[ $s =~ JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|PREEMPTED) ]]; then
            ((++final >= 10)) && break
        else
            final=0
        fi
        sleep 0.5
    done
    echo "== victim-$v.out"; cat "$out/victim-$v.out"
    echo "== urgent-$u.out"; cat "$out/urgent-$u.out"
    echo "== sacct"
    sacct -j "$v,$u" --duplicates --format=JobID,JobName,Partition,State,ExitCode,Start,End
} >"$out/log" 2>&1
cp "$out/log" "$here/early-exit-$v.log"
cat "$here/early-exit-$v.log"
