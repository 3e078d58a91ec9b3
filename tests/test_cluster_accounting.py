"""Accounting (slurmdbd + MariaDB) and mail on the local cluster: sacct, sstat, job ids that go
on counting, --mail-type notices in /var/mail/<user>.

That job records and ids survive down/up is checked in test_cluster.py's restart test.
"""

import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, job_environ, wait_job

MAIL_DIR = Path("/var/mail")


def slurm(*args, timeout=30):
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=job_environ(),
    )  # fmt: skip
    assert proc.returncode == 0, f"{' '.join(map(str, args))}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def sacct_rows(job_id, fields, steps):
    """sacct -j ID rows by JobID, once the job and ``steps`` are there and have all ended
    (slurmdbd receives the records from slurmctld a moment after the job ends)."""
    want = {job_id, *(f"{job_id}.{s}" for s in steps)}
    for _ in range(60):
        text = slurm("sacct", "-n", "-P", "-j", job_id, f"--format={','.join(fields)}")
        rows = [dict(zip(fields, line.split("|"), strict=True)) for line in text.splitlines()]
        by_id = {r["JobID"]: r for r in rows}
        states = {r["State"] for r in rows}
        # The job's own row is complete once slurmctld's start record for it is in too.
        started = by_id.get(job_id, {}).get("Partition", "x") != ""
        if want <= set(by_id) and started and not states & {"RUNNING", "PENDING", "COMPLETING", ""}:
            return by_id
        time.sleep(0.25)
    pytest.fail(f"sacct -j {job_id} does not have {sorted(want)} ended: {text!r}", pytrace=False)


def test_sacct_lists_a_finished_job_and_its_steps(sbatch_wait, tmp_path):
    script = tmp_path / "acct.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=acct-test --nodes=2 --ntasks-per-node=1\n"
        "srun hostname\nexit 3\n"
    )
    result = sbatch_wait(script, timeout=240)
    assert result.returncode == 3, result.output
    fields = ["JobID", "JobName", "Partition", "State", "ExitCode", "NNodes", "NodeList"]
    by_id = sacct_rows(result.job_id, fields, ["batch", "0"])
    rows = list(by_id.values())
    job = by_id[result.job_id]
    assert job["JobName"] == "acct-test" and job["Partition"] == "local", rows
    assert job["State"] == "FAILED" and job["ExitCode"] == "3:0", rows
    assert job["NNodes"] == "2" and job["NodeList"] == "node[1-2]", rows
    step = by_id[f"{result.job_id}.0"]
    assert step["State"] == "COMPLETED" and step["NodeList"] == "node[1-2]", rows
    assert by_id[f"{result.job_id}.batch"]["ExitCode"] == "3:0", rows
    # The README's `sacct -j <jobid> --format=JobID,State,ExitCode,Elapsed,MaxRSS`, as typed.
    table = slurm("sacct", "-j", result.job_id, "--format=JobID,State,ExitCode,Elapsed,MaxRSS")
    assert re.search(rf"^{result.job_id} +FAILED +3:0 +\d\d:\d\d:\d\d", table, re.M), table
    assert re.search(rf"^{result.job_id}\.0 +COMPLETED +0:0 ", table, re.M), table


@pytest.mark.timeout(600)
def test_sstat_reports_a_running_step(cluster, cluster_lock, tmp_path):
    with cluster_lock():
        job = slurm(
            "sbatch", "--parsable", f"--output={tmp_path}/sstat.out", "--wrap",
            # Long enough to be seen on a loaded machine (JobAcctGatherFrequency samples every
            # 5 s); the job is cancelled as soon as sstat has shown it.
            "srun python3 -c 'import time; b = b\"x\" * (200 << 20); time.sleep(120)'",
        ).split(";")[0].strip()  # fmt: skip
        try:
            rss = None
            deadline = time.monotonic() + 100
            while time.monotonic() < deadline and not rss:
                proc = subprocess.run(
                    ["sstat", "-n", "-P", "-j", f"{job}.0", "--format=JobID,MaxRSS,NTasks"],
                    capture_output=True, text=True, timeout=30, env=job_environ(),
                )  # fmt: skip
                # KiB, or scaled to the largest unit that keeps it >= 1 ("213.50M", seen on
                # 26.05); 0 before the first sample.
                match = re.match(rf"{job}\.0\|([0-9.]+)([KMG]?)\|1$", proc.stdout.strip())
                kib = match and float(match[1]) * 1024 ** "KMG".find(match[2] or "K")
                if kib and kib > 200 * 1024:
                    rss = kib
                time.sleep(0.5)
            assert rss, f"sstat never showed {job}.0 with its 200 MB: {proc.stdout}{proc.stderr}"
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
            wait_job(job, timeout=240)


def test_job_ids_increase_and_come_from_the_database(sbatch_wait, tmp_path):
    script = tmp_path / "t.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    first = sbatch_wait(script, timeout=240)
    second = sbatch_wait(script, timeout=240)
    assert int(second.job_id) > int(first.job_id)
    config = slurm("scontrol", "show", "config")
    assert re.search(r"AccountingStorageType\s*=\s*accounting_storage/slurmdbd", config), config
    assert slurm("sacctmgr", "-n", "-P", "list", "cluster", "format=cluster").split() == ["course"]


def test_mail_type_end_lands_in_the_users_mailbox(sbatch_wait, tmp_path):
    script = tmp_path / "mail.sh"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=mail-test --mail-type=END\ntrue\n")
    result = sbatch_wait(script, timeout=240)
    assert result.returncode == 0, result.output
    box = MAIL_DIR / "root"
    text = ""
    for _ in range(40):  # slurmctld sends the notice right after the job record is closed
        text = box.read_text(errors="replace") if box.exists() else ""
        if f"Job_id={result.job_id} " in text:
            break
        time.sleep(0.25)
    notice = text[text.rfind("From slurm@") :]
    assert f"Subject: Slurm Job_id={result.job_id} Name=mail-test Ended" in notice, text[-2000:]
    assert "COMPLETED" in notice and f"SLURM_JOB_ID={result.job_id}" in notice, notice
