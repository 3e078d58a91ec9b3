#!/bin/bash
# Gather, with the host's own pip, the wheels a container image needs, for the image's Python:
#     bash lessons/04_torchrun_enroot/image_wheels.sh <folder> <requirement>...
#     e.g. image_wheels.sh /var/tmp/wheels torch==2.14.1 numpy python-hostlist==2.3.0
# Then pip inside the image installs them from that one folder, with no index and no network:
#     python3 -m pip install --isolated --no-index --find-links <folder> <requirement>...
# (charliecloud_image.sh does both.)
#
# Why the host downloads: the host's pip is already set up for this site (a proxy, a mirror or
# local index, a CA bundle, a constraint file, PIP_* variables, a find-links folder). Copying
# that set-up into the image would mean knowing every pip option that names a file, a folder or
# a URL and binding each into the image; pip on the host simply uses it as it is. The image's
# pip then needs no configuration at all.
#
# The image's Python is not the host's (another minor version, perhaps), so the download names
# the image's: COURSE_IMAGE_PYTHON (default 3.11, Debian 12's python3) and the machine's
# architecture. Packages with compiled code come as wheels built for it (--only-binary=:all:);
# a package published only as source (python-hostlist) is built here into a pure-Python wheel,
# which runs on any Python 3.
set -euo pipefail

die() {
    echo "error: $*" >&2
    exit 2
}

(($# >= 2)) || die "usage: image_wheels.sh <folder> <requirement>... (e.g. image_wheels.sh /var/tmp/wheels torch==2.14.1 numpy)"
dest=$1
shift
PY_VERSION=${COURSE_IMAGE_PYTHON:-3.11}
[[ $PY_VERSION =~ ^3\.[0-9]+$ ]] || die "COURSE_IMAGE_PYTHON='$PY_VERSION' is not a Python version such as 3.11: give the image's python3 version."
# Wheels for any glibc up to Debian 12's 2.36: pip's --platform matches a wheel's tag exactly
# (it expands no manylinux_2_X tag to older ones), so every tag is named.
arch=$(uname -m)
PLATFORM=manylinux_2_36_$arch
platforms=(--platform "manylinux2014_$arch")
for minor in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
host_python=${COURSE_HOST_PYTHON:-python3}
"$host_python" -m pip --version >/dev/null 2>&1 ||
    die "'$host_python -m pip' does not run: install pip for it (apt-get install python3-pip), or set COURSE_HOST_PYTHON to a python that has pip."

mkdir -p "$dest"
binary=() pure=()
for req in "$@"; do
    # Only a package published as source alone goes through `pip wheel`; the course's is
    # python-hostlist (pure Python, one module).
    case ${req%%[=<>!~ ]*} in
    python-hostlist) pure+=("$req") ;;
    *) binary+=("$req") ;;
    esac
done
# pip's own messages go to stderr; the many "Location ... is ignored" warnings a local index
# can cause are left out, errors are not.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
if ((${#binary[@]})); then
    quiet "$host_python" -m pip download --quiet --disable-pip-version-check --dest "$dest" \
        --only-binary=:all: --implementation cp --python-version "$PY_VERSION" \
        --abi "cp${PY_VERSION/./}" "${platforms[@]}" \
        "${binary[@]}" ||
        die "pip download of ${binary[*]} for Python $PY_VERSION (up to $PLATFORM) failed (pip's message above): check the host's pip configuration (pip config list) and network."
fi
if ((${#pure[@]})); then
    quiet "$host_python" -m pip wheel --quiet --disable-pip-version-check --no-deps \
        --wheel-dir "$dest" "${pure[@]}" ||
        die "pip wheel of ${pure[*]} failed (pip's message above): check the host's pip configuration (pip config list) and network."
fi
echo "$(find "$dest" -name '*.whl' | wc -l) wheels for Python $PY_VERSION (up to $PLATFORM), $(du -sh "$dest" | cut -f1): $dest"
