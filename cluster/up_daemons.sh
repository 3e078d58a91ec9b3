#!/bin/bash
# The daemons cluster/up.sh starts, in order: munge, MariaDB and slurmdbd (accounting),
# slurmctld, one slurmd per node; each one's pid recorded for down.sh, and the wait until every
# node is idle (sourced by up.sh, not run).

start_munge() {
    local key=/etc/munge/munge.key
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [[ ! -s $key ]]; then
        note "creating a munge key"
        dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge "$key"
    chmod 0700 /etc/munge
    chmod 0400 "$key"
    # A munged that already answers (the system's own) is used as it is.
    if timeout 5 munge -n </dev/null 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; then
        return 0
    fi
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock "$MUNGE_PIDFILE"
    start_daemon "$LOG_DIR/start.log" runuser -u munge -- munged --pid-file="$MUNGE_PIDFILE" ||
        die "munged did not start; see /var/log/munge/munged.log and $LOG_DIR/start.log"
    local i
    for ((i = 0; i < 50; i++)); do
        [[ -s $MUNGE_PIDFILE ]] && break
        sleep 0.1
    done
    pid_alive "$(cat "$MUNGE_PIDFILE" 2>/dev/null)" munged ||
        die "munged did not stay up; see /var/log/munge/munged.log"
    echo "munged $(<"$MUNGE_PIDFILE")" >>"$RUN_DIR/daemons"
}

db() {
    mariadb --no-defaults --socket="$DB_SOCKET" -u root "$@"
}

# MariaDB (our own instance: its own data directory, socket and port) and slurmdbd on top.
start_accounting() {
    local log=$LOG_DIR/mariadb.log i
    mkdir -p "$DB_DIR"
    chown mysql:mysql "$DB_DIR"
    if [[ ! -d $DB_DIR/data/mysql ]]; then
        note "creating the accounting database in $DB_DIR"
        rm -rf "$DB_DIR/data"
        mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR/data" \
            --auth-root-authentication-method=socket --skip-test-db >>"$log" 2>&1 ||
            die "MariaDB could not create its data directory $DB_DIR/data; see $log"
    fi
    rm -f "$DB_SOCKET" "$DB_DIR/mysqld.pid"
    # mariadbd stays in the foreground: setsid -f runs it in the background, detached, and
    # start_daemon has closed every inherited descriptor (our locks) first.
    start_daemon "$log" setsid -f mariadbd --no-defaults --user=mysql --datadir="$DB_DIR/data" \
        --socket="$DB_SOCKET" --pid-file="$DB_DIR/mysqld.pid" --port="$DB_PORT" \
        --bind-address=127.0.0.1 --skip-name-resolve --log-error="$log" \
        --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 ||
        die "mariadbd did not start; see $log"
    for ((i = 0; i < 150; i++)); do
        db -e 'SELECT 1' >/dev/null 2>&1 && break
        sleep 0.1
    done
    db -e 'SELECT 1' >/dev/null 2>&1 ||
        die "MariaDB did not start; see $log (is another mariadbd using port $DB_PORT?)"
    echo "mariadbd $(<"$DB_DIR/mysqld.pid")" >>"$RUN_DIR/daemons"
    if [[ ! -s $DB_DIR/slurm.pass ]]; then
        (umask 077 && head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DB_DIR/slurm.pass")
        render_configs
    fi
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
        ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(<"$DB_DIR/slurm.pass")';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        CREATE DATABASE IF NOT EXISTS $(db_name);
        GRANT ALL ON $(db_name).* TO 'slurm'@'127.0.0.1';" >>"$log" 2>&1 ||
        die "could not create the database user for slurmdbd; see $log"
    printf '%s\n' "$DBD_CONF_TEXT" >"$SLURMDBD_CONF"
    chmod 600 "$SLURMDBD_CONF"
    start_slurm_daemon "" "$CTL_NAME" slurmdbd ||
        die "slurmdbd did not start; see $LOG_DIR/slurmdbd.log and $LOG_DIR/start.log"
    wait_pidfile "$RUN_DIR/slurmdbd.pid" slurmdbd "$LOG_DIR/slurmdbd.log"
    # slurmdbd writes its pid file before it has made its tables (seconds on a new database, more
    # on a loaded machine) and listens only after: wait for its port, by the clock.
    local deadline=$((SECONDS + 60))
    until (: </dev/tcp/"$CTL_ADDR"/"$DBD_PORT") 2>/dev/null; do
        ((SECONDS < deadline)) || die "slurmdbd did not listen on $CTL_ADDR:$DBD_PORT within 60 s; see $LOG_DIR/slurmdbd.log"
        sleep 0.2
    done
}

# Job ids go on from the last one the databases know, across down/up and across versions (each
# version has its own database, and slurm-<jobid>.out names must not repeat).
first_job_id() {
    local last=0 id name
    for name in $(db -N -e "SHOW DATABASES LIKE 'slurm\\_acct\\_db%'" 2>/dev/null); do
        id=$(db -N -e "SELECT COALESCE(MAX(id_job), 0) FROM \`$name\`.course_job_table" \
            2>/dev/null) || id=0
        [[ $id =~ ^[0-9]+$ ]] && ((id > last)) && last=$id
    done
    echo $((last + 1))
}

# The cluster must be known to the database before slurmctld sends it records.
# Tried again for up to a minute: CI once saw `add cluster` refused ("Connection refused") half
# a second after slurmdbd had started on a new database, beside two other clusters' load.
register_cluster() {
    local out deadline=$((SECONDS + 60))
    while :; do
        date '+%T register_cluster' >>"$LOG_DIR/start.log"
        if out=$(timeout 20 "$(client_path sacctmgr)" -n -P list cluster format=cluster 2>&1); then
            grep -qx course <<<"$out" && return 0
            timeout 20 "$(client_path sacctmgr)" -i add cluster course >>"$LOG_DIR/start.log" 2>&1 &&
                return 0
        else
            printf '%s\n' "$out" >>"$LOG_DIR/start.log"
        fi
        ((SECONDS < deadline)) ||
            die "sacctmgr could not add cluster 'course' within 60 s; see $LOG_DIR/start.log"
        sleep 2
    done
}

# wait_pidfile FILE NAME LOG: wait for a daemon's pid file, record the pid.
wait_pidfile() {
    local file=$1 name=$2 log=$3 i pid=""
    for ((i = 0; i < 100; i++)); do
        pid=$(cat "$file" 2>/dev/null || true)
        pid_alive "$pid" "$name" && break
        sleep 0.1
    done
    pid_alive "$pid" "$name" || die "$name did not start; see $log (last lines below)
$(tail -n 20 "$log" 2>/dev/null)"
    echo "$name $pid" >>"$RUN_DIR/daemons"
    REPLY=$pid
}

# start_slurm_daemon NETNS HOSTNAME COMMAND...: start a Slurm daemon with its own hostname (UTS
# namespace), in node network namespace NETNS ("": this machine's). This machine's own Slurm
# runs as it is; another version runs from its root, with this machine's files bound in
# (cluster/in_root.sh, ROOT_BINDS).
start_slurm_daemon() {
    local netns=$1 host=$2
    shift 2
    local enter=()
    [[ -n $netns ]] && enter=(nsenter --net="/run/netns/$netns")
    if [[ -z $SLURM_ROOT ]]; then
        start_daemon "$LOG_DIR/start.log" "${enter[@]}" unshare --uts sh -c "hostname $host && exec $*"
    else
        start_daemon "$LOG_DIR/start.log" "${enter[@]}" \
            bash "$HERE/in_root.sh" "$SLURM_ROOT" "$host" "${ROOT_BINDS[@]}" -- "$@"
    fi
}

# What a version's root sees of this machine (cluster/in_root.sh binds each onto the same path):
# every top-level folder that is not the operating system's (/home, /root, /tmp, /work, /opt,
# ...: users' files, the course, a Python such as pyenv's), the cluster's state and logs, mail,
# /var/tmp, lesson 04's image, Slurm's configuration, munge's socket (this machine's munged
# serves both), the users and groups, and /etc/hosts (the node names; a copy without this
# machine's name leaves jobs COMPLETING for a minute). A Python installed under /usr (the
# course's venv points at it) is bound too: its program and its standard library.
root_binds() {
    local d venv python
    ROOT_BINDS=()
    for d in /*; do
        [[ -d $d && ! -L $d ]] || continue
        case ${d#/} in
        bin | boot | dev | etc | lib | lib32 | lib64 | libx32 | lost+found | proc | run | sbin | snap | sys | usr | var) ;;
        *) ROOT_BINDS+=("$d") ;;
        esac
    done
    ROOT_BINDS+=("$CLUSTER_ROOT" "$MAIL_DIR" /var/tmp /var/cache/course-charliecloud /etc/slurm
        /run/munge /etc/passwd /etc/group /etc/shadow /etc/gshadow /etc/hosts "$(dirname "$HERE")")
    venv=${COURSE_VENV:-$(dirname "$HERE")/.venv}
    python=$venv/bin/python
    if [[ -x $python ]]; then
        local paths
        paths=$("$python" -c 'import os, sys, sysconfig
if not sys.base_prefix.startswith(("/usr", "/var", "/etc")): print(sys.base_prefix)
else: print(os.path.realpath(sys._base_executable)); print(sysconfig.get_path("stdlib"))' 2>/dev/null) || paths=""
        [[ -n $paths ]] && mapfile -t -O "${#ROOT_BINDS[@]}" ROOT_BINDS <<<"$paths"
    fi
    # This machine's own Python 3 (a user's venv may point at it), program and standard library.
    for python in /usr/bin/python3.[0-9] /usr/bin/python3.[0-9][0-9]; do
        [[ -f $python && ! -L $python && -d /usr/lib/${python##*/} ]] &&
            ROOT_BINDS+=("$python" "/usr/lib/${python##*/}")
    done
    return 0
}

start_slurm() {
    # The controller gets its own hostname too, so that its address (and the
    # one address it binds) comes from /etc/hosts, not from this machine's name.
    start_slurm_daemon "" "$CTL_NAME" slurmctld ||
        die "slurmctld did not start; see $LOG_DIR/slurmctld.log and $LOG_DIR/start.log"
    wait_pidfile "$RUN_DIR/slurmctld.pid" slurmctld "$LOG_DIR/slurmctld.log"
    local i pid
    for ((i = 1; i <= NODES; i++)); do
        mkdir -p "$CLUSTER_ROOT/spool/node$i"
        # Its own network namespace (made by start_network) and its own hostname: slurmd and
        # every task it starts see one node's network and name, as on a separate machine.
        start_slurm_daemon "$NETNS_PREFIX$i" "node$i" slurmd -N "node$i" ||
            die "slurmd for node$i did not start; see $LOG_DIR/slurmd-node$i.log"
    done
    for ((i = 1; i <= NODES; i++)); do
        wait_pidfile "$RUN_DIR/slurmd-node$i.pid" slurmd "$LOG_DIR/slurmd-node$i.log"
        readlink "/proc/$REPLY/ns/uts" >>"$RUN_DIR/uts"
    done
}

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) states=""
    while ((SECONDS < deadline)); do
        states=$(timeout 5 "$(client_path sinfo)" -h -N -o '%N %t' 2>/dev/null | sort -u || true)
        if [[ -n $states && $(wc -l <<<"$states") -eq $NODES ]] &&
            ! grep -qv ' idle$' <<<"$states"; then
            return 0
        fi
        sleep 0.2
    done
    die "nodes not idle after ${WAIT_S} s: ${states//$'\n'/, }
logs: $LOG_DIR (slurmctld.log, slurmd-nodeN.log); last controller lines:
$(tail -n 15 "$LOG_DIR/slurmctld.log" 2>/dev/null)"
}
