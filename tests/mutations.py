"""One-line mutations of the lessons, each run against the tests that must catch it.

A test passes for a reason only if it fails when that reason is taken away. Each entry of
MUTATIONS below changes one line of the course (a lesson's distributed step, the shared code it
relies on) in a way a student could get wrong, and names the tests that check the property the
line gives. For each one this script copies the course (the files git tracks or would track,
as they are in the working tree, or with --commit REV as committed; .venv and data/ linked, not
copied) to a folder of its own, applies the mutation there, checks that the file changed and
still parses, runs the named tests in that copy with a time limit, and says:

    CAUGHT   a named test failed: the suite would not pass with this mistake in it
    MISSED   every named test passed with the mistake in it
    ERROR    the mutation no longer applies, or pytest could not run the tests
    TIMEOUT  the tests ran past --timeout

It prints a table and exits 1 unless every mutation run was CAUGHT.

    .venv/bin/python tests/mutations.py --list            # the mutations, their tests, why
    .venv/bin/python tests/mutations.py --quick           # those that need no cluster
    .venv/bin/python tests/mutations.py l05-set-epoch     # some, by name
    .venv/bin/python tests/mutations.py                   # all (the slow ones take the cluster)
    .venv/bin/python tests/mutations.py --quick --baseline --commit HEAD --table FILE

--baseline first runs each mutation's tests on the unmutated copy (a catch counts only if they
pass there); --table writes the table to a file (tests/mutations-result.txt holds the last
full run's).

Mutations marked slow need the local cluster (their tests submit jobs, under the cluster lock,
as in `make test`), up: a copy never starts or restarts it (its `cluster` fixture is replaced,
below, by one that only asks for the nodes). Not a test file: pytest collects
test_*.py only (pyproject.toml's testpaths, pytest's default python_files).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The copies live where the local cluster's nodes see them (tests/conftest.py's SHARED_TMP): a
# job's /tmp is its own, and a slow mutation's tests submit jobs from the copy.
WORK = Path("/var/tmp/course-tests")
LINKED = (".venv", "data")  # large, never mutated: the copy links to the course's own
NBVAL = ["--nbval-lax", "--nbval-current-env", "--nbval-sanitize-with",
         "tests/nbval_sanitize.cfg"]  # fmt: skip  (the Makefile's, for a notebook's items)


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the course root
    old: str  # found exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids, run in the mutated copy; one failing is a catch
    why: str  # what the line gives, and what the tests check of it
    slow: bool = False  # the tests need the local cluster


MUTATIONS = (
    Mutation(
        "l00-sweep-one-rate", "lessons/00_slurm_basics/sweep.sh",
        "lr=${rates[$SLURM_ARRAY_TASK_ID]}", "lr=${rates[0]}",
        ("tests/test_lesson00.py::test_array_then_dependent_report",),
        "every array task trains with its own rate (SLURM_ARRAY_TASK_ID): with the first rate "
        "in every task the sweep sweeps nothing; the test reads each task's rate and the "
        "report's ranking", slow=True),
    Mutation(
        "l01-allreduce-max", "lessons/01_hello_allreduce/hello_allreduce.py",
        "dist.all_reduce(tensor, op=dist.ReduceOp.SUM)",
        "dist.all_reduce(tensor, op=dist.ReduceOp.MAX)",
        ("lessons/01_hello_allreduce/lesson.ipynb",),
        "the collective adds every rank's tensor; MAX gives [W-1, 1] instead of [W(W-1)/2, W]. "
        "The only test run without a cluster is a world of one, where MAX = SUM; the notebook "
        "runs 2 processes and compares every rank's line (its cell that shows the code "
        "differs too)"),
    Mutation(
        "l01-allreduce-max-job", "lessons/01_hello_allreduce/hello_allreduce.py",
        "dist.all_reduce(tensor, op=dist.ReduceOp.SUM)",
        "dist.all_reduce(tensor, op=dist.ReduceOp.MAX)",
        ("tests/test_lesson01.py::test_job_script_on_local_cluster[job.sh]",),
        "the same mistake on 2 nodes x 2 processes: every rank's line says WRONG", slow=True),
    Mutation(
        "l02-one-process-per-node", "lessons/02_launch_vs_srun/node_launch.sh",
        '--nproc_per_node "$NPROC_PER_NODE"', "--nproc_per_node 1",
        ("tests/test_lesson02.py::test_node_launch_helper_on_one_node[torchrun]",
         "tests/test_lesson02.py::test_node_launch_helper_on_one_node[launch]"),
        "the launcher starts one process per GPU of the node (common.env's NPROC_PER_NODE); "
        "with 1 the world is half the size, and the test counts the ranks that said hello"),
    Mutation(
        "l03-set-epoch", "lessons/03_ddp_mnist/train.py",
        "sampler.set_epoch(epoch)", "pass",
        ("tests/test_lesson03.py::test_killed_after_first_checkpoint_resumes_at_the_epoch_boundary",),
        "DistributedSampler reshuffles only when told the epoch: without set_epoch every epoch "
        "repeats the first one's order; the 2-rank run's --log-order is checked epoch by epoch"),
    Mutation(
        "l04-job-size-fixed", "lessons/04_torchrun_enroot/env.sh",
        "NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-2}", "NPROC_PER_NODE=2",
        ("tests/test_lesson04.py::test_env_sh_takes_job_size_from_the_allocation",),
        "torchrun's process count comes from the allocation (GPUs on the node), not a constant"),
    Mutation(
        "l04-dataset-seed-per-rank", "lessons/04_torchrun_enroot/train.py",
        "synthetic_regression(args.samples, args.features, seed=1234)",
        "synthetic_regression(args.samples, args.features, seed=1234 + env.rank)",
        ("lessons/04_torchrun_enroot/lesson.ipynb",),
        "every rank builds the same dataset and the sampler splits it; seeded per rank (as "
        "nanoGPT seeds each rank's randomness) each rank fits another w and the averaged model "
        "fits none: the notebook's 2-rank run ends at 7.85, not 0.062, above the bar of 0.5 it "
        "prints the relation to (its losses are masked)"),
    Mutation(
        "l04-dataset-seed-per-rank-job", "lessons/04_torchrun_enroot/train.py",
        "synthetic_regression(args.samples, args.features, seed=1234)",
        "synthetic_regression(args.samples, args.features, seed=1234 + env.rank)",
        ("tests/test_lesson04.py::test_static_job",),
        "the same mistake on 2 nodes x 2: check_training wants the last train_loss below 0.5 "
        "(0.064 on 4 ranks after 5 epochs; 10.4 seeded per rank)", slow=True),
    Mutation(
        "l05-set-epoch", "lessons/05_fault_tolerance/train.py",
        "sampler.set_epoch(epoch)", "pass",
        ("tests/test_lesson05.py::test_each_epoch_a_new_shuffle_shared_out_over_the_ranks",),
        "as lesson 03: the 3-rank run's shares must change from epoch 1 to epoch 2"),
    Mutation(
        "l05-cancel-requeued", "common/job_env.sh",
        "if [[ -n $state && $state != RUNNING ]]; then", "if false; then",
        ("tests/test_lesson05_cancel.py::test_plain_scancel_saves_and_the_job_stays_cancelled[05]",),
        "only a running job is requeued: without the state check a plain scancel's job comes "
        "back (Slurm accepts the requeue of a cancelled, completing job)", slow=True),
    Mutation(
        "l05-advice-after-asking", "common/job_env.sh",
        "if [[ ${COURSE_SIGNALLED:-} == TERM && -z ${COURSE_RESUME_SAID:-} ]]; then",
        "if false; then",
        ("tests/test_lesson05_cancel.py::"
         "test_a_cancelled_job_says_how_to_go_on_before_asking_slurm",),
        "after a SIGTERM the command to go on is said before slurmctld is asked anything: "
        "SIGKILL follows after KillWait, and a slow scontrol must not take the advice with it",
        slow=True),
    Mutation(
        "l05-advice-after-srun", "common/job_env.sh",
        "[[ $1 == TERM && -n ${COURSE_RESUME:-} ]] || return 1", "return 1",
        ("tests/test_lesson05_cancel.py::"
         "test_a_cancelled_job_whose_tasks_outlive_killwait_says_how_to_go_on",),
        "a cancelled job says how to go on at the SIGTERM, not only after srun: tasks that "
        "outlive KillWait take the batch shell with them before srun returns",
        slow=True),
    Mutation(
        "l06-busbw-factor", "lessons/06_diagnosing_hangs/allreduce_bench.py",
        "return algbw * 2 * (ranks - 1) / ranks", "return algbw * (ranks - 1) / ranks",
        ("tests/test_lesson06.py::test_sizes_and_busbw",),
        "an all_reduce moves 2(n-1)/n of the buffer over each rank's link (nccl-tests' busbw); "
        "the figure students compare with their network's"),
    Mutation(
        "l07-root-unsharded", "lessons/07_fsdp_sharding/train.py",
        "    fully_shard(model, mp_policy=root_mp)", "    pass  # the root left out",
        ("tests/test_lesson07.py::test_fsdp2_and_ddp_take_the_same_steps",),
        "fully_shard on the root takes the stem and the head; without it their gradients are "
        "reduced by nobody and the ranks drift apart: FSDP2's 5 steps must equal DDP's, bit "
        "for bit"),
    Mutation(
        "l07-labels-shifted", "lessons/07_fsdp_sharding/train.py",
        "loss = F.cross_entropy(model(train_x[idx]).float(), train_y[idx])",
        "loss = F.cross_entropy(model(train_x[idx]).float(), train_y[idx - 1])",
        ("tests/test_lesson07.py::test_checkpoint_of_2_ranks_continues_on_3_and_on_1",),
        "each image trained with the label of the image before it (a pairing that does not "
        "depend on the world size): FSDP2 and DDP take the same wrong steps and 3 ranks "
        "continue them as 1 does, so only the exported model's score tells: it must pass 30 % "
        "(56.2 % measured, 13.4 % mutated). (Rolled within a rank's batch, the 3-rank and "
        "1-rank continuations already differ.)"),
    Mutation(
        "l08-labels-rolled", "lessons/08_data_pipeline/train.py",
        "labels = labels.to(device, non_blocking=True)",
        "labels = labels.to(device, non_blocking=True).roll(1)",
        ("tests/test_lesson08.py::"
         "test_three_ranks_score_each_test_image_once_and_profile_the_collectives",
         "lessons/08_data_pipeline/lesson.ipynb"),
        "each image trained with another's label: the loader's images and labels must stay "
        "paired; the 3-rank run must pass 30 % test accuracy (48.98 % measured, 9.98 % rolled), "
        "and the notebook's 12 steps print that they do (77.23 %)"),
    Mutation(
        "l09-tp-plan-w2-colwise", "lessons/09_beyond_data_parallel/tp.py",
        '"feed_forward.w2": RowwiseParallel(output_layouts=seq),',
        '"feed_forward.w2": ColwiseParallel(output_layouts=seq),',
        ("tests/test_lesson09.py::test_split_equals_unsplit[tp]",),
        "Megatron's pairing: w1 split by columns, w2 by rows, one reduction between them; the "
        "split model must give the unsplit one's loss, logits and gradients"),
    Mutation(
        "l09-pp-one-microbatch", "lessons/09_beyond_data_parallel/pp.py",
        "else SCHEDULES[name](stages[0], m, loss_fn=loss_fn))",
        "else SCHEDULES[name](stages[0], 1, loss_fn=loss_fn))",
        ("tests/test_lesson09.py::test_fewer_microbatches_than_stages_run_with_gpipe_and_interleaved",
         "lessons/09_beyond_data_parallel/lesson.ipynb"),
        "the schedule cuts the batch into m microbatches that overlap across the stages; given "
        "1 it runs the batch whole and nothing overlaps: the measured bubble must be at most 10 "
        "points under the formula's and 15 over (GPipe m=2: 35 to 40 % measured for 33 % at "
        "load 25 on 2 cores; 0 % mutated, its stand-in work taking one microbatch's fixed "
        "time)"),
    Mutation(
        "l09-2d-one-slice", "lessons/09_beyond_data_parallel/compare.py",
        "loss = loss_fn(net(rows(x, dp, row)), rows(y, dp, row))",
        "loss = loss_fn(net(rows(x, dp, 0)), rows(y, dp, 0))",
        ("tests/test_lesson09.py::test_compare_job",),
        "2D: each dp row of the mesh (a node's tp group) takes its own slice of the batch and "
        "FSDP2 averages the rows' gradients; with every row on the first slice the model trains "
        "on half the batch, and its loss is not DDP's (compare.sh's table: every form's loss "
        "within 2e-3 of DDP's at step 1; 5.0779 for DDP's 5.0631 mutated)", slow=True),
    Mutation(
        "l10-fit-ac-default", "lessons/10_fit_and_keep/fit.sh",
        "both) acs=(off on) ;;", "both) acs=(on) ;;",
        ("tests/test_lesson10.py::test_fit_job",),
        "fit.sh as the README submits it (AC unset: both) measures each rank count without, "
        "then with activation checkpointing, the comparison the lesson draws; with the default "
        "`on` alone half of it is gone. Only a test that submits fit.sh without AC and counts "
        "its steps can tell (test_fit_job does since e90b695; before, it set AC=on)",
        slow=True),
    Mutation(
        "l11-check-launch", "lessons/11_torchft/train_ft.py",
        "check_launch(env)  # the store's", "pass  # the store's",
        ("tests/test_setup.py::test_the_set_up_copies_agree_line_by_line"
         "[lessons/11_torchft/train_ft.py]",),
        "check_launch turns a wrong address, port or rank 0's node into one line before the "
        "store is reached; the set-up comparison wants it in every lesson script's block"),
    Mutation(
        "l11-labels-rolled", "lessons/11_torchft/train_ft.py",
        "loss = F.cross_entropy(model(train_x[idx]), train_y[idx])",
        "loss = F.cross_entropy(model(train_x[idx]), train_y[idx].roll(1))",
        ("tests/test_lesson11.py::test_a_killed_group_is_replaced_and_heals_bit_for_bit",),
        "each image of a group's batch trained with another's label: both groups take the same "
        "wrong steps, so every hash still agrees; only the loss tells: the survivor's mean from "
        "step 60 on must be below 1.0 (0.22 measured, 2.32 rolled)"),
    Mutation(
        "l11-resume-without-schedule", "lessons/11_torchft/ft_checkpoint.py",
        '    scheduler.load_state_dict(state["scheduler"])  # where the one-cycle was', "    pass",
        ("tests/test_lesson11.py::"
         "test_every_group_and_the_lighthouse_lost_resume_from_the_checkpoint_bit_for_bit",),
        "groups that resume from the checkpoint restart the one-cycle schedule: the state they "
        "load is right, every step after it has another learning rate and another state"),
    Mutation(
        "l11-sigterm-unhandled", "lessons/11_torchft/train_ft.py",
        "    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signal.Signals("
        "signum).name))", "    pass",
        ("tests/test_lesson11.py::"
         "test_a_group_sent_sigterm_leaves_between_steps_saves_and_no_step_is_lost",),
        "without the handler Python ends at SIGTERM inside a step, as at SIGKILL: nothing saved, "
        "the group's status is -15, not 75, and the survivor may discard the step in flight"),
    Mutation(
        "l11-fsdp-no-cross-group-allreduce", "lessons/11_torchft/train_ft_fsdp.py",
        "        if manager.allreduce(flat).wait():", "        if False:",
        ("tests/test_lesson11_fsdp.py::"
         "test_groups_of_two_ranks_shard_the_model_and_heal_rank_by_rank",),
        "each group steps on its own gradients: rank r of one group and rank r of the other "
        "hold different shards after the first step"),
    Mutation(
        "l11-fsdp-not-sharded", "lessons/11_torchft/train_ft_fsdp.py",
        "    fully_shard(model)  # over", "    pass  # over",
        ("tests/test_lesson11_fsdp.py::"
         "test_groups_of_two_ranks_shard_the_model_and_heal_rank_by_rank",),
        "every rank holds the whole model and trains it alone: the ranks' parts are not halves "
        "of one model"),
    Mutation(
        "l11-fsdp-heal-skips-weights", "lessons/11_torchft/train_ft_fsdp.py",
        '                local(p).copy_(state["model"][n])', "                pass",
        ("tests/test_lesson11_fsdp.py::"
         "test_groups_of_two_ranks_shard_the_model_and_heal_rank_by_rank",),
        "a healed rank takes its peer's AdamW state and step but keeps its initial weights: its "
        "shard differs from its peer's from then on"),
    Mutation(
        "l11-fsdp-ckpt-local-shards", "lessons/11_torchft/ft_checkpoint.py",
        "    model_sd, optim_sd = get_state_dict(model, optimizer)  # keyed by parameter name",
        "    model_sd = {n: getattr(v, 'to_local', lambda v=v: v)() for n, v in "
        "model.state_dict().items()}; optim_sd = get_state_dict(model, optimizer)[1]",
        ("tests/test_lesson11_fsdp.py::"
         "test_every_group_and_the_lighthouse_lost_each_rank_resumes_its_shards_bit_for_bit",),
        "the checkpoint holds each rank's shard of the weights as a plain tensor (as the heal "
        "sends it): DCP keeps one rank's under each name, with a shard's shape, and the new "
        "groups' ranks cannot get their own weights back from it (refused in one line)"),
    Mutation(
        "l11-shared-node-stays", "lessons/11_torchft/group.sh",
        '    [[ $(squeue -h -j "$job" -o %T 2>/dev/null) == RUNNING ]] || continue',
        "    continue",
        ("tests/test_lesson11_cluster.py::"
         "test_on_nodes_of_four_gpus_a_group_that_shares_a_node_moves",),
        "a group looks at the other groups' nodes and moves off one it shares: skipped, two "
        "groups on one 4-GPU node train on with one node able to end both, and nothing says so",
        slow=True),
    Mutation(
        "l11-move-one-rank", "lessons/11_torchft/group.sh",
        ' --ntasks="${SLURM_NTASKS:-1}" \\', " \\",
        ("tests/test_lesson11_cluster.py::"
         "test_on_nodes_of_four_gpus_a_group_that_shares_a_node_moves",),
        "the new job of a group that moves keeps the group's size: without --ntasks it gets the "
        "header's one task, and a group of two ranks comes back as one process", slow=True),
    Mutation(
        "l12-bn-not-restored", "lessons/12_sick_node/train.py",
        "                    b.copy_(before)", "                    pass",
        ("tests/test_lesson12.py::test_a_nan_is_skipped_on_every_rank_as_a_planned_skip_is",),
        "a skipped step undoes its forward's update of BatchNorm's statistics: without it the "
        "NaN on rank 0 reaches every rank's statistics and the run differs from a planned skip"),
    Mutation(
        "l12-saver-sick", "lessons/12_sick_node/train.py",
        "                healthy = min(set(range(env.world_size)) - set(odd))",
        "                healthy = 0",
        ("tests/test_lesson12.py::test_a_flipped_bit_is_named_and_the_majority_copy_is_saved",),
        "the checkpoint after a drift is a healthy rank's: rank 0 saving its flipped copy fails "
        "the checksum the verdict printed for the majority"),
    Mutation(
        "l12-ft-fast-group-leaves", "lessons/11_torchft/train_ft.py",
        "        if slow != self.group or self.streak < self.windows:",
        "        if slow == self.group or self.streak < self.windows:",
        ("tests/test_lesson12.py::"
         "test_a_torchft_group_on_a_slowed_node_leaves_and_is_replaced_elsewhere",),
        "the group the verdict names leaves: with the test reversed, the healthy group on node1 "
        "leaves and the slowed one trains on; the test wants group 1 gone from node2",
        slow=True),
    Mutation(
        "l12-ft-replacement-anywhere", "lessons/11_torchft/group.sh",
        '    sbatch --parsable --exclude="$1" --nodes=', '    sbatch --parsable --nodes=',
        ("tests/test_lesson12.py::"
         "test_a_torchft_group_on_a_slowed_node_leaves_and_is_replaced_elsewhere",),
        "the replacement avoids the slow node: without --exclude it may land on node2 again "
        "(its first free node), and the test wants node2 in its ExcNodeList", slow=True),
    Mutation(
        "l11-move-header-cpus", "lessons/11_torchft/group.sh",
        '--ntasks="${SLURM_NTASKS:-1}" "${same[@]}" \\', '--ntasks="${SLURM_NTASKS:-1}" \\',
        ("tests/test_lesson11_cluster.py::"
         "test_on_nodes_of_four_gpus_a_group_that_shares_a_node_moves",),
        "the group that moves asks for what sbatch's command line gave it (1 CPU a task): "
        "without it the new job gets the header's 2", slow=True),
    Mutation(
        "common-same-request-mem-per-gpu", "common/job_env.sh",
        "if value=$(_course_field MemPerTres) && [[ $value =~ gpu:([0-9]+)$ ]]; then",
        "if false; then",
        ("tests/test_same_request.py",),
        "a job given --mem-per-gpu runs with MinMemoryNode=0: read as --mem=0, the job in its "
        "place would ask for all of each node's memory, and its record differs", slow=True),
    Mutation(
        "l12-move-header-size", "lessons/12_sick_node/job.sh",
        '--dependency="afterany:$SLURM_JOB_ID" "${same[@]}" \\',
        '--dependency="afterany:$SLURM_JOB_ID" \\',
        ("tests/test_lesson12.py::test_the_job_moves_at_the_size_sbatch_was_given",),
        "the job that moves asks for what the first got on sbatch's command line (1 node): "
        "with the header's 2 nodes and node1 excluded, sbatch refuses it on the default cluster",
        slow=True),
    Mutation(
        "l12-move-keeps-master-addr", "lessons/12_sick_node/job.sh",
        "unset MASTER_ADDR MASTER_PORT NNODES NODE_RANK NPROC_PER_NODE", ":",
        ("tests/test_lesson12.py::test_the_job_moves_at_the_size_sbatch_was_given",),
        "--export=ALL hands the first job's MASTER_ADDR (node1) to the job on node2, whose "
        "ranks then wait for a rank 0 on node1 and fail to join", slow=True),
    Mutation(
        "l12-move-no-export", "lessons/12_sick_node/job.sh",
        '       --export="ALL,CHECKPOINT=$CHECKPOINT,STEPS=$STEPS${SUBSET:+,SUBSET=$SUBSET}" \\',
        "       \\",
        ("tests/test_site_profiles.py::test_export_none_site_lesson12_moves_off_a_sick_node",),
        "where sbatch defaults to --export=NONE the job that moves gets only what it names: "
        "without --export it has no CHECKPOINT and trains from step 0", slow=True),
    Mutation(
        "mnist-evaluate-all-reduce", "common/mnist.py",
        "    dist.all_reduce(totals)", "    pass",
        ("tests/test_evaluate.py::test_two_ranks_score_the_test_set_as_one_process_does",),
        "each rank scores its slice of the test set; the sum over ranks is the whole set's "
        "figure: without it rank 0 reports its own slice (78.10 % for the whole set's 77.04 %)"),
)


def course_files() -> list[str]:
    """What git tracks or would track (not ignored), as the working tree has it."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout  # fmt: skip
    return [p for p in out.decode().split("\0") if p]


def copy_course(dest: Path, commit: str | None) -> None:
    if commit:  # the files of that commit, as git archive writes them
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT,
                                 capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for rel in [] if commit else course_files():
        src = ROOT / rel
        if not src.exists() and not src.is_symlink():  # deleted in the working tree
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel, follow_symlinks=False)
    for name in LINKED:
        if (ROOT / name).exists():
            (dest / name).symlink_to(ROOT / name)
    with open(dest / "tests" / "conftest.py", "a") as conftest:
        conftest.write(CLUSTER_AS_IT_IS)


# Appended to the copy's tests/conftest.py, in place of its `cluster` fixture. That fixture
# starts the cluster when `cluster/up.sh --check` says it is not up in its default shape, and
# the check compares the configuration the course would write with the one running, paths
# included (MailProg under the course's cluster/): from a copy it always differs, and the copy
# would restart the cluster that everyone on this machine shares. Here the cluster is only
# asked for its nodes; one that does not answer fails the tests (with --baseline, an ERROR).
CLUSTER_AS_IT_IS = """

@pytest.fixture(scope="session")
def cluster():  # (tests/mutations.py: a copy of the course uses the cluster as it is)
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                           timeout=60, env=job_environ())
    if nodes.returncode != 0 or not {"node1", "node2"} <= set(nodes.stdout.split()):
        pytest.fail("no local cluster with node1 and node2 (sinfo: "
                    + (nodes.stdout + nodes.stderr).strip() + "): a mutation's copy of the "
                    "course never starts it; start it from the course (make cluster-up)",
                    pytrace=False)
    return {"nodes": ["node1", "node2"], "gpus_per_node": 2}
"""


def apply(mutation: Mutation, root: Path) -> str | None:
    """Mutate the file under ROOT; None, or why it cannot be applied."""
    path = root / mutation.file
    if not path.is_file():
        return f"{mutation.file} is not there"
    text = path.read_text()
    found = text.count(mutation.old)
    if found != 1:
        return f"{mutation.old!r} is in {mutation.file} {found} times, not once"
    changed = text.replace(mutation.old, mutation.new)
    if changed == text:
        return "the mutated text is the same as the original"
    path.write_text(changed)
    # A file that no longer parses would be caught for the wrong reason.
    if path.suffix == ".py":
        try:
            compile(changed, str(path), "exec")
        except SyntaxError as exc:
            return f"the mutated file does not parse: {exc}"
    elif path.suffix == ".sh":
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if check.returncode:
            return f"the mutated file does not parse: {check.stderr.strip()}"
    return None


def environment(root: Path) -> dict[str, str]:
    """This environment, with the copy first on PYTHONPATH: the venv's editable install of
    common/ points at the course itself, and a process that has no PYTHONPATH of its own would
    import the unmutated common/ from there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env["COURSE_NOTEBOOK_SUBMIT"] = "0"  # as `make test` runs the notebooks
    return env


@dataclass
class Result:
    mutation: Mutation
    verdict: str
    seconds: float
    caught_by: tuple[str, ...] = ()
    detail: str = ""


def run(mutation: Mutation, timeout: float, keep: bool, baseline: bool,
        commit: str | None) -> Result:
    started = time.monotonic()
    WORK.mkdir(exist_ok=True)
    copy = Path(tempfile.mkdtemp(prefix=f"mutation-{mutation.name}-", dir=WORK))
    try:
        copy_course(copy, commit)
        env = environment(copy)
        python = str(copy / ".venv" / "bin" / "python")
        seen = subprocess.run([python, "-c", "import common; print(common.__file__)"], cwd="/",
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        if not seen.stdout.startswith(str(copy)):
            return Result(mutation, "ERROR", time.monotonic() - started,
                          detail=f"common/ imported from {seen.stdout.strip()}{seen.stderr}")
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider",
               "-q", "-rfE", *mutation.tests]  # fmt: skip
        if any(t.split("::")[0].endswith(".ipynb") for t in mutation.tests):
            cmd += NBVAL
        if baseline:  # a catch means something only if the tests pass without the mutation
            status, out = pytest(cmd, copy, env, timeout)
            if status != 0:
                return Result(mutation, "ERROR", time.monotonic() - started,
                              detail=f"the tests fail without the mutation\n{_tail(out)}")
        problem = apply(mutation, copy)
        if problem:
            return Result(mutation, "ERROR", time.monotonic() - started, detail=problem)
        started = time.monotonic()  # the mutated run's time alone
        status, out = pytest(cmd, copy, env, timeout)
        seconds = time.monotonic() - started
        if status is None:
            return Result(mutation, "TIMEOUT", seconds, detail=_tail(out))
        if status == 1:
            said = re.finditer(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.M)
            failed = tuple(dict.fromkeys(m[1].replace(f"{copy}/", "") for m in said))
            return Result(mutation, "CAUGHT", seconds, failed or ("(see the output)",),
                          detail=out)
        if status == 0:
            return Result(mutation, "MISSED", seconds, detail=_tail(out, 3))
        return Result(mutation, "ERROR", seconds, detail=f"pytest exited {status}\n{_tail(out)}")
    finally:
        if keep:
            print(f"  (kept {copy})", flush=True)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def pytest(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float):
    """Run pytest in its own session: (exit status, output), status None past TIMEOUT. Then it
    gets SIGINT, so that its fixtures end what they started (a job is cancelled), and a minute
    later its whole session SIGKILL."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what it left behind
        proc.wait()
        log.seek(0)
        return status, log.read()


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def table(results: list[Result]) -> list[str]:
    name_w = max(len("mutation"), *(len(r.mutation.name) for r in results))
    rows = [f"{'mutation':<{name_w}}  {'result':<7}  {'seconds':>7}  caught by (or the tests run)",
            f"{'-' * name_w}  {'-' * 7}  {'-' * 7}  {'-' * 30}"]
    for r in results:
        by = r.caught_by if r.verdict == "CAUGHT" else r.mutation.tests
        slow = " (slow)" if r.mutation.slow else ""
        rows.append(f"{r.mutation.name:<{name_w}}  {r.verdict:<7}  {r.seconds:7.0f}  "
                    f"{', '.join(by)}{slow}")
    return rows


def listing() -> None:
    for m in MUTATIONS:
        problem = _applies(m)
        print(f"{m.name}{'  [slow: the local cluster]' if m.slow else ''}"
              f"{'  [does not apply: ' + problem + ']' if problem else ''}")
        print(f"  {m.file}: {m.old!r} -> {m.new!r}")
        for t in m.tests:
            print(f"  caught by {t}")
        print(f"  why: {m.why}")


def _applies(mutation: Mutation) -> str | None:
    path = ROOT / mutation.file
    if not path.is_file():
        return f"{mutation.file} is not there"
    found = path.read_text().count(mutation.old)
    return None if found == 1 else f"found {found} times"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and stop")
    parser.add_argument("--quick", action="store_true",
                        help="leave out the slow mutations (their tests need the cluster)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds for one mutation's tests (default 1800: the slow ones may "
                        "wait for the cluster lock)")
    parser.add_argument("--commit", metavar="REV",
                        help="copy the course as committed at REV (default: the working tree)")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each mutation's tests on the copy as it is: they must pass")
    parser.add_argument("--keep", action="store_true", help="keep each mutated copy")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="the end of pytest's output for every mutation")
    parser.add_argument("--table", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.list:
        listing()
        return 0
    by_name = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"no mutation named {', '.join(unknown)} (--list shows them)")
    chosen = [by_name[n] for n in args.names] or list(MUTATIONS)
    if args.quick:
        chosen = [m for m in chosen if not m.slow]
    if args.commit:  # one commit for every mutation, whatever is committed meanwhile
        args.commit = subprocess.run(["git", "rev-parse", "--verify", args.commit], cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout.strip()
    started = time.monotonic()
    results = []
    for i, mutation in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {mutation.name}: {mutation.file}", flush=True)
        result = run(mutation, args.timeout, args.keep, args.baseline, args.commit)
        results.append(result)
        print(f"  {result.verdict} in {result.seconds:.0f} s"
              f"{': ' + ', '.join(result.caught_by) if result.caught_by else ''}", flush=True)
        if result.verdict == "CAUGHT":  # how: pytest's first line of the failure
            how = next((line for line in result.detail.splitlines() if line.startswith("E ")),
                       "")  # fmt: skip
            print(f"  {how[:300]}", flush=True)
        if (result.verdict != "CAUGHT" or args.verbose) and result.detail:
            print("  " + result.detail.replace("\n", "\n  "), flush=True)
    total = time.monotonic() - started
    rows = table(results)
    counts = {v: sum(r.verdict == v for r in results) for v in ("CAUGHT", "MISSED", "ERROR",
                                                                 "TIMEOUT")}  # fmt: skip
    summary = (f"{len(results)} mutations in {total:.0f} s: "
               + ", ".join(f"{n} {v}" for v, n in counts.items() if n))
    print("\n" + "\n".join(rows) + "\n" + summary)
    for r in results:
        if r.verdict == "MISSED":
            print(f"MISSED {r.mutation.name}: {r.mutation.why}")
    if args.table:
        head = subprocess.run(["git", "log", "-1", "--format=%h %cd", "--date=short",
                               args.commit or "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
        source = f"commit {head}" if args.commit else f"the working tree (HEAD {head})"
        lines = [f"python tests/mutations.py {' '.join(sys.argv[1:] if argv is None else argv)}",
                 f"the course as in {source}; {os.cpu_count()} CPUs", "", *rows, "", summary]
        lines += [f"MISSED {r.mutation.name}: {r.mutation.why}" for r in results
                  if r.verdict == "MISSED"]
        args.table.write_text("\n".join(lines) + "\n")
    return 0 if all(r.verdict == "CAUGHT" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
