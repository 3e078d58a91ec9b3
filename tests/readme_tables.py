"""The READMEs' commands, table by table: which class each falls into and why.

A command is found by its text as a student types it (tests/readme_commands.py reads them).
``QUICK``: run as written by ``make test-readme`` (tests/test_readme_commands.py), each checked by
what its README quotes of its output (tests/readme_output.py). ``AS_WRITTEN_BY``: run or
submitted as written by another test, in its lane; tests/confirm_readme.py confirms each from the
records of a run (tests/records.py). ``NOT_RUN``: why not, and the test that runs the same
command with what it needs (a job's id, a temporary folder), which confirm_readme confirms the
same way. ``JOB_ENDS``: the jobs a README shows ending otherwise than COMPLETED. Marks (``# GPU
only``...) skip the rest.
"""

# Marks (a comment at the end of a line, or a block's first line for all of its commands).
GPU_ONLY = "GPU only"
OTHER_SITE = "at your site"
INSIDE_JOB = "inside a job"
JOB_SCRIPT = "in the job script"  # a block's first line only
MARKS = (GPU_ONLY, OTHER_SITE, INSIDE_JOB)
SKIPPED = {GPU_ONLY: "GPU only", OTHER_SITE: "needs another site", JOB_SCRIPT: "job script lines"}

IPYKERNEL = ('.venv/bin/python -m ipykernel install --user --name slurm-ddp-course '
             '--display-name "Python (slurm-ddp-course)"')

# Commands that finish in seconds, run as written: command -> expected exit status.
QUICK = {
    "source .venv/bin/activate": 0,
    "srun --nodes 2 --ntasks-per-node 2 python -m common.env": 0,
    "wc -l lessons/03_ddp_mnist/train.py $(sed -n 's|^from common\\.\\([a-z_]*\\) import.*|"
    "common/\\1.py|p' lessons/03_ddp_mnist/train.py)": 0,
    "sinfo": 0,
    "scontrol show node node2 | grep -E 'State|Reason'": 0,
    "tail -n 50 /var/lib/course-cluster/log/slurmd-node2.log": 0,
    "tail -n 50 /var/lib/course-cluster/log/slurmctld.log": 0,
    "salloc --nodes=2 --ntasks-per-node=1 --time=1 bash -c 'echo \"allocation $SLURM_JOB_ID: "
    "$SLURM_JOB_NODELIST\"; srun bash lessons/00_slurm_basics/whoami.sh'": 0,
    "srun --ntasks=3 bash lessons/00_slurm_basics/whoami.sh": 0,
    'sinfo -o "%P %N %G %f %c %m"': 0,
    # The lesson shows both refused: "allocation failure".
    "sbatch --test-only --gres=gpu:a100:2 --wrap=true": 1,
    "sbatch --test-only --constraint=a100 --wrap=true": 1,
    "python lessons/01_hello_allreduce/spawn_warmup.py --nprocs 2 --steps 3": 0,
    # The lesson shows the failure's exit status with echo, so the line itself ends with 0.
    'python lessons/01_hello_allreduce/hello_allreduce.py --nprocs 2 --break-rank 1; '
    'echo "exit $?"': 0,
    'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 python -m common.sysinfo': 0,
    "python -m common.mnist_prepare": 0,
    "python lessons/08_data_pipeline/mnist_files.py": 0,
    # About 20 s: an epoch of 4,096 images, then the whole test set.
    "python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 4096": 0,
    # About 13 s of training.
    "torchrun --standalone --nproc-per-node 2 lessons/04_torchrun_enroot/train.py": 0,
    # Writes the kernel where JUPYTER_DATA_DIR says: a temporary folder here (QUICK_TMP_ENV).
    IPYKERNEL: 0,
    # About 10 s: three estimates, nothing allocated.
    "python lessons/10_fit_and_keep/fit.py": 0,
    # About 20 s: 200 steps of 4 processes.
    "torchrun --standalone --nproc-per-node 4 lessons/12_sick_node/train.py --steps 200 "
    "--train-subset 4096": 0,
}

# Commands that write outside the course: the variable that moves that place, set to a temporary
# folder for the run.
QUICK_TMP_ENV = {IPYKERNEL: "JUPYTER_DATA_DIR"}

CRASHED = ("tests/test_lesson05.py::"
           "test_crashed_rank_restarted_then_faulty_node_named_then_excluded")
FSDP_JOB = "tests/test_lesson07.py::test_job_saves_on_2_nodes_requeues_and_resumes_on_1"
UP_DOWN = "tests/test_cluster.py::test_up_is_idempotent_and_down_leaves_nothing"
TORCHFT_JOBS = ("tests/test_lesson11_cluster.py::"
                "test_a_group_whose_node_fails_is_requeued_and_heals_bit_for_bit")
TORCHFT_CRASH = ("tests/test_lesson11_cluster.py::"
                 "test_a_crashed_node_is_found_by_timeouts_and_its_group_heals")
TORCHFT_RANKS = ("tests/test_lesson11_cluster.py::"
                 "test_groups_of_two_ranks_heal_each_shard_from_the_peer_rank")
KEEP_JOB = "tests/test_lesson10.py::test_keep_job"
SICK_MOVE = ("tests/test_lesson12.py::"
             "test_a_slowed_node_is_named_and_the_job_finishes_without_it")
SICK_NOWHERE = "tests/test_lesson12.py::test_with_no_node_to_move_to_the_job_says_so"
SICK_FT = ("tests/test_lesson12.py::"
           "test_a_torchft_group_on_a_slowed_node_leaves_and_is_replaced_elsewhere")

# Commands that a test under tests/ runs or submits as written: command -> that test (file::
# function, or a file for all of its tests). A job may be shortened there by the variables its
# script's header offers for that (SHORTER), nothing else; it must end COMPLETED (or as JOB_ENDS
# says), any other command exit 0. Not run by the README test: skipped, naming the test and its
# lane; tests/confirm_readme.py finds the run in that test's records.
AS_WRITTEN_BY = {
    "make demo": "tests/test_demo.py::test_make_demo",
    "sbatch lessons/00_slurm_basics/busy.sh":
        "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel",
    "sbatch lessons/01_hello_allreduce/job.sh":
        "tests/test_lesson01.py::test_job_script_on_local_cluster",
    "sbatch lessons/01_hello_allreduce/by_hand.sh":
        "tests/test_lesson01.py::test_by_hand_job_on_local_cluster",
    "sbatch lessons/01_hello_allreduce/job_task_per_gpu.sh":
        "tests/test_lesson01.py::test_job_script_on_local_cluster",
    "sbatch lessons/02_launch_vs_srun/launch_nproc2.sh":
        "tests/test_lesson02.py::test_job_script_on_local_cluster",
    "sbatch lessons/02_launch_vs_srun/job.sh":
        "tests/test_lesson02.py::test_job_script_on_local_cluster",
    "sbatch lessons/03_ddp_mnist/job.sh": "tests/test_demo.py::test_make_demo",
    "sbatch lessons/03_ddp_mnist/job.sh 1":
        "tests/test_cluster_student.py::test_student_runs_lesson03_from_own_copy",
    "CHECKPOINT=checkpoints/mine.pt sbatch lessons/03_ddp_mnist/job.sh":
        "tests/test_cluster_student.py::test_student_runs_lesson03_readme_then_stops_and_resumes",
    "SUBSET=2048 sbatch lessons/03_ddp_mnist/job.sh":
        "tests/test_lesson03.py::test_quick_first_run_as_the_readme_types_it",
    "sbatch lessons/04_torchrun_enroot/run_script.sh": "tests/test_lesson04.py::test_static_job",
    "ENROOT_DRY_RUN=1 sbatch lessons/04_torchrun_enroot/run_script.sh":
        "tests/test_lesson04.py::test_container_branch_prints_the_enroot_commands",
    "sbatch lessons/04_torchrun_enroot/run_charliecloud.sh": "tests/test_lesson04_charliecloud.py::"
        "test_torchrun_in_charliecloud_with_torch_only_in_the_image",
    "sbatch lessons/05_fault_tolerance/requeue.sh":
        "tests/test_lesson05.py::test_warning_then_preemption_then_resume",
    "sbatch lessons/05_fault_tolerance/preempt.sh":
        "tests/test_lesson05.py::test_warning_then_preemption_then_resume",
    "sbatch lessons/05_fault_tolerance/chain.sh":
        "tests/test_lesson05.py::test_chain_of_array_links_and_a_dependent_job",
    "sbatch lessons/05_fault_tolerance/crash.sh 2 --crash-rank 3": CRASHED,
    "sbatch lessons/05_fault_tolerance/crash.sh 1 --faulty-node node2 --crash-in-epoch 1": CRASHED,
    "sbatch --nodes=1 --exclude=node2 lessons/05_fault_tolerance/crash.sh 1": CRASHED,
    "sbatch lessons/07_fsdp_sharding/memory.sh":
        "tests/test_lesson07.py::test_memory_job_runs_worlds_of_1_2_and_4",
    "sbatch lessons/07_fsdp_sharding/job.sh": FSDP_JOB,
    "sbatch lessons/08_data_pipeline/job.sh": "tests/test_site_profiles.py::test_shared_tmp_site",
    "sbatch lessons/08_data_pipeline/scaling.sh":
        "tests/test_lesson08.py::test_bench_probe_and_scaling_jobs_run",
    "sbatch lessons/09_beyond_data_parallel/tp.sh": "tests/test_lesson09.py::test_tp_job",
    "sbatch lessons/09_beyond_data_parallel/pp.sh": "tests/test_lesson09.py::test_pp_job",
    "sbatch lessons/09_beyond_data_parallel/2d.sh":
        "tests/test_lesson09.py::test_2d_job_and_a_tp_group_across_nodes",
    "sbatch lessons/09_beyond_data_parallel/compare.sh": "tests/test_lesson09.py::test_compare_job",
    "python lessons/10_fit_and_keep/fit.py --model llama3-8b --world 8,16,64 --bf16 "
    "--kernels cuda --gpu-mem 81079MiB": "tests/test_lesson10.py::test_fit_answers_for_llama3_8b",
    "sbatch lessons/10_fit_and_keep/fit.sh": "tests/test_lesson10.py::test_fit_job",
    "sbatch lessons/10_fit_and_keep/keep.sh": KEEP_JOB,
    "sbatch lessons/10_fit_and_keep/reshard.sh": "tests/test_lesson10.py::test_reshard_job",
    "sbatch lessons/11_torchft/group.sh 1": TORCHFT_JOBS,
    "sbatch --ntasks=2 lessons/11_torchft/group.sh 1": TORCHFT_RANKS,
    "sbatch lessons/12_sick_node/job.sh": SICK_MOVE,
    "sbatch lessons/12_sick_node/job.sh --fault nan --fault-node node2": SICK_NOWHERE,
    "sbatch lessons/12_sick_node/job.sh --fault bitflip --fault-node node2": SICK_NOWHERE,
}
# Tests run through a make target: the test -> the target (its recipe's sbatch is the job).
MAKE_TARGETS = {"tests/test_demo.py::test_make_demo": "demo"}

# Why a command is not run at all here (its skip reason starts with one; summary() counts them).
NEEDS_JOB = "needs a job id"
NEEDS_ROOT = "needs root"
LONG_RUN = "runs longer than a quick command"
UNTIL_STOPPED = "runs until stopped"

# Commands not run here nor as written by a test: command -> (why, what it is, the tests that
# run the same command with what it needs (a job's id for <jobid>, $sweep or SHOWN_JOB_IDS, a
# temporary folder to run in) or ""). tests/confirm_readme.py confirms each from the records
# as it does AS_WRITTEN_BY's: a process of the command in one of those tests, which passed.
NOT_RUN = {
    "make test": (LONG_RUN, "the whole suite, about 9 minutes: CI's first lane", ""),
    ".venv/bin/jupyter lab lessons/": (UNTIL_STOPPED, "a server", ""),
    "sudo bash cluster/up.sh": (NEEDS_ROOT, "restarts the shared cluster", UP_DOWN),
    "sudo bash cluster/down.sh": (NEEDS_ROOT, "stops the shared cluster", UP_DOWN),
    "scontrol update NodeName=node2 State=RESUME": (
        NEEDS_ROOT, "changes a node of the shared cluster (root or SlurmUser)", ""),
    "make container": (NEEDS_ROOT, "builds a 5.6 GB image; the Makefile's test target runs it "
                       "before the tests, no test does", ""),
    "sacct -j <jobid> --format=JobID,State,ExitCode,Elapsed,MaxRSS": (
        NEEDS_JOB, "a finished job's", "tests/test_cluster_accounting.py::"
        "test_sacct_lists_a_finished_job_and_its_steps"),
    "srun --jobid=987 --overlap bash -c 'echo \"inside job $SLURM_JOB_ID, step $SLURM_STEP_ID, "
    "on $(hostname)\"'": (NEEDS_JOB, "the one busy.sh got",
                          "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel"),
    "scancel 987": (NEEDS_JOB, "the one busy.sh got",
                    "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel"),
    "sweep=$(sbatch --parsable lessons/00_slurm_basics/sweep.sh)": (
        NEEDS_JOB, "the next line's: an array job and its report",
        "tests/test_lesson00.py::test_array_then_dependent_report"),
    "sbatch --dependency=afterok:$sweep lessons/00_slurm_basics/report.sh $sweep": (
        NEEDS_JOB, "the sweep's", "tests/test_lesson00.py::test_array_then_dependent_report"),
    "scancel --signal=USR1 --batch <jobid>": (
        NEEDS_JOB, "a running requeue.sh's or job.sh's", "tests/test_lesson05.py::"
        f"test_warning_then_preemption_then_resume {FSDP_JOB}"),
    "scontrol show job <jobid> | grep -E 'JobState|Restarts|EligibleTime'": (
        NEEDS_JOB, "a requeued job's (lesson 05's requeue test reads the same fields with "
        "scontrol show job -o)", ""),
    "scontrol update JobId=<jobid> NumNodes=1 NumTasks=2 NumCPUs=8": (
        NEEDS_JOB, "a requeued job's", FSDP_JOB),
    "python lessons/07_fsdp_sharding/export.py checkpoints/fsdp-<jobid>": (
        NEEDS_JOB, "a job's checkpoints (lesson 07's tests export a checkpoint of their own, "
        "with --out and fewer test images)", ""),
    # (tests/test_lesson08.py::test_plot_scaling_reads_the_stored_study runs it on the stored
    # study from a folder of its own, which the confirmation does not take for the course root.)
    "python lessons/08_data_pipeline/plot_scaling.py scaling-<jobid>.out --png again.png": (
        NEEDS_JOB, "a scaling job's output", ""),
    # (No test runs the next two: the chain test submits one more link after the array instead.)
    "dep=()": (LONG_RUN, "a chain of three jobs, several minutes (with the next lines)", ""),
    'for link in 1 2 3; do\nid=$(sbatch --parsable --array="$link" "${dep[@]}" '
    "--export=ALL,CHAIN=mnist lessons/05_fault_tolerance/chain.sh)\n"
    'dep=(--dependency=afterany:"${id%%;*}")\ndone': (
        LONG_RUN, "a chain of three jobs, several minutes", ""),
    "torchrun --standalone --nproc-per-node 2 lessons/03_ddp_mnist/train.py --epochs 1": (
        LONG_RUN, "an epoch of 60,000 images, minutes here (lesson 03's tests run train.py "
        "under torchrun on a subset, from a copy)", ""),
    ".venv/bin/pytest tests/test_lesson04.py": (
        LONG_RUN, "the lesson's tests, a few minutes of jobs: make test runs them", ""),
    "torchrun --standalone --nproc-per-node 2 "
    "lessons/09_beyond_data_parallel/tp.py --steps 20": (
        LONG_RUN, "20 steps of 2 processes (tp.sh runs tp.py on the cluster)", ""),
    "torchrun --standalone --nproc-per-node 2 "
    "lessons/09_beyond_data_parallel/pp.py --microbatches 2,4": (
        LONG_RUN, "two pipeline schedules of 2 processes (lesson 09's tests run pp.py's ranks "
        "with other microbatch counts)", ""),
    "torchrun --standalone --nproc-per-node 4 "
    "lessons/09_beyond_data_parallel/compare.py --steps 3 --forms fsdp2": (
        LONG_RUN, "one form of 4 processes (compare.sh runs every form on the cluster)", ""),
    "python lessons/10_fit_and_keep/fit.py --model llama3-8b --world 8,16,64 --bf16 --kernels "
    "cuda --ac --gpu-mem 81079MiB": (LONG_RUN, "about 240 s on 2 cores (the line without --ac "
                                     "runs as written)", ""),
    "python lessons/10_fit_and_keep/keep.py --check checkpoints/keep-<jobid>": (
        NEEDS_JOB, "a keep.sh job's checkpoint", KEEP_JOB),
    "torchrun --standalone --nproc-per-node 2 lessons/10_fit_and_keep/step.py --model tiny --ac": (
        LONG_RUN, "2 processes, about 15 s (lesson 10's tests start step.py's ranks themselves)",
        ""),
    "lh=$(sbatch --parsable lessons/11_torchft/lighthouse.sh)": (
        NEEDS_JOB, "the next lines': the lighthouse, whose job id they wait for", TORCHFT_JOBS),
    "sbatch --dependency=after:$lh lessons/11_torchft/group.sh 0": (
        NEEDS_JOB, "the lighthouse's ($lh)", TORCHFT_JOBS),
    "sbatch --dependency=after:$lh lessons/11_torchft/group.sh 1": (
        NEEDS_JOB, "the lighthouse's ($lh)", TORCHFT_JOBS),
    "sbatch --dependency=after:$lh --ntasks=2 lessons/11_torchft/group.sh 0": (
        NEEDS_JOB, "the lighthouse's ($lh)", TORCHFT_RANKS),
    "sbatch --dependency=after:$lh --ntasks=2 lessons/11_torchft/group.sh 1": (
        NEEDS_JOB, "the lighthouse's ($lh)", TORCHFT_RANKS),
    "scancel --signal=KILL <jobid>.0": (NEEDS_JOB, "a running group.sh's", TORCHFT_JOBS),
    "scancel <jobid>": (NEEDS_JOB, "a running group.sh's", TORCHFT_CRASH),
    "sbatch --nodes=1 --nodelist=<node> lessons/05_fault_tolerance/preempt.sh": (
        NEEDS_JOB, "a running group.sh's node", TORCHFT_CRASH),
    "bash cluster/crash_node.sh node2": (NEEDS_JOB, "a running group.sh's node", TORCHFT_CRASH),
    "bash cluster/crash_node.sh --back node2": (
        NEEDS_JOB, "a node that crash_node.sh stopped", TORCHFT_CRASH),
    "bash lessons/11_torchft/compare.sh": (
        NEEDS_ROOT, "sets the shared cluster's nodes DOWN; a benchmark of about 6 minutes, run for "
        "the README, not in CI", ""),
    "make cluster-up NODES=3": (
        NEEDS_ROOT, "restarts the shared cluster with a third node (lesson 12's test does it with "
        "cluster/up.sh --nodes 3, under the cluster's lock)", ""),
    "make cluster-up": (NEEDS_ROOT, "restarts the shared cluster in its default shape", ""),
    "bash lessons/12_sick_node/slow_node.sh <jobid> node2": (
        NEEDS_JOB, "a running job.sh's", SICK_MOVE),
    "bash lessons/12_sick_node/slow_node.sh <jobid> node2 600": (
        NEEDS_JOB, "a running group.sh's", SICK_FT),
    "sbatch --dependency=after:$lh lessons/11_torchft/group.sh 0 --slow-factor 3": (
        NEEDS_JOB, "the lighthouse's ($lh)", SICK_FT),
    "sbatch --dependency=after:$lh lessons/11_torchft/group.sh 1 --slow-factor 3": (
        NEEDS_JOB, "the lighthouse's ($lh)", SICK_FT),
}


# What a test may set besides a command's own variables, and still run it as written: the
# suite's settings (COURSE_*: timeouts, paths for the local cluster), and where a shell finds the
# course, its venv and its data (a login-like environment for a student's copy).
HARNESS_ENV = ("COURSE_",)
# TORCHINDUCTOR_CACHE_DIR: torch's inductor writes the cache folder it picked into os.environ of
# the process that first asks for it (torch/_inductor/runtime/cache_dir_utils.py, cache_dir()), so
# every later process of that pytest worker carries it; no test sets it.
HARNESS_NAMES = frozenset({"PATH", "PYTHONPATH", "VIRTUAL_ENV", "HOME", "USER", "LOGNAME", "LANG",
                           "MNIST_DIR", "OMP_NUM_THREADS", "JUPYTER_DATA_DIR",
                           "TORCHINDUCTOR_CACHE_DIR"})
# The variables a script's header offers for a shorter run of the same job, besides its
# arguments: the same job on fewer images (SUBSET=N: the first N of each set) or for fewer steps
# (STEPS). A test may set them and still submit the README's command, to a whole number no larger
# than the script's default (None: any, SUBSET of all the images being the whole set).
# Not here, since they pick what runs, not how long: scaling.sh's MODES and SHAPES (which of
# the strong and weak studies, which nodes x ranks cases: the README's table has all 8), pp.sh's
# MICROBATCHES (which microbatch counts the bubble is measured at), fit.sh's MODEL and AC (another
# model; one activation-checkpointing mode where the job runs both), keep.sh's MODEL (another
# model) and KEEP_DIR (another folder), 2d.sh's TP and compare.sh's FORMS (another mesh, some of
# the forms).
SHORTER = {
    "lessons/03_ddp_mnist/job.sh": {"SUBSET": None},
    "lessons/05_fault_tolerance/requeue.sh": {"SUBSET": None},
    "lessons/05_fault_tolerance/chain.sh": {"SUBSET": None},
    "lessons/05_fault_tolerance/crash.sh": {"SUBSET": None},
    "lessons/07_fsdp_sharding/job.sh": {"SUBSET": None},
    "lessons/08_data_pipeline/scaling.sh": {"STEPS": 40},
    "lessons/09_beyond_data_parallel/tp.sh": {"STEPS": 100},
    "lessons/09_beyond_data_parallel/pp.sh": {"STEPS": 4},
    "lessons/09_beyond_data_parallel/2d.sh": {"STEPS": 100},
    "lessons/09_beyond_data_parallel/compare.sh": {"STEPS": 10},
    "lessons/11_torchft/group.sh": {"SUBSET": None, "STEPS": 2000},
    "lessons/12_sick_node/job.sh": {"SUBSET": None, "STEPS": 600},
}

# Jobs a README shows ending otherwise than COMPLETED: the state their run must end in (every
# other job's is COMPLETED; a command that is not a job must exit as QUICK says, or 0).
JOB_ENDS = {
    # Lesson 00 §2: it works until the student cancels it (`scancel 987`).
    "sbatch lessons/00_slurm_basics/busy.sh": "CANCELLED",
    # Lesson 05 §4: every worker on node2 fails in every attempt; restarts run out, the job fails.
    "sbatch lessons/05_fault_tolerance/crash.sh 1 --faulty-node node2 --crash-in-epoch 1": "FAILED",
    # Lesson 11: a server, cancelled once the groups are done (its header's `scancel`).
    "lh=$(sbatch --parsable lessons/11_torchft/lighthouse.sh)": "CANCELLED",
    # Lesson 11: group 1's first job, its step killed by the student's `scancel --signal=KILL`.
    "sbatch --dependency=after:$lh lessons/11_torchft/group.sh 1": "FAILED",
    # Lesson 11: the same, of two ranks, one of them killed (srun ends the other).
    "sbatch --dependency=after:$lh --ntasks=2 lessons/11_torchft/group.sh 1": "FAILED",
    # Lesson 12: each names node2, saves and exits 3 (then moves, where a node is left).
    "sbatch lessons/12_sick_node/job.sh": "FAILED",
    "sbatch lessons/12_sick_node/job.sh --fault nan --fault-node node2": "FAILED",
    "sbatch lessons/12_sick_node/job.sh --fault bitflip --fault-node node2": "FAILED",
    # Lesson 12 §5: group 1 on the slowed node leaves with 3 (its replacement completes).
    "sbatch --dependency=after:$lh lessons/11_torchft/group.sh 1 --slow-factor 3": "FAILED",
}

# The job id a README shows as an earlier sbatch's (lesson 00: "Submitted batch job 987", then
# `scancel 987`): in a command other than a quick one, any job's id, as <jobid> is.
SHOWN_JOB_IDS = ("987",)


# Variables that only say where a job's files are, as sbatch's --output does: its logs, the
# site's own configuration (a stand-in file here, where the local cluster has none).
WHERE = {
    "lessons/04_torchrun_enroot/run_script.sh": ("TORCHRUN_LOG_ROOT", "ENROOT_CONF_FILE"),
    "lessons/04_torchrun_enroot/run_charliecloud.sh": ("TORCHRUN_LOG_ROOT",),
    "lessons/11_torchft/lighthouse.sh": ("FT_DIR",),
    "lessons/11_torchft/group.sh": ("FT_DIR",),
}
