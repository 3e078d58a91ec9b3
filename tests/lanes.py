"""Which tests run in which lane: the marks, and the order and groups pytest-xdist hands out.

``make test`` runs two lanes (``-n 2 --dist loadgroup``): every cluster test in one group, from
the start of the run, one after another on one worker, in collection order; the other worker
takes the rest a file at a time (a notebook's cells stay in order, in one kernel).  The other
lanes (make test-slurm, -sites, -long, -scale, -readme, -lesson09/10/11/12) select by the marks
registered here.  tests/conftest.py imports these hooks; tests/README.md lists the lanes.
"""

from __future__ import annotations

import os

import pytest

CLUSTER_GROUP = "cluster"  # the xdist_group of every test that uses the cluster
LESSON09_NOTEBOOK = "lessons/09_beyond_data_parallel/"  # nbval items: marked lesson09 below
LESSON10_NOTEBOOK = "lessons/10_fit_and_keep/"  # nbval items: marked lesson10 below
LESSON12_NOTEBOOK = "lessons/12_sick_node/"  # nbval items: marked lesson12 below

# The cluster tests that `make test-slurm` runs again on the second Slurm version (cluster/up.sh
# --slurm 24.11; CI runs it after `make test`), marked `every_slurm`: the cluster's own checks
# (clients, jobs, accounting, limits, users, down.sh), every test whose expectation differs
# between versions, and job scripts of every lesson. Ids or id prefixes, as pytest prints them.
EVERY_SLURM = (
    "tests/test_cluster.py::test_sinfo_shows_two_nodes_with_two_gpus",
    "tests/test_cluster.py::test_srun_two_nodes_two_tasks_each",
    "tests/test_cluster.py::test_gres_and_gpus_per_node_mix_until_26_05",
    "tests/test_cluster.py::test_sbatch_wait_returns_the_job_exit_code",
    "tests/test_cluster.py::test_srun_takes_cpus_per_task_from_the_job_from_23_11",
    "tests/test_cluster.py::test_gloo_all_reduce_between_nodes",
    "tests/test_cluster.py::test_nodes_are_separate_hosts_on_a_network",
    "tests/test_cluster.py::test_up_is_idempotent_and_down_leaves_nothing",
    "tests/test_cluster.py::test_check_changes_nothing",
    "tests/test_cluster_accounting.py::",
    "tests/test_cluster_limits.py::test_task_over_its_memory_is_killed",
    "tests/test_cluster_preempt.py::",
    "tests/test_cluster_student.py::test_student_runs_lesson00",
    "tests/test_env_on_cluster.py::",
    "tests/test_same_request.py::",
    "tests/test_lesson00.py::test_anatomy_job_steps_and_tasks",
    "tests/test_lesson00.py::test_memory_job_over_its_mem",
    "tests/test_lesson00.py::test_salloc_srun_and_task_placement",
    "tests/test_lesson01.py::test_job_script_on_local_cluster[job.sh]",
    "tests/test_lesson02.py::test_job_script_on_local_cluster[job.sh]",
    "tests/test_lesson02.py::test_job_script_on_local_cluster[torchrun_multinode.sh]",
    "tests/test_lesson03.py::test_carried_train_py_runs_under_srun_on_two_nodes",
    "tests/test_lesson04.py::test_static_job",
    "tests/test_lesson04_charliecloud.py::test_torchrun_in_charliecloud",
    # (lesson 05's preemption job takes 80 s on 24.11; test_cluster_preempt above asserts each
    # version's preemption and requeue counts, and this job script runs the lesson's training)
    "tests/test_lesson05.py::test_chain_of_array_links_and_a_dependent_job",
    # (both scripts share the stop rules of common/job_env.sh: lesson 07's job on every version)
    "tests/test_lesson05_cancel.py::test_plain_scancel_saves_and_the_job_stays_cancelled[07]",
    "tests/test_slurm_requeue.py::test_a_job_slurm_requeued_says_so_and_comes_back_once[07-",
    "tests/test_slurm_requeue.py::test_a_cancel_between_the_state_check_and_the_requeue_wins",
    "tests/test_lesson06.py::test_wrong_interface",
    "tests/test_lesson06.py::test_world_size_exported_wrong",
    "tests/test_lesson07.py::test_job_saves_on_2_nodes_requeues_and_resumes_on_1",
    "tests/test_lesson08.py::test_job_sh_stages_the_folder_form_with_srun_and_trains",
    # (the lighthouse, two groups and a node set DOWN, on 26.05 only: 22.05 runs lesson 11's
    # scripts in lesson 12's torchft test; this one held this machine's cluster 690 s in CI)
    "tests/test_lesson11_cluster.py::",
    # (a node slowed, named, and the job moved off it by its own sbatch --exclude)
    "tests/test_lesson12.py::test_a_slowed_node_is_named_and_the_job_finishes_without_it",
)


# The lessons' own job scripts (lessons 01 to 08, 11 and 12; lesson 00's tests check what differs
# between versions): make test-slurm runs them on the newest version only, the rest on every
# version.
LESSON_JOBS = (*(f"tests/test_lesson0{n}" for n in range(1, 9)), "tests/test_lesson11",
               "tests/test_lesson12")


def _loadgroup(config) -> bool:
    """Is this run split over pytest-xdist workers by xdist_group (``--dist loadgroup``)?
    (A worker sees ``dist`` as "no" and xdist's own ``loadgroup`` flag set.)"""
    return config.getoption("dist", None) == "loadgroup" or config.getoption("loadgroup", False)


def pytest_configure(config):
    if os.environ.get("COURSE_TEST_EXITFAST", "1") not in ("0", "1"):
        raise pytest.UsageError(f"COURSE_TEST_EXITFAST={os.environ['COURSE_TEST_EXITFAST']!r}: set "
                                "it to 0 (processes as students run them) or 1 (the default)")
    config.addinivalue_line(
        "markers", "every_slurm: also run on the second Slurm version (make test-slurm, CI)",
    )
    config.addinivalue_line(
        "markers", "lesson_job: a lesson's job script among the every_slurm tests (make "
        "test-slurm runs these on the newest version of its lane only)",
    )
    config.addinivalue_line(
        "markers", "cluster: needs the local SLURM cluster (cluster/up.sh); runs after the rest "
        "(under --dist loadgroup: in a lane of its own)",
    )
    config.addinivalue_line(
        "markers", "lesson09: lesson 09's tests and notebook, a lane of their own (make "
        "test-lesson09); `make test` leaves them out",
    )
    config.addinivalue_line(
        "markers", "lesson10: lesson 10's tests and notebook, a lane of their own (make "
        "test-lesson10); `make test` leaves them out",
    )
    config.addinivalue_line(
        "markers", "lesson11: lesson 11's tests: on this machine (groups on loopback), a lane of "
        "their own (make test-lesson11: tests/test_lesson11.py, test_lesson11_fsdp.py); its "
        "cluster tests in make test-slurm's last pass only (every_slurm); `make test` leaves "
        "them out",
    )
    config.addinivalue_line(
        "markers", "lesson12: lesson 12's tests, notebook and jobs, a lane of their own (make "
        "test-lesson12); `make test` leaves them out",
    )
    config.addinivalue_line(
        "markers", "long: a cluster job of a minute or more that waits on Slurm's timers (grace "
        "time, requeues); a lane of its own (make test-long), left out of make test",
    )
    config.addinivalue_line(
        "markers", "computes: a long job whose minutes go to computing, not to Slurm's timers "
        "(make demo's full job): .ci/run runs it apart from the rest of the long lane "
        "(LONG_MARKS)",
    )
    config.addinivalue_line(
        "markers", "scale: real job sizes, 34 and 64 ranks on 17 and 32 nodes; a lane of its "
        "own (make test-scale), left out of make test",
    )
    config.addinivalue_line(
        "markers", "sites: what other sites do to the jobs (--export=NONE, a shared /tmp, rank 0 "
        "elsewhere, GPU binding, a resume on fewer GPUs); a lane of its own (make test-sites), "
        "left out of make test",
    )
    config.addinivalue_line(
        "markers", "readme: a README's command run as written (tests/test_readme_commands.py); "
        "a lane of its own (make test-readme), left out of make test",
    )
    if _loadgroup(config):
        # Hand out the groups in collection order (cluster group first, see below), not
        # largest group first: the cluster group is the longest lane, so it starts at once.
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """Mark tests that need the cluster and move them to the end (order otherwise kept).

    Under ``--dist loadgroup`` they move to the front instead, all in one xdist_group; every
    other test gets the group of its file (a notebook's cells, a module's fixtures stay on
    one worker, in order).
    """
    lanes = _loadgroup(config)
    uses_cluster = []
    for item in items:
        if item.nodeid.startswith(LESSON09_NOTEBOOK):  # nbval's cells carry no marks of their own
            item.add_marker(pytest.mark.lesson09)
        if item.nodeid.startswith(LESSON10_NOTEBOOK):  # the same for lesson 10's notebook
            item.add_marker(pytest.mark.lesson10)
        if item.nodeid.startswith(LESSON12_NOTEBOOK):  # and lesson 12's
            item.add_marker(pytest.mark.lesson12)
        needs = "cluster" in getattr(item, "fixturenames", ())
        if needs:
            item.add_marker(pytest.mark.cluster)
            if item.nodeid.startswith(EVERY_SLURM):
                item.add_marker(pytest.mark.every_slurm)
                if item.nodeid.startswith(LESSON_JOBS):
                    item.add_marker(pytest.mark.lesson_job)
        if lanes:
            group = CLUSTER_GROUP if needs else item.nodeid.split("::", 1)[0]  # the file
            item.add_marker(pytest.mark.xdist_group(group))
        uses_cluster.append(needs)
    rest = [i for i, n in zip(items, uses_cluster, strict=True) if not n]
    cluster = [i for i, n in zip(items, uses_cluster, strict=True) if n]
    items[:] = cluster + rest if lanes else rest + cluster


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_node_collection_finished(node, ids):
    """xdist hands a group to one worker by the suffix it adds to each test's id
    ("...::test@group"), and every test here has a group. With some pytest releases it cannot
    add it (pytest-xdist#1386), and the groups would be split silently: notebook cells out of
    order, cluster tests side by side. Stop instead."""
    ungrouped = [i for i in ids if i.rfind("@") <= i.rfind("]")]
    if _loadgroup(node.config) and ungrouped:
        pytest.exit(
            f"--dist loadgroup: {len(ungrouped)} test(s) have no group, e.g. {ungrouped[0]} "
            f"(pytest {pytest.__version__} with this pytest-xdist): install the versions in "
            "requirements.txt",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_terminal_summary(terminalreporter):
    """The READMEs' commands in a few lines, when this run had them: how many ran, how many
    other tests submit or run as written, how many were skipped and why
    (tests/test_readme_commands.py)."""
    stats, ours = terminalreporter.stats, "tests/test_readme_commands.py::test_readme_command["
    if any(getattr(r, "nodeid", "").startswith(ours)
           for reports in stats.values() for r in reports):  # fmt: skip
        from test_readme_commands import summary

        terminalreporter.section("README commands")
        for line in summary(stats):
            terminalreporter.write_line(line)
