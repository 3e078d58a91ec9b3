#!/bin/bash
# MailProg of the local cluster: slurmctld runs `mailprog.sh -s SUBJECT RECIPIENT` for every
# --mail-type event. There is no mail server here, so the notice is appended, in mbox format,
# to the recipient's mailbox /var/mail/<user> (read it with `cat /var/mail/$USER` or `mail`).
# A recipient such as someone@example.org is delivered to the local user "someone".
set -euo pipefail

MAIL_DIR=${COURSE_MAIL_DIR:-/var/mail}
subject=""
while getopts "s:" opt; do
    case $opt in
    s) subject=$OPTARG ;;
    *) ;;
    esac
done
shift $((OPTIND - 1))
recipient=${1:-${SLURM_JOB_USER:-root}}
user=${recipient%%@*}
# Only a plain user name may become a file name.
[[ $user =~ ^[A-Za-z0-9._][A-Za-z0-9._-]*$ ]] || {
    echo "mailprog.sh: refusing recipient '$recipient'" >&2
    exit 1
}
box=$MAIL_DIR/$user
mkdir -p "$MAIL_DIR"
{
    echo "From slurm@course-ctl $(LC_ALL=C date -u '+%a %b %e %H:%M:%S %Y')"
    echo "From: SLURM <slurm@course-ctl>"
    echo "To: $recipient"
    echo "Date: $(LC_ALL=C date -u -R)"
    echo "Subject: $subject"
    echo
    echo "$subject"
    for var in SLURM_JOB_ID SLURM_JOB_NAME SLURM_JOB_USER SLURM_JOB_MAIL_TYPE SLURM_JOB_STATE \
        SLURM_JOB_EXIT_CODE_MAX SLURM_JOB_WORK_DIR SLURM_JOB_STDOUT; do
        [[ -n ${!var:-} ]] && echo "$var=${!var}"
    done
    echo
} >>"$box"
# The mailbox belongs to its user, as a delivered mailbox does.
if id -u "$user" >/dev/null 2>&1; then
    chown "$user" "$box" 2>/dev/null || true
    chmod 600 "$box"
fi
