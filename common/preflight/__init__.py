"""Lesson 06's preflight: will a distributed job's processes find each other?  Ask before the
real job, with its layout: ``srun python -m common.preflight || exit 1`` (cli.py says how)."""

from common.preflight.across import compare, named_networks
from common.preflight.allreduce import (
    ALLREDUCE_DTYPE,
    AllreduceResult,
    allreduce_expected,
    allreduce_problem,
    allreduce_value,
    nccl_allreduce,
    tiny_allreduce,
    wrong_sum,
)
from common.preflight.cli import DEFAULT_TIMEOUT_S, TIMEOUT_VAR, exported_by_hand, main
from common.preflight.helpers import (
    PREFIX,
    Problem,
    clock_offset,
    format_ranks,
    gloo_ifname_matches,
    is_loopback,
    nccl_ifname_matches,
    problem,
    problem_line,
)
from common.preflight.meeting import CLOCK_SHIFT_VAR, Outcome, meet
from common.preflight.task import (
    IFNAME_VARS,
    Facts,
    check_gpus,
    check_ifname_vars,
    check_master,
    interfaces,
    local_facts,
    route_to,
)

__all__ = [
    "ALLREDUCE_DTYPE", "AllreduceResult", "CLOCK_SHIFT_VAR", "DEFAULT_TIMEOUT_S", "Facts",
    "IFNAME_VARS", "Outcome", "PREFIX", "Problem", "TIMEOUT_VAR", "allreduce_expected",
    "allreduce_problem", "allreduce_value", "check_gpus", "check_ifname_vars", "check_master",
    "clock_offset", "compare", "exported_by_hand", "format_ranks", "gloo_ifname_matches",
    "interfaces", "is_loopback", "local_facts", "main", "meet", "named_networks",
    "nccl_allreduce", "nccl_ifname_matches", "problem", "problem_line", "route_to",
    "tiny_allreduce", "wrong_sum",
]  # fmt: skip
