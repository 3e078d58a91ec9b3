#!/usr/bin/env bash
# Can this Python take the course's wheels?  Run before the venv is made (make venv does):
#     bash common/check_python.sh [PYTHON]        # default: python3
# Exit 0 if it can; else one line naming the Python (or the C library) found and what to do,
# and exit 1.
#
# torch 2.14.1's wheels need Python 3.10 or newer (their Requires-Python) and glibc 2.28 or
# newer (their platform tag, manylinux_2_28_x86_64).  On an older login node (RHEL 8's
# /usr/bin/python3 is 3.6, CentOS 7's glibc is 2.17) pip would instead end, after a while, in
# "No matching distribution found for torch==2.14.1", which names neither.  This is shell, not
# Python, so that it runs whatever the Python: one too old to parse the course's Python (3.6,
# even 2.7) is asked two questions that every Python answers.  tests/test_check_python.py
# checks both numbers against the installed wheel's own metadata.
set -u

NEED_PYTHON=3.10
NEED_GLIBC=2.28

python=${1:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
    echo "error: no Python '$python' on PATH; the course needs Python $NEED_PYTHON or newer: load one (module load python/3.11; 'module avail python' lists them) or use a conda Python, and name it: make venv PYTHON=python3.11" >&2
    exit 1
fi
where=$(command -v "$python")

# Two lines: the version, then the C library the Python runs on ("glibc 2.36"; empty elsewhere,
# e.g. musl, whose machines torch's manylinux wheels do not install on either).
probe='import os, sys
print("%d.%d.%d" % tuple(sys.version_info[:3]))
try:
    print(os.confstr("CS_GNU_LIBC_VERSION") or "")
except (AttributeError, ValueError, OSError):
    print("")'
answer=$("$python" -c "$probe" 2>&1)
version=$(sed -n 1p <<<"$answer")
libc=$(sed -n 2p <<<"$answer")
if [[ ! $version =~ ^([0-9]+)\.([0-9]+)\.[0-9]+$ ]]; then
    printed=$(head -c 200 <<<"$answer" | tr '\n' ' ')
    [[ -n ${printed// /} ]] || printed=nothing
    echo "error: '$python' ($where) did not answer as a Python does (it printed: $printed); give a Python $NEED_PYTHON or newer: make venv PYTHON=/path/to/python3.11" >&2
    exit 1
fi

# at_least HAVE NEED: dotted versions, compared number by number (3.9 < 3.10).
at_least() {
    local have_major have_minor need_major need_minor
    IFS=. read -r have_major have_minor _ <<<"$1"
    IFS=. read -r need_major need_minor _ <<<"$2"
    ((have_major > need_major || (have_major == need_major && have_minor >= need_minor)))
}

if ! at_least "$version" "$NEED_PYTHON"; then
    echo "error: '$python' is Python $version ($where), and torch 2.14.1 needs Python $NEED_PYTHON or newer: load a newer one (module load python/3.11; 'module avail python' lists them) or use a conda Python (conda create -p ~/py311 python=3.11), then name it: make venv PYTHON=python3.11 (or use it in README.md's venv command)" >&2
    exit 1
fi
if [[ $libc =~ ^glibc\ ([0-9]+\.[0-9]+) ]] && ! at_least "${BASH_REMATCH[1]}" "$NEED_GLIBC"; then
    echo "error: this machine's C library is glibc ${BASH_REMATCH[1]} (as '$python', Python $version, reports it), and torch 2.14.1's wheels need glibc $NEED_GLIBC or newer (manylinux_2_28): another Python does not change that; make the venv on a node with a newer system (RHEL 8, Ubuntu 20.04 or newer) on the same shared file system, or run in a container (lesson 04)" >&2
    exit 1
fi
