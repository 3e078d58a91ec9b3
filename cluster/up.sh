#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# Start (or confirm) the local SLURM cluster: munge, one slurmctld and one
# slurmd per node, all on this machine, each node with its own hostname.
# Returns once every node is idle. See cluster/README.md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

NODES=2
GPUS=2
CPUS=64
MEM=256000
WAIT_S=${COURSE_CLUSTER_WAIT_S:-60}
CHECK_ONLY=0
# The site the cluster plays (--site): strict (per-job /tmp, sbatch's own --export=ALL default),
# export-none (sbatch defaults to --export=NONE), shared-tmp (no per-job /tmp), rank0-elsewhere
# (topology/tree, the upper half of the nodes on the first switch), pyxis (every srun task gets
# RANK and LOCAL_RANK as pyxis sets them for an NGC PyTorch image), pyxis-hook (and WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT as enroot's 50-slurm-pytorch.sh hook adds them). cluster/README.md.
SITE=${COURSE_CLUSTER_SITE:-strict}
SITES="strict export-none shared-tmp rank0-elsewhere pyxis pyxis-hook"
# The version: --slurm, else COURSE_SLURM_VERSION (a test run or a shell that works with one
# version throughout), else the default.
SLURM_VERSION=${COURSE_SLURM_VERSION:-$SLURM_DEFAULT}
slurm_suite "$SLURM_VERSION" >/dev/null ||
    die "COURSE_SLURM_VERSION must be one of ${SLURM_VERSIONS// /, }, got '$SLURM_VERSION'"

usage() {
    cat <<EOF
Usage: bash cluster/up.sh [--slurm VERSION] [--site SITE] [--nodes N] [--gpus-per-node G] [--cpus-per-node C] [--mem-per-node MB]

Start the local SLURM cluster (nodes node1..nodeN) and return once every node is idle.
Running it again with the same shape changes nothing; another shape restarts the cluster.

  --slurm VERSION      Slurm version: ${SLURM_VERSIONS// /, } (default \$COURSE_SLURM_VERSION, else
                       $SLURM_DEFAULT, this machine's own packages; another runs from a Debian root
                       made once, see cluster/README.md)
  --site SITE          the site it plays: strict (default: a private /tmp per job), export-none
                       (sbatch defaults to --export=NONE), shared-tmp (one /tmp for every job),
                       rank0-elsewhere (a topology plugin: from Slurm 26.05 task 0 of a block
                       distribution runs on the job's last node), pyxis (each srun task gets
                       RANK and LOCAL_RANK as pyxis sets them), pyxis-hook (also WORLD_SIZE,
                       MASTER_ADDR, MASTER_PORT, as enroot's 50-slurm-pytorch.sh hook);
                       \$COURSE_CLUSTER_SITE sets the default (cluster/README.md, "Site profiles")
  --nodes N            number of nodes (default $NODES, at most 200)
  --gpus-per-node G    "GPUs" per node, bookkeeping only (default $GPUS, at most 16)
  --cpus-per-node C    CPUs each node declares (default $CPUS)
  --mem-per-node MB    memory each node declares, in MB (default $MEM)
  --check              change nothing: exit 0 if the cluster is up in this shape, else 1
  -h, --help           show this help

Logs: $LOG_DIR   Stop: bash cluster/down.sh
EOF
}

# set_int FLAG VALUE MIN MAX: validate an integer flag value.
set_int() {
    local flag=$1 value=$2 min=$3 max=$4
    [[ $value =~ ^[0-9]+$ ]] || die "$flag needs a whole number, got '$value' (see --help)"
    value=$((10#$value))
    ((value >= min && value <= max)) || die "$flag must be between $min and $max, got $value"
    REPLY=$value
}

while [[ $# -gt 0 ]]; do
    arg=$1
    case $arg in
    -h | --help)
        usage
        exit 0
        ;;
    --check)
        CHECK_ONLY=1
        shift
        continue
        ;;
    --slurm=* | --site=* | --nodes=* | --gpus-per-node=* | --cpus-per-node=* | --mem-per-node=*)
        flag=${arg%%=*}
        value=${arg#*=}
        shift
        ;;
    --slurm | --site | --nodes | --gpus-per-node | --cpus-per-node | --mem-per-node)
        flag=$arg
        [[ $# -ge 2 ]] || die "$flag needs a value (see --help)"
        value=$2
        shift 2
        ;;
    *)
        die "unknown option '$arg' (known: --slurm --site --nodes --gpus-per-node --cpus-per-node --mem-per-node --check --help)"
        ;;
    esac
    case $flag in
    --slurm)
        slurm_suite "$value" >/dev/null ||
            die "--slurm must be one of ${SLURM_VERSIONS// /, }, got '$value' (see --help)"
        SLURM_VERSION=$value
        ;;
    --site) SITE=$value ;;
    --nodes) set_int "$flag" "$value" 1 200 && NODES=$REPLY ;;
    --gpus-per-node) set_int "$flag" "$value" 0 16 && GPUS=$REPLY ;;
    --cpus-per-node) set_int "$flag" "$value" 1 4096 && CPUS=$REPLY ;;
    --mem-per-node) set_int "$flag" "$value" 1 100000000 && MEM=$REPLY ;;
    esac
done

[[ " $SITES " == *" $SITE "* ]] || die "--site (or COURSE_CLUSTER_SITE) must be one of ${SITES// /, }, got '$SITE' (see --help)"
[[ $(id -u) -eq 0 ]] || die "run as root: it starts system daemons and writes /etc/slurm and /etc/hosts"

CTL_NAME=course-ctl
# Each node is a separate host on a private network (see start_network): node N has the address
# CLUSTER_NET.N on its own eth0, and the controller, in this machine's namespace, CLUSTER_NET.254
# on the bridge. Every slurmd listens on SLURM's usual port, 6818, on its own address.
CTL_ADDR=$CLUSTER_NET.254
CTL_PORT=6817
# Seconds a preempted job of partition "local" has between SIGTERM and SIGKILL.
GRACE_S=30
SHAPE="nodes=$NODES gpus-per-node=$GPUS cpus-per-node=$CPUS mem-per-node=$MEM slurm=$SLURM_VERSION"
[[ $SITE == strict ]] || SHAPE+=" site=$SITE"
# The root this version's daemons run from (cluster/slurm_root.sh); none for this machine's own.
SLURM_ROOT=""
[[ -n $(slurm_suite "$SLURM_VERSION") ]] && SLURM_ROOT=$SLURM_CACHE/$SLURM_VERSION
GPU_DEV_PREFIX=/dev/course-gpu
STUDENT=student


install_packages() {
    local missing=()
    # Another version's Slurm comes from its root (slurm_root.sh); munge and MariaDB from here.
    if [[ -z $SLURM_ROOT ]]; then
        command -v slurmctld >/dev/null || missing+=(slurmctld)
        command -v slurmd >/dev/null || missing+=(slurmd)
        command -v sbatch >/dev/null || missing+=(slurm-client)
        command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    fi
    command -v munged >/dev/null || missing+=(munge)
    command -v mariadbd >/dev/null || missing+=(mariadb-server)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    note "installing ${missing[*]} with apt-get"
    # Keep package scripts from starting their own daemons: up.sh starts them.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        added_policy=1
    fi
    local rc=0
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -q &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
                "${missing[@]}"
    } >"$CLUSTER_ROOT/apt.log" 2>&1 || rc=$?
    ((added_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get install failed (exit $rc); see $CLUSTER_ROOT/apt.log"
}

# An ordinary account that submits jobs, as everyone does on a real cluster.
ensure_student() {
    id -u "$STUDENT" >/dev/null 2>&1 && return 0
    useradd --create-home --shell /bin/bash --comment "course student" "$STUDENT" \
        >>"$CLUSTER_ROOT/useradd.log" 2>&1 ||
        die "could not create the user '$STUDENT' (useradd failed); see $CLUSTER_ROOT/useradd.log"
    note "created the user '$STUDENT' (runuser -u $STUDENT -- bash -l, to submit as $STUDENT)"
}

# render TEMPLATE KEY=VALUE...: print TEMPLATE with every @KEY@ replaced.
render() {
    local text kv
    text=$(<"$1")
    shift
    for kv in "$@"; do
        text=${text//@${kv%%=*}@/${kv#*=}}
    done
    printf '%s\n' "$text"
}

# The accounting database of this Slurm version. slurmdbd converts a database to its own
# version's layout at start-up, and an older slurmdbd cannot read it afterwards: each version
# keeps its own (22.05 the original name), all in the same MariaDB server.
db_name() {
    if [[ $SLURM_VERSION == 22.05 ]]; then echo slurm_acct_db; else echo "slurm_acct_db_${SLURM_VERSION//./_}"; fi
}

# The root's library directory (/usr/lib/<multiarch>), where its loader is.
root_libdir() {
    local loader
    for loader in "$SLURM_ROOT"/usr/lib/*-linux-gnu*/ld-linux*.so.[0-9]; do
        [[ -e $loader ]] && { dirname "$loader"; return 0; }
    done
    die "no dynamic loader (usr/lib/*/ld-linux*.so.N) in $SLURM_ROOT: remove it and run up.sh again"
}

# node_range FIRST LAST: Slurm's host list of nodes FIRST..LAST ("node3", "node[1-4]").
node_range() {
    if (($1 == $2)); then echo "node$1"; else echo "node[$1-$2]"; fi
}

render_configs() {
    local i node_lines="" gres_lines="" node_list="node[1-$NODES]" gres=""
    ((NODES == 1)) && node_list=node1
    ((GPUS > 0)) && gres=" Gres=gpu:$GPUS"
    for ((i = 1; i <= NODES; i++)); do
        node_lines+="NodeName=node$i NodeHostname=node$i NodeAddr=$CLUSTER_NET.$i"
        node_lines+=" CPUs=$CPUS RealMemory=$MEM$gres State=UNKNOWN"$'\n'
    done
    if ((GPUS > 0)); then
        local files="${GPU_DEV_PREFIX}0"
        ((GPUS > 1)) && files="${GPU_DEV_PREFIX}[0-$((GPUS - 1))]"
        gres_lines="NodeName=$node_list Name=gpu File=$files"
    fi
    # slurmctld binds to its own name's address (on the bridge). srun, which tasks on the nodes
    # connect back to, listens on every address of the host it runs on: on the submitting
    # machine that includes the bridge, inside a job it is the node's eth0.
    local comm="NoCtldInAddrAny"
    # A version from a root loads its own plugins: its PluginDir, by a path that means the same
    # directory on this machine (its clients, see write_clients) and inside the root (the daemons).
    local version_lines="# Slurm $SLURM_VERSION: this machine's own packages."
    if [[ -n $SLURM_ROOT ]]; then
        version_lines="# Slurm $SLURM_VERSION from $SLURM_ROOT (cluster/slurm_root.sh): its own plugins."
        version_lines+=$'\n'"PluginDir=$(root_libdir)/slurm-wlm"
    fi
    # 25.11 renamed JobContainerType to NamespaceType (job_container/tmpfs to namespace/tmpfs);
    # the old key still works there, with a warning in every daemon's log; 22.05 and 24.11 do not
    # know the new one.
    local job_container="JobContainerType=job_container/tmpfs"
    version_at_least 25.11 && job_container="NamespaceType=namespace/tmpfs"
    local site_lines="# Site profile: $SITE (cluster/README.md, \"Site profiles\")."
    case $SITE in
    shared-tmp) job_container="# (site shared-tmp: no per-job /tmp; every job sees the machine's /tmp)" ;;
    # Sites make --export=NONE sbatch's default with a cli_filter (or SBATCH_EXPORT=NONE in the
    # login profile): the clients run cli_filter.lua, beside slurm.conf, before every submission.
    export-none) site_lines+=$'\n'"CliFilterPlugins=cli_filter/lua" ;;
    # From 26.05 a step's tasks follow the topology plugin's order (CHANGELOG/slurm-26.05.md:
    # "Tasks and step nodes now follow topology order by default when a topology plugin is
    # configured"; topology/tree ranks nodes by leaf switch, topology_tree.c get_rank).
    rank0-elsewhere) site_lines+=$'\n'"TopologyPlugin=topology/tree" ;;
    # pyxis (NVIDIA's container plugin) sets rank variables in each task of a container step; a
    # TaskProlog sets them at the same point of a task's start (cluster/task_prolog.sh.in).
    pyxis | pyxis-hook) site_lines+=$'\n'"TaskProlog=$TASK_PROLOG" ;;
    esac
    TOPOLOGY_TEXT=""
    if [[ $SITE == rank0-elsewhere ]]; then
        local half=$(((NODES + 1) / 2))
        TOPOLOGY_TEXT=$(render "$HERE/topology.conf.in" "LEAF1=$(node_range $((half + 1)) "$NODES")" \
            "LEAF2=$(node_range 1 "$half")")
    fi
    CLI_FILTER_TEXT=""
    [[ $SITE == export-none ]] && CLI_FILTER_TEXT=$(<"$HERE/cli_filter.lua.in")
    TASK_PROLOG_TEXT=""
    if [[ $SITE == pyxis* ]]; then
        TASK_PROLOG_TEXT=$(render "$HERE/task_prolog.sh.in" "SITE=$SITE" "PATH=$TASK_PROLOG" \
            "HOOK=$([[ $SITE == pyxis-hook ]] && echo 1 || echo 0)")
    fi
    SLURM_CONF_TEXT=$(render "$HERE/slurm.conf.in" "SHAPE=$SHAPE" "CTL_NAME=$CTL_NAME" \
        "COMM_PARAMS=$comm" "DBD_PORT=$DBD_PORT" "MAIL_PROG=$HERE/mailprog.sh" \
        "CTL_ADDR=$CTL_ADDR" "CTL_PORT=$CTL_PORT" "ROOT=$CLUSTER_ROOT" "GRACE_S=$GRACE_S" \
        "NODE_LINES=${node_lines%$'\n'}" "NODE_LIST=$node_list" "VERSION_LINES=$version_lines" \
        "JOB_CONTAINER=$job_container" "SITE_LINES=$site_lines")
    GRES_CONF_TEXT=$(render "$HERE/gres.conf.in" "GRES_LINES=$gres_lines")
    local disk_lines=""
    for ((i = 1; i <= NODES; i++)); do
        disk_lines+="NodeName=node$i AutoBasePath=true BasePath=$NODE_DISK_DIR/node$i"$'\n'
    done
    JOB_CONTAINER_CONF_TEXT=$(render "$HERE/job_container.conf.in" "NODE_LINES=${disk_lines%$'\n'}")
    CGROUP_CONF_TEXT=$(<"$HERE/cgroup.conf.in")
    # CgroupAutomount is defunct from 23.11 on (NEWS of 23.11.0rc1; 24.11 logs an error for it).
    [[ $SLURM_VERSION == 22.05 ]] || CGROUP_CONF_TEXT=$(grep -v '^CgroupAutomount=' <<<"$CGROUP_CONF_TEXT")
    local pass=""
    [[ -s $DB_DIR/slurm.pass ]] && pass=$(<"$DB_DIR/slurm.pass")
    DBD_CONF_TEXT=$(render "$HERE/slurmdbd.conf.in" "CTL_NAME=$CTL_NAME" "CTL_ADDR=$CTL_ADDR" \
        "DBD_PORT=$DBD_PORT" "DB_PORT=$DB_PORT" "DB_PASS=$pass" "ROOT=$CLUSTER_ROOT" \
        "DB_NAME=$(db_name)")
}

# The slurm.conf text without its FirstJobId line (which up.sh takes from the database).
without_first_job_id() {
    grep -v '^FirstJobId=' <<<"$1" || true
}

hosts_block() {
    local i
    echo "$HOSTS_BEGIN"
    echo "$CTL_ADDR $CTL_NAME"
    for ((i = 1; i <= NODES; i++)); do
        echo "$CLUSTER_NET.$i node$i"
    done
    # torch's rendezvous store (TCPStore) listens on an IPv6 socket, sees an IPv4 client as
    # ::ffff:a.b.c.d and names it with getnameinfo(); glibc's files backend does not map that
    # form back to the IPv4 line, and the nodes reach no DNS server, so every rank would print
    # "[c10d] The hostname of the client socket cannot be retrieved. err=-3". These lines answer
    # that reverse lookup; forward lookups still list the IPv4 address first.
    echo "::ffff:127.0.0.1 localhost"
    echo "::ffff:$CTL_ADDR $CTL_NAME"
    for ((i = 1; i <= NODES; i++)); do
        echo "::ffff:$CLUSTER_NET.$i node$i"
    done
    echo "$HOSTS_END"
}

# Replace our marked block in /etc/hosts (in place: the file may be a mount).
write_hosts() {
    write_hosts_text "$(hosts_without_block)"$'\n'"$(hosts_block)"
}

# client_text NAME: the script write_clients puts in CLIENT_DIR for the root's client NAME. It runs
# the root's program with the root's loader and libraries, in this machine's filesystem (so any
# user can run it, from any folder); the root's PluginDir (slurm.conf) gives it its plugins.
client_text() {
    local lib loader
    lib=$(root_libdir)
    loader=$(echo "$lib"/ld-linux*.so.[0-9])
    printf '%s\n' '#!/bin/sh' \
        "$CLIENT_MARK of Slurm $SLURM_VERSION, written by cluster/up.sh --slurm $SLURM_VERSION" \
        "# (cluster/down.sh removes it): $1 from $SLURM_ROOT, with that root's own libraries." \
        "exec $loader --library-path $lib/slurm-wlm:$lib --argv0 $1 $SLURM_ROOT/usr/bin/$1 \"\$@\""
}

write_clients() {
    local name
    for name in $SLURM_CLIENTS; do
        [[ -x $SLURM_ROOT/usr/bin/$name ]] || continue
        client_text "$name" >"$CLIENT_DIR/.$name.new"
        chmod 755 "$CLIENT_DIR/.$name.new"
        mv -f "$CLIENT_DIR/.$name.new" "$CLIENT_DIR/$name"
    done
}

# Is the cluster already running with exactly this configuration?
already_up() {
    # The client commands of its version (write_clients), or this machine's own.
    if [[ -n $SLURM_ROOT ]]; then
        [[ $(client_text sbatch) == "$(cat "$CLIENT_DIR/sbatch" 2>/dev/null)" ]] || return 1
    else
        ! our_client sbatch || return 1
    fi
    [[ -f $CLUSTER_ROOT/shape && $(<"$CLUSTER_ROOT/shape") == "$SHAPE" ]] || return 1
    [[ -f $SLURM_CONF ]] || return 1
    [[ $(without_first_job_id "$(<"$SLURM_CONF")") == "$(without_first_job_id "$SLURM_CONF_TEXT")" ]] ||
        return 1
    [[ -f $SLURMDBD_CONF && $(<"$SLURMDBD_CONF") == "$DBD_CONF_TEXT" ]] || return 1
    [[ -f $GRES_CONF && $(<"$GRES_CONF") == "$GRES_CONF_TEXT" ]] || return 1
    [[ -f $CGROUP_CONF && $(<"$CGROUP_CONF") == "$CGROUP_CONF_TEXT" ]] || return 1
    [[ -f $JOB_CONTAINER_CONF && $(<"$JOB_CONTAINER_CONF") == "$JOB_CONTAINER_CONF_TEXT" ]] ||
        return 1
    [[ $(cat "$CLI_FILTER_CONF" 2>/dev/null) == "$CLI_FILTER_TEXT" ]] || return 1
    [[ $(cat "$TOPOLOGY_CONF" 2>/dev/null) == "$TOPOLOGY_TEXT" ]] || return 1
    [[ $(cat "$TASK_PROLOG" 2>/dev/null) == "$TASK_PROLOG_TEXT" ]] || return 1
    [[ $(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0==b{on=1} on{print} $0==e{on=0}' "$HOSTS_FILE") == "$(hosts_block)" ]] ||
        return 1
    local i
    ip link show "$BRIDGE" >/dev/null 2>&1 || return 1
    for ((i = 1; i <= NODES; i++)); do
        [[ -e /run/netns/$NETNS_PREFIX$i ]] || return 1
    done
    local n pid count=0
    while read -r n pid; do
        pid_alive "$pid" "$n" || return 1
        count=$((count + 1))
    done < <(recorded_daemons)
    ((count >= NODES + 3)) || return 1
    # Nodes busy with other people's jobs are fine; down or drained ones are not.
    local states
    states=$(timeout 10 "$(client_path sinfo)" -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
    [[ $(wc -l <<<"$states") -eq $NODES ]] || return 1
    ! grep -qvE ' (idle|mix|alloc|comp)$' <<<"$states"
}

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
    for ((i = 0; i < 100; i++)); do
        (: </dev/tcp/"$CTL_ADDR"/"$DBD_PORT") 2>/dev/null && break
        sleep 0.1
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
register_cluster() {
    local out
    out=$(timeout 20 "$(client_path sacctmgr)" -n -P list cluster format=cluster 2>&1) ||
        die "sacctmgr cannot reach slurmdbd: $out; see $LOG_DIR/slurmdbd.log"
    grep -qx course <<<"$out" && return 0
    timeout 20 "$(client_path sacctmgr)" -i add cluster course >>"$LOG_DIR/start.log" 2>&1 ||
        die "sacctmgr could not add cluster 'course'; see $LOG_DIR/start.log"
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

mkdir -p "$CLUSTER_ROOT"
take_lock
if [[ -n $SLURM_ROOT && ! -f $SLURM_ROOT/.course-slurm-root ]] && ((CHECK_ONLY)); then
    note "not up in this shape ($SHAPE): no root for Slurm $SLURM_VERSION yet"
    exit 1
fi
((CHECK_ONLY)) || install_packages
((CHECK_ONLY)) || ensure_student
if [[ -n $SLURM_ROOT ]] && ((!CHECK_ONLY)); then
    bash "$HERE/slurm_root.sh" "$SLURM_VERSION" >/dev/null || exit 1
fi
render_configs

if already_up; then
    note "already up ($SHAPE)"
    exit 0
fi
if ((CHECK_ONLY)); then
    note "not up in this shape ($SHAPE)"
    exit 1
fi

# Everything the cluster needs from this machine, checked before anything is stopped or started.
check_cgroups() {
    local c probe
    for c in memory freezer cpuset devices; do
        probe=$CGROUP_ROOT/$c/course-probe-$$
        if ! mkdir "$probe" 2>/dev/null; then
            die "cgroups: cannot create a group in $CGROUP_ROOT/$c (cgroup v1 '$c' hierarchy" \
                "missing or read-only): run on a host (or a container with --privileged" \
                "--cgroupns=host) where /sys/fs/cgroup/$c is a writable cgroup v1 mount"
        fi
        rmdir "$probe"
    done
}
check_cgroups

# Another version's clients go where up.sh's own scripts may go, never over someone's program.
check_client_dir() {
    local name
    [[ -n $SLURM_ROOT ]] || return 0
    mkdir -p "$CLIENT_DIR"
    for name in $SLURM_CLIENTS; do
        if [[ -e $CLIENT_DIR/$name ]] && ! our_client "$name"; then
            die "$CLIENT_DIR/$name is in the way: Slurm $SLURM_VERSION's clients go there (first on" \
                "PATH), and up.sh overwrites only the scripts it wrote; move it, or run the default version"
        fi
    done
}
check_client_dir

# Namespaces, veth pairs and a bridge need CAP_NET_ADMIN; the private network must be free.
check_network() {
    [[ $CLUSTER_NET =~ ^(10\.[0-9]{1,3}|192\.168|172\.(1[6-9]|2[0-9]|3[01]))\.[0-9]{1,3}$ ]] ||
        die "COURSE_CLUSTER_NET='$CLUSTER_NET' is not the first three numbers of a private" \
            "address (10.x.y, 172.16-31.y, 192.168.y); unset it or use e.g. 10.213.0"
    local probe=course-p$$ out
    { command -v ip && command -v nsenter; } >/dev/null ||
        die "network: the commands ip (iproute2) and nsenter (util-linux) are needed; install them"
    if ! out=$(ip netns add "$probe" 2>&1 && ip link add "$probe" type bridge 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        die "network: cannot create a network namespace or a bridge ($out): the nodes need" \
            "CAP_NET_ADMIN; run as root on a host, or in a container started with --cap-add=NET_ADMIN"
    fi
    ip link del "$probe" 2>/dev/null || true
    ip netns del "$probe"
    out=$(ip -4 -o addr show 2>/dev/null | awk -v b="$BRIDGE" '$2 != b {print $2, $4}' |
        grep -F " $CLUSTER_NET." || true)
    [[ -z $out ]] || die "network: $CLUSTER_NET.0/24 is already used on this machine (${out%%$'\n'*});" \
        "pick another private /24 with COURSE_CLUSTER_NET=10.214.0 (say)"
}
check_network

# The kernel keeps one ARP table for all network namespaces (arp_tbl; its limits are the
# net.ipv4.neigh.default.gc_thresh* sysctls of this machine's namespace, 128/512/1024 by
# default). Every node of a job that talks to every other one, as a 64-rank gloo group does,
# puts an entry per peer in its namespace: about (nodes + 1) x nodes in all, 1,056 at 32 nodes.
# Past gc_thresh3 the kernel logs "neighbor table overflow!", new peers go unresolved, and
# connections fail with "No route to host" or time out (srun loses its tasks' exit messages
# and waits for ever). Raise the limits to fit this cluster; never lower them.
grow_neighbour_table() {
    local need=$(((NODES + 1) * (NODES + 1) * 2)) level key current want
    for level in 1 2 3; do
        key=/proc/sys/net/ipv4/neigh/default/gc_thresh$level
        [[ -w $key ]] || continue
        current=$(<"$key")
        want=$((need * level / 3))
        ((current < want)) && echo "$want" >"$key"
    done
    return 0
}

# A bridge in this machine's namespace (the controller's address) and, for every node, a
# network namespace with its own loopback and an eth0 on the bridge. Nothing outside this
# private network is routed to or from it.
start_network() {
    local i ns
    grow_neighbour_table
    ip link add "$BRIDGE" type bridge
    ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 1; i <= NODES; i++)); do
        ns=$NETNS_PREFIX$i
        ip netns add "$ns"
        ip link add "$VETH_PREFIX$i" type veth peer name eth0 netns "$ns"
        ip link set "$VETH_PREFIX$i" master "$BRIDGE" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$CLUSTER_NET.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

start_time=$EPOCHREALTIME
note "starting ($SHAPE)"
stop_cluster keep-munge
# Anything slurm-like still running was not started by us: refuse to fight it. (In this PID
# namespace only: a cluster that cluster/apart.sh runs beside this one is not in our way.)
for name in slurmctld slurmd slurmdbd; do
    others=()
    for pid in $(pgrep -x "$name" --ns $$ --nslist pid || true); do
        pid_alive "$pid" "$name" && others+=("$pid")
    done
    if [[ ${#others[@]} -gt 0 ]]; then
        die "a $name not started by cluster/up.sh is running (pid ${others[*]}); stop it first"
    fi
done

mkdir -p "$LOG_DIR" "$RUN_DIR" "$CLUSTER_ROOT/state" "$CLUSTER_ROOT/spool" /etc/slurm
touch "$RUN_DIR/daemons"
: >"$RUN_DIR/uts"
for f in slurmctld.log slurmdbd.log mariadb.log start.log; do : >"$LOG_DIR/$f"; done
rm -f "$LOG_DIR"/slurmd-node*.log

write_hosts
printf '%s\n' "$SLURM_CONF_TEXT" >"$SLURM_CONF"
printf '%s\n' "$GRES_CONF_TEXT" >"$GRES_CONF"
printf '%s\n' "$CGROUP_CONF_TEXT" >"$CGROUP_CONF"
printf '%s\n' "$JOB_CONTAINER_CONF_TEXT" >"$JOB_CONTAINER_CONF"
chmod 644 "$SLURM_CONF" "$GRES_CONF" "$CGROUP_CONF" "$JOB_CONTAINER_CONF"
rm -f "$CLI_FILTER_CONF" "$TOPOLOGY_CONF" "$TASK_PROLOG"
if [[ -n $TASK_PROLOG_TEXT ]]; then
    printf '%s\n' "$TASK_PROLOG_TEXT" >"$TASK_PROLOG"
    chmod 755 "$TASK_PROLOG"
fi
if [[ -n $TOPOLOGY_TEXT ]]; then
    printf '%s\n' "$TOPOLOGY_TEXT" >"$TOPOLOGY_CONF"
    chmod 644 "$TOPOLOGY_CONF"
fi
if [[ -n $CLI_FILTER_TEXT ]]; then
    printf '%s\n' "$CLI_FILTER_TEXT" >"$CLI_FILTER_CONF"
    chmod 644 "$CLI_FILTER_CONF"
fi
rm -rf "${NODE_DISK_DIR:?}"
mkdir -p "$NODE_DISK_DIR"
# One mailbox per user (see cluster/mailprog.sh), which slurmctld runs directly.
mkdir -p "$MAIL_DIR"
[[ -x $HERE/mailprog.sh ]] || chmod 755 "$HERE/mailprog.sh"
for ((g = 0; g < GPUS; g++)); do
    # Spare character devices (same numbers as /dev/null) stand in for GPUs.
    [[ -c $GPU_DEV_PREFIX$g ]] || mknod -m 666 "$GPU_DEV_PREFIX$g" c 1 3
done

# Never leave a half-started cluster: whatever fails from here stops what was started.
started_ok=0
on_exit() {
    if ((!started_ok)); then
        trap - EXIT
        note "stopping what was started"
        stop_cluster all || true
    fi
}
trap on_exit EXIT
if [[ -n $SLURM_ROOT ]]; then
    write_clients
    root_binds
fi
start_network >>"$LOG_DIR/start.log" 2>&1 ||
    die "network: could not create the bridge and namespaces; see $LOG_DIR/start.log"
start_munge
start_accounting
SLURM_CONF_TEXT=${SLURM_CONF_TEXT/FirstJobId=1/FirstJobId=$(first_job_id)}
printf '%s\n' "$SLURM_CONF_TEXT" >"$SLURM_CONF"
register_cluster
start_slurm
wait_idle
started_ok=1
echo "$SHAPE" >"$CLUSTER_ROOT/shape"
elapsed=$(awk -v a="$start_time" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.1f", b-a}')
note "up in $elapsed s: $SHAPE; logs in $LOG_DIR"
if [[ $SITE == rank0-elsewhere ]] && ! version_at_least 26.05; then
    note "site rank0-elsewhere: Slurm $SLURM_VERSION lays a step's tasks out in host list order, not by topology (26.05 does): task 0 stays on the first node; --distribution=arbitrary moves it (cluster/README.md)"
fi
