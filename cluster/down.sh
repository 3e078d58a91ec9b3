#!/bin/bash
# shellcheck source-path=SCRIPTDIR
# Stop the local SLURM cluster started by cluster/up.sh: cancel its jobs, stop
# every daemon up.sh started (by recorded pid), and remove run-time state.
# Logs stay in the log directory for reading afterwards.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

case ${1:-} in
-h | --help)
    echo "Usage: bash cluster/down.sh   (stop the local cluster; logs stay in $LOG_DIR)"
    exit 0
    ;;
"") ;;
*) die "unknown option '$1' (down.sh takes no options; see --help)" ;;
esac

[[ $(id -u) -eq 0 ]] || die "run as root: it stops the daemons cluster/up.sh started"
mkdir -p "$CLUSTER_ROOT"
take_lock
stop_cluster all
# The node names up.sh added to /etc/hosts go too: nothing of the cluster is left.
write_hosts_text "$(hosts_without_block)"
note "down"
