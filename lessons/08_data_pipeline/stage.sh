#!/bin/bash
# Copy one form of lesson 08's dataset from the shared filesystem to every node's local disk,
# once per node, from the batch script of a job (job.sh):
#
#   bash stage.sh <packed|folder> <from: the shared folder> <to: a node-local folder> [sbcast|srun]
#
# sbcast (Slurm's own tool) reads each file once, on the node running this script, and sends it
# to the job's nodes over Slurm's own connections; "srun" starts one cp per node instead, and
# every node reads the shared filesystem. The folder form travels as one archive (folder.tar,
# written by mnist_files.py) and is unpacked on each node: 70,000 small files are cheap to make
# on a local disk and costly to read one by one from a parallel filesystem.
set -euo pipefail

usage="usage: stage.sh <packed|folder> <shared folder> <node-local folder> [sbcast|srun]"
[[ $# -ge 3 && $# -le 4 ]] || { echo "error: $usage" >&2; exit 2; }
form=$1 src=$2 dest=$3 how=${4:-sbcast}
case $form in
packed) files=(packed/train-images.npy packed/train-labels.npy packed/test-images.npy packed/test-labels.npy) ;;
folder) files=(folder.tar) ;;
*) echo "error: unknown form '$form': packed or folder ($usage)" >&2; exit 2 ;;
esac
[[ $how == sbcast || $how == srun ]] || { echo "error: unknown copy method '$how': sbcast or srun ($usage)" >&2; exit 2; }
[[ -n ${SLURM_JOB_ID:-} ]] || { echo "error: SLURM_JOB_ID is not set: stage.sh runs inside a job (job.sh calls it)" >&2; exit 2; }
for f in "${files[@]}"; do
    [[ -r $src/$f ]] || { echo "error: $src/$f not found: prepare the files once, on the login node: PYTHONPATH=. python lessons/08_data_pipeline/mnist_files.py" >&2; exit 2; }
done

# One task per node, one CPU each, sharing the job's CPUs with whatever else runs.
per_node=(srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1
    --cpus-per-task=1 --overlap)
start=$EPOCHREALTIME
# The destination is this job's own folder (local_copy.sh names it after the job): made with mode
# 700, so that where every job and user of a node shares /tmp nobody else reads or changes it.
# A second call of the same job finds it made (mkdir first, then the check: where the nodes share
# the folder, another node of this job may make it in between); one that anybody else made is
# refused.
# shellcheck disable=SC2016  # $1 is expanded by the bash on each node
"${per_node[@]}" bash -c 'mkdir -m 700 "$1" 2>/dev/null || [[ -d $1 && ! -L $1 && -O $1 ]] || {
    echo "error: $(hostname): cannot make this job'\''s folder $1 ($(ls -ld "$1" 2>&1)): set SLURM_TMPDIR to a folder of yours on the node'\''s local disk" >&2; exit 2; }
    mkdir -p "$1/packed"' _ "$dest"
for f in "${files[@]}"; do
    if [[ $how == sbcast ]]; then
        sbcast --force "$src/$f" "$dest/$f"
    else
        "${per_node[@]}" cp "$src/$f" "$dest/$f"
    fi
done
if [[ $form == folder ]]; then
    # shellcheck disable=SC2016  # $1 is expanded by the bash on each node
    "${per_node[@]}" bash -c 'tar -xf "$1/folder.tar" -C "$1" && rm "$1/folder.tar"' _ "$dest"
fi
bytes=$(du -cb "${files[@]/#/$src/}" | tail -n 1 | cut -f 1)
seconds=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
echo "staged $form ($(( bytes / 1000000 )) MB) from $src to $dest on $SLURM_JOB_NUM_NODES node(s) with $how in $seconds s"
