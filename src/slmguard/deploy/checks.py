"""The numbers a deployment must satisfy before anything is written.

Pure arithmetic on the plan (and the target's MemTotal and huge pages when
they are known). Each check raises :class:`~slmguard.errors.RefusedError`
(exit 78) with the numbers in the message and in ``facts``:

- the inference zone's MemoryMax above RAM minus the OS reserve (the plan's
  RAM, and the target's MemTotal when it can be read);
- MemoryMax + the business zone's guarantee + the OS reserve above RAM;
- a CMA pool above half of RAM;
- ``vm.overcommit_memory = 2`` with a CommitLimit that would not admit the
  planned commit charge (CommitLimit = (RAM - huge pages) * ratio / 100 + swap;
  swap counts as 0 because the deployment turns it off).
"""

from __future__ import annotations

from slmguard.deploy import escape
from slmguard.deploy.units import business_guarantee_bytes
from slmguard.errors import RefusedError
from slmguard.plan.schema import Plan

MiB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


def _check_host_mem_total(plan: Plan, host_mem_total_bytes: int) -> None:
    lim, ram = plan.limits, plan.board.ram_bytes
    host_usable = host_mem_total_bytes - lim.os_reserve_bytes
    if lim.memory_max_bytes > host_usable:
        raise RefusedError(
            f"MemoryMax {_mib(lim.memory_max_bytes)} is above this host's MemTotal "
            f"{_mib(host_mem_total_bytes)} minus the OS reserve "
            f"{_mib(lim.os_reserve_bytes)} = {_mib(host_usable)} (the plan is for "
            f"{escape.label(plan.board.name)} with {_mib(ram)})",
            facts={
                "memory_max_bytes": lim.memory_max_bytes,
                "host_mem_total_bytes": host_mem_total_bytes,
                "os_reserve_bytes": lim.os_reserve_bytes,
                "ram_bytes": ram,
            },
            hint="plan for this board (slmguard plan --board auto)",
        )


def _check_ram(plan: Plan) -> None:
    lim, ram = plan.limits, plan.board.ram_bytes
    usable = ram - lim.os_reserve_bytes
    if lim.memory_max_bytes > usable:
        raise RefusedError(
            f"MemoryMax {_mib(lim.memory_max_bytes)} is above RAM {_mib(ram)} minus the OS "
            f"reserve {_mib(lim.os_reserve_bytes)} = {_mib(usable)}",
            facts={
                "memory_max_bytes": lim.memory_max_bytes,
                "ram_bytes": ram,
                "os_reserve_bytes": lim.os_reserve_bytes,
            },
            hint="plan again with a smaller context or model",
        )
    mem_min, _ = business_guarantee_bytes(plan)
    total = lim.memory_max_bytes + mem_min + lim.os_reserve_bytes
    if total > ram:
        raise RefusedError(
            f"MemoryMax {_mib(lim.memory_max_bytes)} + business guarantee {_mib(mem_min)} + "
            f"OS reserve {_mib(lim.os_reserve_bytes)} = {_mib(total)} is above RAM {_mib(ram)}",
            facts={
                "memory_max_bytes": lim.memory_max_bytes,
                "business_reserve_bytes": mem_min,
                "os_reserve_bytes": lim.os_reserve_bytes,
                "total_bytes": total,
                "ram_bytes": ram,
            },
            hint="lower the business reserve or the model's limit in the plan",
        )


def _check_cma(plan: Plan) -> None:
    cma, ram = plan.kernel.cma_bytes, plan.board.ram_bytes
    if cma is not None and cma > ram // 2:
        raise RefusedError(
            f"cma= {_mib(cma)} is above half of RAM ({_mib(ram // 2)})",
            facts={"cma_bytes": cma, "ram_bytes": ram},
            hint="the CMA pool is carved out of RAM at boot; keep it to what the NPU needs",
        )


def _check_commit_limit(plan: Plan, hugetlb_bytes: int, host_mem_total_bytes: int | None) -> None:
    k = plan.kernel
    if k.overcommit_memory != 2:
        return
    base, what = (
        (plan.board.ram_bytes, "RAM")
        if host_mem_total_bytes is None
        else (host_mem_total_bytes, "MemTotal")
    )
    commit_limit = (base - hugetlb_bytes) * k.overcommit_ratio // 100
    if k.commit_charge_bytes > commit_limit:
        raise RefusedError(
            f"vm.overcommit_memory=2 with overcommit_ratio={k.overcommit_ratio}: "
            f"CommitLimit ({_mib(base)} {what} - {_mib(hugetlb_bytes)} huge pages) * "
            f"{k.overcommit_ratio}% + 0 swap = {_mib(commit_limit)} would not admit "
            f"the planned commit charge {_mib(k.commit_charge_bytes)}",
            facts={
                "commit_limit_bytes": commit_limit,
                "commit_charge_bytes": k.commit_charge_bytes,
                "ram_bytes": base,
                "hugetlb_bytes": hugetlb_bytes,
                "overcommit_ratio": k.overcommit_ratio,
            },
            hint="raise overcommit_ratio or use overcommit_memory=0 in the plan",
        )


def check_numbers(
    plan: Plan, *, hugetlb_bytes: int = 0, host_mem_total_bytes: int | None = None
) -> None:
    """Refuse a plan whose numbers cannot hold on this board (see the module docstring).

    ``host_mem_total_bytes`` is the target's MemTotal when it can be read: a
    plan made for a bigger board is refused there, and CommitLimit is computed
    from it as the kernel does (totalram, not the nominal size).
    """
    if host_mem_total_bytes is not None:
        _check_host_mem_total(plan, host_mem_total_bytes)
    _check_ram(plan)
    _check_cma(plan)
    _check_commit_limit(plan, hugetlb_bytes, host_mem_total_bytes)
