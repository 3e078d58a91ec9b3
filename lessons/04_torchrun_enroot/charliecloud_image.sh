#!/bin/bash
# Build the Charliecloud image of lesson 04 once: a Debian 12 (bookworm) root made by
# debootstrap, with python3 and, from pip, torch==2.14.1 (PyPI's CUDA build), numpy and
# python-hostlist: the host's pip downloads them (image_wheels.sh), the image's installs them.
#     bash lessons/04_torchrun_enroot/charliecloud_image.sh        (as root; or: make container)
# It prints the image's path on its last line. The image is a plain directory,
#     $COURSE_CHARLIECLOUD_CACHE/bookworm-torch-2.14.1   (default cache: /var/cache/course-charliecloud)
# named after what it holds, and is reused once it is there (a second run takes a second).
# It is built in a temporary folder beside it and renamed into place at the very end, so an
# interrupted build leaves no half image behind (the next run removes the leftover folder).
# Installs the Debian packages charliecloud and debootstrap with apt-get when they are missing.
#
# What the image needs for `ch-run` (lesson 04's README, "Charliecloud"):
#   - an /etc/hosts file: ch-run binds the host's onto it only if the image has one
#     (debootstrap's minbase has none, and without it no node name resolves inside);
#   - empty folders to bind the host's onto (the image is read-only at run time, and ch-run
#     creates no mount point then): /work, /scratch, /project, /data, beside /home, /mnt, /opt;
#   - and ch-run itself needs $USER set on the host.
set -euo pipefail

SUITE=bookworm
# Debian 12's python3 is 3.11: the wheels are downloaded for it (image_wheels.sh).
IMAGE_PYTHON=3.11
# PyPI's torch wheel for Linux, the CUDA 13.0 build with NCCL and the CUDA libraries as pip
# packages, as the course's venv (requirements.txt): the image runs on a GPU node as it is,
# and on a CPU node too. It is what makes the image large (about 6 GB).
TORCH_VERSION=2.14.1
PIP_PACKAGES=("torch==$TORCH_VERSION" numpy python-hostlist==2.3.0)
# Folders the job may bind host folders onto (besides /home, /mnt, /opt, /srv of Debian).
MOUNT_POINTS=(/work /scratch /project /data)
CACHE=${COURSE_CHARLIECLOUD_CACHE:-/var/cache/course-charliecloud}
MIRROR=${COURSE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
NAME=$SUITE-torch-$TORCH_VERSION
IMAGE=$CACHE/$NAME
# What the image holds, written into it last: an image with another recipe is built again.
RECIPE="suite $SUITE; debootstrap minbase + python3 python3-pip ca-certificates; pip ${PIP_PACKAGES[*]}; mount points ${MOUNT_POINTS[*]}"
MARKER=etc/course-charliecloud-image

die() {
    echo "error: $*" >&2
    exit 2
}

if (($# > 0)); then
    die "charliecloud_image.sh takes no arguments (got '$1'): set COURSE_CHARLIECLOUD_CACHE=<folder> to build elsewhere."
fi
[[ $CACHE == /* ]] || die "COURSE_CHARLIECLOUD_CACHE='$CACHE' is not an absolute path: give a folder such as /var/cache/course-charliecloud."
[[ $MIRROR =~ ^(https?|file):// ]] || die "COURSE_DEBIAN_MIRROR='$MIRROR' is not a URL: give one such as http://deb.debian.org/debian, or unset it."

# Already built with this recipe: nothing to do.
if [[ -f $IMAGE/$MARKER && $(<"$IMAGE/$MARKER") == "$RECIPE" ]] && command -v ch-run >/dev/null; then
    echo "Charliecloud image already built: $IMAGE"
    echo "$IMAGE"
    exit 0
fi

[[ $(id -u) == 0 ]] || die "the Charliecloud image $IMAGE is not built yet, and building it (debootstrap, apt-get) needs root: run 'make container' (or this script) as root once."

if ! command -v ch-run >/dev/null || ! command -v debootstrap >/dev/null; then
    echo "installing the Debian packages charliecloud and debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq charliecloud debootstrap >/dev/null
fi
export USER=${USER:-$(id -un)} # ch-run stops with "$USER not set" without it

mkdir -p "$CACHE"
exec 9>"$CACHE/.$NAME.lock"
flock 9 # one build at a time; a second waits, then finds the image built
if [[ -f $IMAGE/$MARKER && $(<"$IMAGE/$MARKER") == "$RECIPE" ]]; then
    echo "Charliecloud image already built: $IMAGE"
    echo "$IMAGE"
    exit 0
fi
# Leftovers of an interrupted build (we hold the lock: nobody else is building).
rm -rf "$CACHE/.$NAME.tmp."*
tmp=$CACHE/.$NAME.tmp.$$
trap 'rm -rf "$tmp" "$tmp.wheels"' EXIT
start=$SECONDS

echo "building the Charliecloud image $IMAGE: debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
    "$SUITE" "$tmp" "$MIRROR" >"$tmp.debootstrap.log" 2>&1 || {
    tail -n 20 "$tmp.debootstrap.log" >&2
    die "debootstrap $SUITE failed (full log above, last lines): check the network to $MIRROR, or set COURSE_DEBIAN_MIRROR."
}
rm -f "$tmp.debootstrap.log"
touch "$tmp/etc/hosts" "$tmp/etc/resolv.conf"
mkdir -p "${MOUNT_POINTS[@]/#/$tmp}"
rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*

# The wheels come from the host's pip, set up for this site as it is (image_wheels.sh says why);
# pip inside the image installs them from that one folder, bound at /mnt, with no index, no
# network and no configuration: --isolated and --unset-env keep the host's PIP_* variables out.
echo "pip download ${PIP_PACKAGES[*]} on the host, for the image's Python $IMAGE_PYTHON"
COURSE_IMAGE_PYTHON=$IMAGE_PYTHON bash "$(dirname "$0")/image_wheels.sh" "$tmp.wheels" "${PIP_PACKAGES[@]}"
echo "pip install ${PIP_PACKAGES[*]} inside the image, from those wheels"
ch-run -w -b "$tmp.wheels:/mnt" --unset-env='PIP_*' "$tmp" -- \
    python3 -m pip install --isolated -q --root-user-action=ignore --break-system-packages \
    --no-cache-dir --no-index --find-links /mnt "${PIP_PACKAGES[@]}"
rm -rf "$tmp.wheels"
mkdir -p "$tmp/opt"

ch-run "$tmp" -- python3 -c 'import torch, numpy, hostlist; print("torch", torch.__version__, "from", torch.__file__)'
echo "$RECIPE" >"$tmp/$MARKER"
# Swap in atomically: an older image of this name (another recipe) goes only once this one is whole.
if [[ -e $IMAGE ]]; then
    mv "$IMAGE" "$tmp.old"
fi
mv "$tmp" "$IMAGE"
rm -rf "$tmp.old"
echo "built in $((SECONDS - start)) s ($(du -sh "$IMAGE" | cut -f1)): $IMAGE"
echo "$IMAGE"
