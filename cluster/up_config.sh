#!/bin/bash
# The files cluster/up.sh writes: Slurm's configuration rendered from the templates beside it
# (cluster/*.in), the client commands of a version from a root, and the test whether the cluster
# that runs is already the one these describe (sourced by up.sh, not run).

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
    local job_requeue=1
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
    # Sites that requeue a batch job only if it asks (sbatch --requeue; JobRequeue in
    # slurm.conf(5)): after a node failure any other job ends NODE_FAIL.
    no-requeue) job_requeue=0 ;;
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
        "JOB_CONTAINER=$job_container" "SITE_LINES=$site_lines" "JOB_REQUEUE=$job_requeue")
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

# Write what render_configs rendered into /etc/slurm; a site's optional file (cli_filter.lua,
# topology.conf, the TaskProlog) is removed when this site has none.
write_configs() {
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
