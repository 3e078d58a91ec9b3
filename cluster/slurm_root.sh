#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# Make (once) the Debian root that a Slurm version other than this machine's own runs from:
#   bash cluster/slurm_root.sh 24.11
# debootstrap --variant=minbase of the Debian release that packages that version (slurm_suite
# in lib.sh), with its daemons, clients, munge and what the course's jobs need on a node, into
# SLURM_CACHE/VERSION (/var/cache/course-slurm/24.11). Nothing is installed on this machine
# itself (its libc and packages stay as they are) except debootstrap when it is missing.
# A root that is already there with the same recipe is reused at once. Prints the root's path.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

MIRROR=${COURSE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# slurm-wlm's daemons and clients, munge (its library; the daemons use this machine's munged),
# libffi8 (Python's ctypes, which torch imports, needs it) and Charliecloud's ch-run (lesson 04).
PACKAGES=slurmctld,slurmd,slurmdbd,slurm-client,munge,libffi8,charliecloud-runtime

case ${1:-} in
-h | --help)
    echo "Usage: bash cluster/slurm_root.sh VERSION   (a version other than $SLURM_DEFAULT: ${SLURM_VERSIONS#* })"
    exit 0
    ;;
esac
[[ $# -eq 1 ]] || die "slurm_root.sh needs one Slurm version (one of: ${SLURM_VERSIONS#* }), see --help"
VERSION=$1
SUITE=$(slurm_suite "$VERSION") || die "unknown Slurm version '$VERSION' (known: $SLURM_VERSIONS)"
[[ -n $SUITE ]] || die "Slurm $VERSION is this machine's own: it needs no root"
[[ $MIRROR =~ ^(https?|file):// ]] ||
    die "COURSE_DEBIAN_MIRROR='$MIRROR' is not a URL: give one such as http://deb.debian.org/debian, or unset it"
[[ $(id -u) -eq 0 ]] || die "run as root: debootstrap needs it"

ROOT=$SLURM_CACHE/$VERSION
STAMP=$ROOT/.course-slurm-root
RECIPE="debootstrap --variant=minbase --include=$PACKAGES $SUITE; self link $ROOT"

mkdir -p "$SLURM_CACHE"
exec 8>"$SLURM_CACHE/$VERSION.lock"
flock -w 600 8 || die "another slurm_root.sh $VERSION still holds $SLURM_CACHE/$VERSION.lock after 600 s"
if [[ -f $STAMP && $(<"$STAMP") == "$RECIPE" ]]; then
    echo "$ROOT"
    exit 0
fi

if ! command -v debootstrap >/dev/null; then
    note "installing debootstrap with apt-get"
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -q &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
    } >"$SLURM_CACHE/apt.log" 2>&1 || die "apt-get install debootstrap failed; see $SLURM_CACHE/apt.log"
fi

start=$SECONDS
note "building the root of Slurm $VERSION in $ROOT: debootstrap $SUITE from $MIRROR (about a minute, once)"
tmp=$ROOT.build
log=$SLURM_CACHE/$VERSION.debootstrap.log
rm -rf "$tmp"
# A debootstrap older than the suite has no script named after it (Debian 12's knows no
# "forky"); every Debian suite is made the same way, so its "sid" script serves (debootstrap(8):
# the fourth argument, SCRIPT).
script=()
[[ -e /usr/share/debootstrap/scripts/$SUITE ]] || script=(/usr/share/debootstrap/scripts/sid)
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp" "$MIRROR" "${script[@]}" >"$log" 2>&1 || {
    rm -rf "$tmp"
    die "debootstrap $SUITE failed: see $log (the network to $MIRROR? set COURSE_DEBIAN_MIRROR)"
}
# Inside the root, its own path leads back to its top (a relative link): a path under ROOT, such
# as slurm.conf's PluginDir, names the same file on this machine and inside the root.
parent=${ROOT%/*}
up=$(sed -E 's#/[^/]+#../#g; s#/$##' <<<"$parent")
mkdir -p "$tmp$parent"
ln -sfn "$up" "$tmp$ROOT"
[[ $(readlink -f "$tmp$ROOT/usr") == "$(readlink -f "$tmp/usr")" ]] ||
    die "the root's link to itself ($tmp$ROOT -> $up) does not lead back to its top"
# shellcheck disable=SC2016  # dpkg-query's own ${Version}, not the shell's
got=$(chroot "$tmp" dpkg-query -W -f '${Version}' slurm-client 2>/dev/null) || got="?"
[[ $got == "$VERSION".* ]] || {
    rm -rf "$tmp"
    die "Debian $SUITE has Slurm $got, not $VERSION: change slurm_suite in cluster/lib.sh"
}
echo "$RECIPE" >"$tmp/${STAMP##*/}"
rm -rf "$ROOT"
mv "$tmp" "$ROOT"
note "Slurm $got in $ROOT ($((SECONDS - start)) s)"
echo "$ROOT"
