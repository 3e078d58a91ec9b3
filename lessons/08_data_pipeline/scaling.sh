#!/bin/bash
# Lesson 08's scaling study: training throughput at 1, 2 and 4 ranks, on 1 and 2 nodes, for a
# fixed global batch (strong scaling) and a fixed batch per rank (weak scaling). Each case is
# one srun step of this allocation running train.py for STEPS steps; plot_scaling.py turns this
# job's output into a table and a plot. Run the same script on your cluster to get your own.
#
#   sbatch lessons/08_data_pipeline/scaling.sh               # from the course root
#   STEPS=100 GLOBAL_BATCH=512 RANK_BATCH=128 sbatch lessons/08_data_pipeline/scaling.sh
#   SHAPES="1x1 2x2" MODES=weak sbatch ...                  # some of the cases only
# At the end it prints the table and writes the plot, scaling-<jobid>.png, beside its output
# file (plot_scaling.py; run it again on scaling-<jobid>.out any time).
#
#SBATCH --job-name=scaling
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out        # scaling-<jobid>.out
set -euo pipefail

COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
LESSON=$COURSE_ROOT/lessons/08_data_pipeline
SHARED_DATA=${MNIST_FILES:-$COURSE_ROOT/data/mnist-files}
course_need_file "$SHARED_DATA/folder.tar" "prepare the files once, on the login node: PYTHONPATH=. python lessons/08_data_pipeline/mnist_files.py" || exit 2
STEPS=${STEPS:-40}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
RANK_BATCH=${RANK_BATCH:-64}
SHAPES=${SHAPES:-1x1 1x2 2x1 2x2}  # nodes x ranks per node
MODES=${MODES:-strong weak}
for shape in $SHAPES; do
    [[ $shape =~ ^[12]x[12]$ ]] || { echo "error: SHAPES has '$shape': each shape is <nodes>x<ranks per node>, 1 or 2 each (e.g. SHAPES=\"1x1 2x2\")" >&2; exit 2; }
done
for mode in $MODES; do
    [[ $mode == strong || $mode == weak ]] || { echo "error: MODES has '$mode': strong or weak" >&2; exit 2; }
done
for v in STEPS GLOBAL_BATCH RANK_BATCH; do
    [[ ${!v} =~ ^[0-9]+$ && ${!v} -ge 6 ]] || { echo "error: $v='${!v}' must be a whole number >= 6" >&2; exit 2; }
done
echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST, $(sinfo --version), $STEPS steps per case"
# The load of the machine when the study starts: other work on the nodes skews every figure.
echo "SCALING host_cpus=$(nproc --all) load_1min=$(cut -d " " -f 1 /proc/loadavg) gpus_per_node=${SLURM_GPUS_ON_NODE:-0} steps=$STEPS"

# shellcheck source=lessons/08_data_pipeline/local_copy.sh
source "$LESSON/local_copy.sh"  # LOCAL_DATA: this job's folder on each node, removed at the end
DATA=$LOCAL_DATA
bash "$LESSON/stage.sh" packed "$SHARED_DATA" "$DATA" sbcast
RESULTS=$DATA/results.txt  # this job's lines, for the table at the end (removed with the data)
export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
# 1 rank; 2 ranks on one node; 2 ranks on two nodes; 4 ranks.
for shape in $SHAPES; do
    nodes=${shape%x*} per_node=${shape#*x}
    for mode in $MODES; do
        batch=(--batch-size "$GLOBAL_BATCH")
        [[ $mode == weak ]] && batch=(--per-rank-batch "$RANK_BATCH")
        echo "SCALING mode=$mode nodes=$nodes ranks_per_node=$per_node" | tee -a "$RESULTS"
        srun --nodes="$nodes" --ntasks-per-node="$per_node" --ntasks=$((nodes * per_node)) \
            python "$LESSON/train.py" --data-dir "$DATA" --form packed --max-steps "$STEPS" \
            --no-eval "${batch[@]}" "$@" | tee -a "$RESULTS"
    done
done
# The plot goes beside this job's output file: scaling-<jobid>.out -> scaling-<jobid>.png.
out=$(scontrol show job --oneliner "$SLURM_JOB_ID" | sed -n 's/.*StdOut=\([^ ]*\).*/\1/p')
python "$LESSON/plot_scaling.py" "$RESULTS" --title "scaling-$SLURM_JOB_ID" --png "${out%.out}.png"
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished"
