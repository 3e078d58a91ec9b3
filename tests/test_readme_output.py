"""What the quick README commands must print (tests/readme_output.py): every one has a check, and
each kind of check fails on output that is not what the README quotes. The commands themselves
run in make test-readme (tests/test_readme_commands.py); here the checks are fed what the README
quotes, then that with one thing changed."""

import pytest
from readme_commands import all_commands, classify
from readme_output import QUOTED_BLOCK, check_output, how_checked, prompt_output, quoted_block

QUICK = {c.text: c for c in all_commands() if classify(c)[0] == "quick"}
SALLOC = next(c for t, c in QUICK.items() if t.startswith("salloc "))
REFUSED = QUICK["sbatch --test-only --constraint=a100 --wrap=true"]
FIT = QUICK["python lessons/10_fit_and_keep/fit.py"]
BROKEN = QUICK['python lessons/01_hello_allreduce/hello_allreduce.py --nprocs 2 --break-rank 1; '
               'echo "exit $?"']


def test_every_quick_command_checks_what_it_prints():
    unchecked = [f"{c.where}: {c.text}" for c in QUICK.values() if not how_checked(c)]
    assert not unchecked, unchecked
    kinds = {how_checked(c) for c in QUICK.values()}
    assert kinds == {"prompt", "trailing", "block", "phrases", "check"}, kinds


def test_a_prompt_block_is_the_whole_output_job_ids_and_waits_aside():
    quoted = prompt_output(SALLOC)
    assert quoted[0].startswith("salloc: Pending job allocation"), quoted
    as_printed = "\n".join(line.replace(" 983", " 12") for line in quoted
                           if "queued and waiting" not in line)  # fmt: skip
    assert check_output(SALLOC, as_printed, "") == []
    tasks = [line for line in quoted if line.startswith("step 0 task")]
    reordered = "\n".join([line for line in quoted if line not in tasks] + tasks[::-1])
    assert check_output(SALLOC, reordered, "") == []
    one_task = "\n".join(line for line in quoted if line != tasks[0])
    assert check_output(SALLOC, one_task, "") == [f"quoted, not printed: {tasks[0]}"]
    traceback = "Traceback (most recent call last):"
    assert check_output(SALLOC, "\n".join(quoted) + "\n", traceback + "\n") == [
        f"printed, not quoted: {traceback}"]


def test_a_refusal_is_checked_by_its_reason():
    (line,) = prompt_output(REFUSED)
    assert line == "allocation failure: Invalid feature specification"
    assert check_output(REFUSED, "", line + "\n") == []
    other = "allocation failure: Requested node configuration is not available"
    assert check_output(REFUSED, "", other + "\n") != []
    assert check_output(REFUSED, "", "sbatch: error: Invalid account\n") != []


def test_a_quoted_block_with_numbers_masked_only_where_measured():
    block = quoted_block(FIT, QUOTED_BLOCK[FIT.text])
    printed = "\n".join(line.replace("(4 s)", "(40 s)") for line in block) + "\nmore\n"
    assert check_output(FIT, printed, "") == []
    row = next(line for line in block if line.startswith("    2 "))
    changed = printed.replace(row, row.replace("437.3", "437.4"))
    (problem,) = check_output(FIT, changed, "")
    assert problem.startswith("quoted, not printed:     2 ") and "437.3" in problem, problem


def test_phrases_and_the_exit_status_the_readme_says():
    good = ("rank 1/2 on vm: holds [1001.0, 2.0] expected [1.0, 2.0] WRONG\n"
            "FAILED: 1 of 2 ranks hold a wrong sum\nexit 1\n")
    assert check_output(BROKEN, good, "") == []
    crashed = 'SyntaxError: unterminated string literal (detected at line 707)\nexit 1\n'
    assert check_output(BROKEN, crashed, "") == [
        "not printed: WRONG", "not printed: FAILED: 1 of 2 ranks hold a wrong sum"]
    assert check_output(BROKEN, good.replace("exit 1", "exit 0"), "") == [
        "no line `exit 1` (the exit status the README says)"]


@pytest.mark.parametrize("state, ok", [("idle", True), ("mix", False)])
def test_a_trailing_comment_is_a_line_of_the_output(state, ok):
    sinfo = QUICK["sinfo"]
    out = (f"PARTITION AVAIL  TIMELIMIT  NODES  STATE NODELIST\n"
           f"local*       up   infinite      2   {state} node[1-2]\n")
    assert (check_output(sinfo, out, "") == []) == ok


def test_what_a_command_does_where_its_readme_quotes_nothing():
    activate = QUICK["source .venv/bin/activate"]
    assert check_output(activate, "", "") == []
    assert check_output(activate, "", "bash: .venv/bin/activate: No such file or directory\n")
    prepare = QUICK["python -m common.mnist_prepare"]
    ready = "MNIST is ready in /x/data/mnist/MNIST/raw (4 files, MD5 verified)\n"
    assert check_output(prepare, ready, "") == []
    assert check_output(prepare, ready.replace("4 files", "3 files"), "")
    assert check_output(prepare, ready + "Traceback (most recent call last):\n", "")
