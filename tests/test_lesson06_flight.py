"""Lesson 06, "Which collective hung": torch's flight recorder on gloo.

Local, real processes: flight.py's ranks each write their record (one file per rank, whatever
happened); torch's analyser stops on them as gloo writes them, with the KeyError the README
describes (this test fails once a torch release fixes it: the README must change then), and
names the missing rank on the copy fr_gloo_fix.py makes; the fix itself, table-tested; bad
settings, one line and exit 2. Cluster: flight.sh as written (2 nodes x 2 tasks), the same
story, and the stored sample has its shape; the sample's stack names today's all_reduce line.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import pytest
from conftest import submit_job
from helpers import ROOT, clean_environ, sample_output, start_ranks

LESSON = ROOT / "lessons" / "06_diagnosing_hangs"
sys.path.insert(0, str(LESSON))

import fr_gloo_fix  # noqa: E402
from fr_gloo_fix import name_gloo_group  # noqa: E402

ANALYSER = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
# What the README says of the analyser on gloo's own dumps: the line that fails, and how.
GLOO_KEY_ERROR = re.compile(r"^KeyError: \('0', \d\)$", re.M)
MISSING_RANK_1 = ["Not all ranks joining collective, sequence number: 3",
                  "collective: gloo:all_reduce", "missing ranks: {1}",
                  "input sizes: [[1024]]"]  # fmt: skip


def gloo_dump(config, *groups):
    return {"version": "2.10", "pg_config": config, "pg_status": {},
            "entries": [{"process_group": g, "collective_seq_id": i + 1}
                        for i, g in enumerate(groups)]}  # fmt: skip


GLOO_CONFIG = {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}
NAMED_CONFIG = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
DEFAULT_PG = ("0", "default_pg")


@pytest.mark.parametrize("config, groups, expected", [
    # gloo's dump: the '' entry goes under the name its collectives carry
    (GLOO_CONFIG, [DEFAULT_PG, DEFAULT_PG], NAMED_CONFIG),
    (GLOO_CONFIG, [["0", "default_pg"]], NAMED_CONFIG),  # read back from JSON: a list
    # NCCL's dump, or one fixed already: unchanged
    (NAMED_CONFIG, [DEFAULT_PG], NAMED_CONFIG),
    # no collective recorded: no name to take, unchanged
    (GLOO_CONFIG, [], GLOO_CONFIG),
])  # fmt: skip
def test_name_gloo_group(config, groups, expected):
    dump = gloo_dump(config, *groups)
    fixed = name_gloo_group(dump)
    assert fixed["pg_config"] == expected
    assert fixed["entries"] == dump["entries"] and dump["pg_config"] == config  # a copy


def test_name_gloo_group_refuses_several_groups():
    with pytest.raises(ValueError, match="only a dump of one group can be fixed"):
        name_gloo_group(gloo_dump(GLOO_CONFIG, DEFAULT_PG, ("1", "tp")))


def test_fix_copies_every_rank_file_and_skips_folders(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(gloo_dump(GLOO_CONFIG, DEFAULT_PG)))
    # The target inside the source: it exists when the source is read again.
    assert fr_gloo_fix.main([str(tmp_path), str(tmp_path / "fixed")]) == 0
    assert fr_gloo_fix.main([str(tmp_path), str(tmp_path / "fixed")]) == 0
    assert sorted(p.name for p in (tmp_path / "fixed").iterdir()) == ["rank_0", "rank_1"]
    for rank in (0, 1):
        fixed = pickle.loads((tmp_path / "fixed" / f"rank_{rank}").read_bytes())
        assert fixed["pg_config"] == NAMED_CONFIG, fixed


def all_reduce_line(report: str) -> str:
    """The line of today's flight.py that the analyser's stack names as the caller."""
    line = int(re.search(r"^main at \S+/flight\.py:(\d+)$", report, re.M)[1])
    return (LESSON / "flight.py").read_text().splitlines()[line - 1]


def test_sample_names_todays_all_reduce_line():
    # The README quotes the sample's stack: a flight.py edited since shows another line there,
    # and the sample must be captured again (sbatch lessons/06_diagnosing_hangs/flight.sh).
    assert "dist.all_reduce(" in all_reduce_line(sample_output(LESSON, "flight").read_text())


def analyse(folder):
    """torch's analyser on FOLDER: its exit status and what it printed (its report goes to
    stderr, through its logger), as one text."""
    proc = subprocess.run([*ANALYSER, str(folder)], cwd=ROOT, env=clean_environ(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60)  # fmt: skip
    return proc.returncode, proc.stdout


@pytest.mark.timeout(240)
def test_two_ranks_dump_and_the_analyser_names_the_missing_one(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    flight = [sys.executable, str(LESSON / "flight.py"), "--skip-rank", "1"]
    ranks = start_ranks(2, flight, TORCH_FR_DUMP_TEMP_FILE=f"{dumps}/rank_",
                        COURSE_DIST_TIMEOUT="10")  # fmt: skip
    try:
        outs = [r.communicate(timeout=60) for r in ranks]
    finally:
        for r in ranks:
            r.kill()
            r.wait()
    text = "".join(out + err for out, err in outs)
    # Rank 1 skipped and ended without an error; rank 0 waited for it in vain.
    assert [r.returncode for r in ranks] == [1, 0], text
    assert "rank 1/2 on" in text and "step 2: no batch on this rank" in text, text
    assert re.search(r"rank 0/2 on \S+: step 2: all_reduce failed: ", text), text
    assert sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"], text

    # As gloo writes it: the group's ranks are filed under '' (the README's explanation) ...
    with open(dumps / "rank_0", "rb") as f:
        dump = pickle.load(f)
    assert dump["pg_config"] == {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}, dump
    assert [e["process_group"] for e in dump["entries"]] == [DEFAULT_PG] * 3, dump
    assert [e["collective_seq_id"] for e in dump["entries"]] == [1, 2, 3], dump
    # gloo notes no start or end: every entry stays "scheduled", the failed one as well.
    assert {(e["state"], e["time_discovered_started_ns"], e["time_discovered_completed_ns"])
            for e in dump["entries"]} == {("scheduled", None, None)}, dump  # fmt: skip
    # ... and torch's analyser stops where the README says.
    status, raw = analyse(dumps)
    assert status != 0 and GLOO_KEY_ERROR.search(raw), raw
    assert re.search(r'flight_recorder/components/builder\.py", line 212, in build_collectives\n'
                     r"\s+pg_name = _pg_guids\[\(original_pg_name, first_rank\)\]",
                     raw), raw  # fmt: skip

    fix = subprocess.run([sys.executable, str(LESSON / "fr_gloo_fix.py"), str(dumps),
                          str(tmp_path / "fixed")], cwd=ROOT, env=clean_environ(),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert fix.returncode == 0, fix.stderr
    status, report = analyse(tmp_path / "fixed")
    assert status == 0, report
    for line in MISSING_RANK_1:
        assert line in report, report
    assert "expected ranks: {0, 1}" in report, report
    # The stack names the line of the all_reduce that rank 1 skipped.
    assert "dist.all_reduce(" in all_reduce_line(report)


@pytest.mark.parametrize("env, named", [
    ({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_FR_DUMP_TEMP_FILE": "/var/tmp/x/rank_"},
     "TORCH_FR_BUFFER_SIZE='0' turns the flight recorder off"),
    ({}, "TORCH_FR_DUMP_TEMP_FILE='' is not a file prefix in an existing folder"),
])  # fmt: skip
def test_flight_refuses_a_recorder_that_is_off_or_has_nowhere_to_write(env, named):
    environ = clean_environ(**env)
    if "TORCH_FR_DUMP_TEMP_FILE" not in env:
        environ.pop("TORCH_FR_DUMP_TEMP_FILE", None)
    proc = subprocess.run([sys.executable, str(LESSON / "flight.py")], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flight: {named}"), proc.stderr
    assert "export TORCH_FR_" in lines[0], lines[0]  # the fix


def test_fix_refuses_a_source_that_is_not_a_folder(tmp_path):
    proc = subprocess.run([sys.executable, str(LESSON / "fr_gloo_fix.py"), str(tmp_path / "no"),
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"fr_gloo_fix: source='{tmp_path / 'no'}' is not a folder")


# --------------------------------------------------------------------------- cluster


def test_flight_job_names_the_collective_rank_1_skipped(cluster, tmp_path):
    # As written: 2 nodes x 2 tasks (the README's command), with a shorter timeout.
    status, text = submit_job(tmp_path, LESSON / "flight.sh", env={"COURSE_DIST_TIMEOUT": "10"},
                              timeout=240)  # fmt: skip
    assert status != 0, text  # the job's step failed: ranks 0, 2, 3 waited for rank 1
    assert "rank 1/4 on node1: step 2: no batch on this rank, skipping the all_reduce" in text
    assert len(re.findall(r"^rank [023]/4 on node\d: step 2: all_reduce failed: ", text,
                          re.M)) == 3, text  # fmt: skip
    assert "flight recorder files: rank_0 rank_1 rank_2 rank_3" in text, text
    raw, fixed = text.split("== torch's analyser on a copy fixed by fr_gloo_fix.py")
    assert GLOO_KEY_ERROR.search(raw), raw
    for line in MISSING_RANK_1:
        assert line in fixed, fixed
    assert "expected ranks: {0, 1, 2, 3}" in fixed, fixed
    job_id = re.search(r"^job (\d+) on nodes", text, re.M)[1]
    assert not (ROOT / "runs" / f"flight-{job_id}").exists(), "the job leaves no dumps behind"
    sample = sample_output(LESSON, "flight").read_text()
    for pattern in [GLOO_KEY_ERROR.pattern, *map(re.escape, MISSING_RANK_1),
                    r"Connection closed by peer|Timed out waiting"]:  # fmt: skip
        assert bool(re.search(pattern, sample, re.M)) == bool(re.search(pattern, text, re.M)), (
            pattern)  # fmt: skip
