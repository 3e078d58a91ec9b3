#!/bin/bash
# Which process gets which signal, and when SIGKILL follows: five runs of signal_probe.sh at
# once, on the local cluster (from the course root, holding the cluster lock, as root: the
# urgent job takes all of node2, so nothing else may run there):
#     flock /tmp/course-cluster.lock bash lessons/05_fault_tolerance/signals/measure.sh
# A: plain scancel; B: the time limit (--time=1); C: --time=1 --signal=B:USR1@30;
# D: --time=1 --signal=USR1@30 (no B:); E: preempted by a job of partition urgent (GraceTime 30).
# The outputs go to runs/sig/, the heartbeats to runs/signal-probe/<jobid>.0/; this script's own
# output (the moments of scancel and of the urgent submission) is measure-<first jobid>.log here.
set -u
out=runs/sig
mkdir -p "$out"
now() { date +%s.%N; }
sub() { sbatch --parsable "$@" lessons/05_fault_tolerance/signal_probe.sh; }
A=$(sub -w node1 --output=$out/cancel-%j.out)
B=$(sub -w node1 --time=1 --output=$out/timelimit-%j.out)
C=$(sub -w node1 --time=1 --signal=B:USR1@30 --output=$out/warnB-%j.out)
D=$(sub -w node1 --time=1 --signal=USR1@30 --output=$out/warn-%j.out)
# E is requeued when preempted (signal_probe.sh has --requeue) and may run again before the
# end (cred_expire 10 s here): its second run appends to the first's output instead of
# truncating it.
E=$(sub -w node2 --open-mode=append --output=$out/preempt-%j.out)
echo "A=$A B=$B C=$C D=$D E=$E"
sleep 5
squeue
echo "scancel $A at $(now)"
scancel "$A"
sleep 2
echo "urgent at $(now)"
U=$(sbatch --parsable -p urgent -w node2 --exclusive --output=$out/urgent-%j.out --wrap 'sleep 3')
echo "U=$U"
for j in $A $B $C $D $E $U; do
    echo "$j $(scontrol show job "$j" | grep -oE 'StartTime=\S+|TimeLimit=\S+' | tr '\n' ' ')"
done
# B, C and D end at their time limit (60 s, checked about every 30 s) plus KillWait.
for i in $(seq 1 200); do
    left=$(squeue -h -j "$B,$C,$D" -t R,CG 2>/dev/null | wc -l)
    st=$(scontrol show job "$E" | grep -oE 'JobState=\S+|Restarts=\S+' | tr '\n' ' ')
    [[ $i == 20 || $i == 60 ]] && echo "E: $st"
    ((left == 0)) && break
    sleep 1
done
scontrol show job "$E" | grep -oE 'JobState=\S+|Restarts=\S+'
# E was requeued (PreemptMode=REQUEUE): it would run again.
scancel "$E" "$U" 2>/dev/null
for j in $A $B $C $D $E; do sacct -n -X -P -j "$j" -o JobID,State,ExitCode,Start,End; done
