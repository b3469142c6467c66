"""The host audit: every check, run on one :class:`~slmguard.host.snapshot.HostSnapshot`.

Owns what "deployable" means as a whole: the list of checks (:data:`CHECKS`,
in report order) and :func:`run_checks`, which runs them and notes what could
not be seen. Each check is a function ``(snapshot, plan) -> Finding`` with an
id, a severity (``pass``, ``warn``, ``fail``, ``unknown``), the evidence (each
value with the file it was read from) and the fix (the exact command or file
line). Checks never read files; ``host.snapshot`` collects, ``commands.doctor``
prints. Without a plan, kernel settings are compared with the plan defaults
(swappiness 0, overcommit 2 / 80) and checks that need the plan's numbers say
``unknown``.

The checks live by concern in this package: ``swap`` (swap, zram), ``kernel``
(sysctl, cgroup v2, PSI), ``devices`` (CMA, NPU/GPU nodes, DMA-BUF, board), ``gpu``
(the offload's GPU nodes, their permissions, the driver and its version),
``memory`` (free memory, memlock), ``unit`` (the systemd unit's limits,
model, sections, start limit, user, CPU affinity), ``bind`` (listen address and
API key), ``storage`` (noatime on the state directory, the journal's size: an SD
card's wear), ``neighbours`` (a board's other services: installed, protected, within
their memory), ``model`` (the model's sha256, only when the snapshot hashed it:
``--verify-model``) and ``tuning`` (the board's clocks, power mode, throttle flags
and heat, judged by :mod:`slmguard.tuning`); the result model is ``findings``. This
module re-exports the names callers use.

Exit status (``Report.exit_code``): 0 every check passed, 1 a warning, 2 a
failure (``unknown`` does not change it unless ``strict``); 3, could not run,
is the CLI's (bad root, plan or unit argument).
"""

from __future__ import annotations

from slmguard.doctor.bind import check_unit_bind, is_public
from slmguard.doctor.devices import (
    check_accelerators,
    check_board,
    check_board_hardware,
    check_cma,
    check_dmabuf,
)
from slmguard.doctor.findings import (
    FAIL,
    MIB,
    PASS,
    SEVERITIES,
    UNKNOWN,
    WARN,
    Check,
    Evidence,
    Finding,
    Report,
    mib,
)
from slmguard.doctor.gpu import check_gpu_driver, check_gpu_nodes
from slmguard.doctor.kernel import check_cgroup, check_overcommit, check_psi, check_swappiness
from slmguard.doctor.memory import check_free_memory, check_memlock
from slmguard.doctor.model import check_model_files, check_model_sha256
from slmguard.doctor.neighbours import check_neighbours
from slmguard.doctor.storage import check_journal, check_noatime
from slmguard.doctor.swap import check_swap_boot, check_swap_off, check_zram_boot, check_zram_off
from slmguard.doctor.tuning import TUNING_CHECKS
from slmguard.doctor.unit import (
    check_cpu_affinity,
    check_unit_memory,
    check_unit_model,
    check_unit_oom_score,
    check_unit_sections,
    check_unit_start_limit,
    check_unit_user,
)
from slmguard.host.boardstate import BoardState
from slmguard.host.snapshot import HostSnapshot
from slmguard.plan.schema import Plan

__all__ = [
    "CHECKS",
    "FAIL",
    "MIB",
    "PASS",
    "SEVERITIES",
    "UNKNOWN",
    "WARN",
    "Check",
    "Evidence",
    "Finding",
    "Report",
    "is_public",
    "mib",
    "run_checks",
]

CHECKS: tuple[Check, ...] = (
    check_swap_off,
    check_swap_boot,
    check_zram_off,
    check_zram_boot,
    check_swappiness,
    check_overcommit,
    check_cgroup,
    check_cma,
    check_memlock,
    check_free_memory,
    check_psi,
    check_accelerators,
    check_dmabuf,
    check_gpu_nodes,
    check_gpu_driver,
    check_board,
    check_board_hardware,
    check_unit_memory,
    check_unit_model,
    check_unit_oom_score,
    check_unit_sections,
    check_unit_start_limit,
    check_unit_user,
    check_unit_bind,
    check_cpu_affinity,
    check_noatime,
    check_journal,
    *TUNING_CHECKS,
    check_neighbours,
)


def run_checks(snapshot: HostSnapshot, plan: Plan | None = None) -> Report:
    """Every check on one snapshot. Pure: same snapshot and plan, same report.

    ``model.sha256`` joins them when the snapshot hashed the model (``--verify-model``),
    with one finding for each other file of the plan it hashed (a board's models, the
    projector).
    """
    checks = CHECKS + ((check_model_sha256,) if snapshot.model_digest is not None else ())
    findings = tuple(check(snapshot, plan) for check in checks)
    findings += check_model_files(snapshot, plan)
    not_seen = tuple(str(u) for u in snapshot.unread)
    if isinstance(snapshot.board, BoardState):
        not_seen += snapshot.board.errors
    if snapshot.euid != 0:
        not_seen += ("not root: debugfs (rknpu, dma_buf) and other users' limits are hidden",)
    return Report(str(snapshot.root), snapshot.euid, findings, not_seen)
