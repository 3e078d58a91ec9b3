#!/bin/bash
# The nodes' private network for cluster/up.sh: the check that this machine can make it, the
# bridge and one network namespace per node, and their names in /etc/hosts (sourced by up.sh,
# not run).

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
