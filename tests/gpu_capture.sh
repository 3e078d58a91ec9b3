#!/usr/bin/env bash
# The course's GPU path, run for real on one GPU machine that has no Slurm: each lesson's Python
# under `torchrun --standalone` (the launcher sets what srun would: RANK, LOCAL_RANK, WORLD_SIZE,
# MASTER_ADDR/PORT), NCCL as the backend, one process per GPU; what needs no launcher, as one
# plain process. Each run's output goes to OUTDIR/<name>.out after a header that says where and
# how it ran; the lessons keep them as their GPU samples (lessons/NN_*/gpu-<card>-*.out).
#
#   bash tests/gpu_capture.sh OUTDIR          # from the course root, the venv active
#   bash tests/gpu_capture.sh OUTDIR ddp-mnist preflight    # only the runs named
#
# Needs MNIST in data/mnist (python -m common.mnist_prepare) and a CUDA torch that sees a GPU.
set -uo pipefail
out=${1:?usage: bash tests/gpu_capture.sh OUTDIR [NAME...]}
shift
only=" $* "
mkdir -p "$out" || exit 2
py=${PYTHON:-python}
command -v "$py" >/dev/null || { echo "error: no '$py' on PATH: activate the venv or set PYTHON=<python>" >&2; exit 2; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
card=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
versions=$("$py" -c '
import torch, torchvision
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")')
pinned=$(grep -E '^torch==' requirements.txt)
echo "GPUs visible: $gpus (${card:-no nvidia-smi}); $versions"

# run NAME SECONDS COMMAND...: COMMAND's output (both streams) into OUTDIR/NAME.out.
run() {
    local name=$1 limit=$2 rc
    shift 2
    [[ $only == "  " || $only == *" $name "* ]] || return 0
    {
        echo "# GPU capture: $card; $versions (requirements.txt: $pinned)"
        echo "# one machine, no Slurm: the job script's Python, started as below (tests/gpu_capture.sh)"
        echo "# \$ $*"
    } >"$out/$name.out"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$out/$name.out" 2>&1
    rc=$?
    echo "# exit $rc after $((SECONDS - t0)) s" >>"$out/$name.out"
    printf '%-28s exit %3d  %4d s\n' "$name" "$rc" "$((SECONDS - t0))"
}

torchrun=${TORCHRUN:-torchrun}
tr=("$torchrun" --standalone --nproc-per-node 1)
tr2=("$torchrun" --standalone --nproc-per-node 2)
ckpt=$(mktemp -d)
trap 'rm -rf "$ckpt"' EXIT

# Lesson 01: one task per GPU, NCCL; then two processes on the one GPU (what the course refuses).
run sysinfo 60 "$py" -m common.sysinfo
run hello-allreduce 90 "${tr[@]}" lessons/01_hello_allreduce/hello_allreduce.py
# The same world built by hand (by_hand.py reads srun's variables: here those of a step of one
# task, set as srun would) and by torch.multiprocessing.spawn.
run by-hand 90 env SLURM_STEP_ID=0 SLURM_NODEID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 SLURM_NNODES=1 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 "$py" lessons/01_hello_allreduce/by_hand.py --init tcp
run spawn-warmup 90 "$py" lessons/01_hello_allreduce/spawn_warmup.py --nprocs 1
run two-ranks-one-gpu 90 env CUDA_VISIBLE_DEVICES=0 "${tr2[@]}" lessons/01_hello_allreduce/hello_allreduce.py
# What NCCL itself says of two ranks on one GPU, in a script without the course's check.
run nccl-two-ranks-one-gpu 120 env CUDA_VISIBLE_DEVICES=0 "${tr2[@]}" --no-python "$py" -c '
import datetime, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=60))
t = torch.ones(1, device="cuda")
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: all_reduce gave {t.item()}")
dist.destroy_process_group()'
# Lesson 02: the same hello under torchrun, the launcher that sets what srun would.
run launch-hello 90 "${tr[@]}" lessons/02_launch_vs_srun/hello.py
# Lesson 06: what NCCL_DEBUG=INFO prints (its version, network, communicators) ...
run nccl-debug-info 90 env NCCL_DEBUG=INFO "${tr[@]}" lessons/01_hello_allreduce/hello_allreduce.py
# ... the preflight, NCCL check included, and the all_reduce benchmark.
run step 90 "${tr[@]}" lessons/06_diagnosing_hangs/step.py
run preflight 120 "${tr[@]}" -m common.preflight
run allreduce-bench 120 "${tr[@]}" lessons/06_diagnosing_hangs/allreduce_bench.py --max-bytes 1G
# Lesson 03: DDP MNIST, the job's recipe (3 epochs): time to 99 % on a GPU.
run ddp-mnist 300 "${tr[@]}" lessons/03_ddp_mnist/train.py
run ddp-mnist-sync-bn 300 "${tr[@]}" lessons/03_ddp_mnist/train.py --epochs 1 --sync-bn
# Lesson 04: the job torchrun starts in the containers (synthetic data).
run torchrun-train 120 "${tr[@]}" lessons/04_torchrun_enroot/train.py
# Lesson 05: rank 0 crashes in epoch 2; torchrun starts it again, it resumes from the epoch-1
# checkpoint and NCCL's communicator is built anew.
run ft-crash-restart 300 "${tr[@]}" --max-restarts 1 lessons/05_fault_tolerance/train.py \
    --epochs 2 --crash-rank 0 --checkpoint "$ckpt/ft.pt"
# Lesson 07: FSDP2 in bf16, stopped after 600 steps with a sharded DCP checkpoint (as at a time
# limit), then the same run again, which resumes from it.
run fsdp-mnist 300 "${tr[@]}" lessons/07_fsdp_sharding/train.py --max-steps 600 --checkpoint-dir "$ckpt/fsdp"
run fsdp-mnist-resume 300 "${tr[@]}" lessons/07_fsdp_sharding/train.py --checkpoint-dir "$ckpt/fsdp"
# The sharded checkpoint, written from the GPU, as one file read in a plain CPU process.
run fsdp-export 120 "$py" lessons/07_fsdp_sharding/export.py "$ckpt/fsdp" --test-subset 2000
run fsdp-memory 180 "${tr[@]}" lessons/07_fsdp_sharding/memory.py
# Lesson 08: lesson 08's files, then its training with pinned memory, without and with workers.
[[ -d data/mnist-files/packed ]] || "$py" lessons/08_data_pipeline/mnist_files.py >/dev/null
run loader-workers0 300 "${tr[@]}" lessons/08_data_pipeline/train.py --workers 0
run loader-workers4 300 "${tr[@]}" lessons/08_data_pipeline/train.py --workers 4
# Lesson 09: one GPU holds the whole model (tp 1, one pipeline stage): the DTensor and pipeline
# code on CUDA with NCCL, with nothing to split.
run tp 120 "${tr[@]}" lessons/09_beyond_data_parallel/tp.py --count-comms --steps 50
run pp 120 "${tr[@]}" lessons/09_beyond_data_parallel/pp.py --steps 20
