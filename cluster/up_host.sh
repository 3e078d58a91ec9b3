#!/bin/bash
# What cluster/up.sh needs from this machine: the packages and the student's account it adds
# when missing, and the checks made before anything is stopped or started (sourced by up.sh,
# not run).

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

# Jobs run in cgroups (proctrack/cgroup, task/cgroup): each v1 hierarchy must take a new group.
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

# Anything slurm-like still running was not started by us: refuse to fight it. (In this PID
# namespace only: a cluster that cluster/apart.sh runs beside this one is not in our way.)
check_no_strays() {
    local name pid others
    for name in slurmctld slurmd slurmdbd; do
        others=()
        for pid in $(pgrep -x "$name" --ns $$ --nslist pid || true); do
            pid_alive "$pid" "$name" && others+=("$pid")
        done
        if [[ ${#others[@]} -gt 0 ]]; then
            die "a $name not started by cluster/up.sh is running (pid ${others[*]}); stop it first"
        fi
    done
}
