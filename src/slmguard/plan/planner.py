"""The planner: from model facts and a board profile to a :class:`Plan`.

Owns the choices (context size, batch, KV type, threads, CPU affinity,
MemoryHigh/MemoryMax, governor watermarks, CMA size, overcommit settings),
each with its reason in ``plan.reasons``. Pure: the caller reads the model
header and the board; the arithmetic is :mod:`slmguard.plan.budget`.

Policy, in order:

1. The inference zone is RAM minus the OS, business and NPU/GPU reserves.
2. The service fits when its peak (anonymous memory at a full context plus the
   hot file-backed weights and libraries) plus 10 % headroom fits in the zone.
3. Context: the largest multiple of 256 up to the trained length that fits
   with an f16 KV cache and n_batch 512; a requested ``--ctx`` is checked
   instead. When it does not fit, smaller batches (256, 128, 64: less compute
   buffer) and then a q8_0 KV cache are tried before refusing.
4. The commit charge (every reserved buffer, thread stacks, the OS and
   business reserves) must fit under ``vm.overcommit_memory=2`` with
   ``overcommit_ratio`` <= 100 and no swap; a smaller batch is tried when it
   does not.
5. MemoryMax is the zone; MemoryHigh sits 5 % (at least 64 MiB) below it so
   the kernel throttles and reclaims before it OOM-kills. Watermarks put the
   planned peak below the shed threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slmguard.errors import PlanError
from slmguard.plan.boards import BoardProfile
from slmguard.plan.budget import Budget, BudgetInput, compute_budget
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.schema import (
    BoardSpec,
    EngineSettings,
    KernelSettings,
    Limits,
    ModelSpec,
    Plan,
    Watermarks,
)

MiB = 1 << 20
HEADROOM = 0.10
MIN_CTX = 512
CTX_STEP = 256
BATCHES = (512, 256, 128, 64)
KV_TYPES = ("f16", "q8_0")
MAX_OVERCOMMIT_RATIO = 100


@dataclass(frozen=True)
class PlanRequest:
    facts: ModelFacts
    board: BoardProfile
    ctx: int | None = None
    n_batch: int | None = None
    kv_type: str | None = None
    model_path: str | None = None
    preset: str | None = None
    quant: str | None = None


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB"


def zone_bytes(board: BoardProfile) -> int:
    """RAM left for the inference service after the reserves beside it."""
    return (
        board.ram_bytes
        - board.os_reserve_bytes
        - board.business_reserve_bytes
        - board.npu_reserve_bytes
    )


def threads_and_affinity(board: BoardProfile) -> tuple[int, tuple[int, ...], str, str]:
    """(n_threads, CPU affinity, reason for threads, reason for affinity)."""
    big = board.big_cores or board.cpus
    n = len(big)
    why_threads = f"one per big core ({n})"
    if board.max_threads is not None and board.max_threads < n:
        n = board.max_threads
        why_threads = f"the cgroup CPU quota allows {n} of the {len(big)} usable big cores"
    heterogeneous = set(big) != set(board.cpus)
    if heterogeneous:
        affinity = tuple(big)
        why_aff = (
            f"pin to the big cores {','.join(map(str, big))}: a thread on a little core "
            "stalls every matrix multiply for the whole group"
        )
    else:
        affinity = ()
        why_aff = "all cores are the same: no pinning, the scheduler balances"
    return max(n, 1), affinity, why_threads, why_aff


def _budget(req: PlanRequest, n_ctx: int, n_batch: int, kv: str, threads: int) -> Budget:
    b = req.board
    return compute_budget(
        BudgetInput(
            facts=req.facts,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            kv_type=kv,
            isa=b.isa,
            npu_reserve_bytes=b.npu_reserve_bytes,
            os_reserve_bytes=b.os_reserve_bytes,
            business_reserve_bytes=b.business_reserve_bytes,
        )
    )


def _need(budget: Budget) -> int:
    return math.ceil(budget.service_hot_bytes * (1 + HEADROOM))


def _others_commit(board: BoardProfile) -> int:
    """Commit charge of everything but the service.

    A profile assumes the OS and business zones commit what they reserve; on
    the host itself (``--board auto``) the current Committed_AS is used when it
    is larger (it includes the service if that is already running: the plan
    then errs on the safe side).
    """
    reserved = board.os_reserve_bytes + board.business_reserve_bytes
    return max(reserved, board.committed_bytes or 0)


def _commit_total(board: BoardProfile, budget: Budget) -> int:
    return budget.service_commit_bytes + _others_commit(board)


def _commit_ratio(board: BoardProfile, commit: int) -> int:
    return math.ceil(commit * (1 + HEADROOM) * 100 / board.ram_bytes)


def _fits(req: PlanRequest, budget: Budget) -> bool:
    return _need(budget) <= zone_bytes(req.board) and (
        _commit_ratio(req.board, _commit_total(req.board, budget)) <= MAX_OVERCOMMIT_RATIO
    )


def _candidates(facts: ModelFacts) -> list[int]:
    top = facts.n_ctx_train if facts.n_ctx_train > 0 else 32_768
    top = max(MIN_CTX, top // CTX_STEP * CTX_STEP)
    return list(range(top, MIN_CTX - 1, -CTX_STEP))


def _largest_ctx(req: PlanRequest, batch: int, kv: str, threads: int) -> tuple[int, Budget] | None:
    cands = _candidates(req.facts)
    # Memory grows monotonically with n_ctx: binary search the sorted candidates.
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        b = _budget(req, cands[mid], batch, kv, threads)
        if _fits(req, b):
            best, hi = (cands[mid], b), mid - 1
        else:
            lo = mid + 1
    return best


def make_plan(req: PlanRequest) -> Plan:
    """Choose every setting (see module docstring); raise PlanError when nothing fits."""
    f, board = req.facts, req.board
    zone = zone_bytes(board)
    if zone <= 0:
        raise PlanError(
            f"board {board.name}: the reserves ({_mib(board.ram_bytes - zone)}) leave no "
            f"memory of {_mib(board.ram_bytes)} for the model",
            need_bytes=board.ram_bytes - zone,
            have_bytes=board.ram_bytes,
        )
    threads, affinity, why_threads, why_aff = threads_and_affinity(board)
    if req.ctx is not None and req.ctx < 1:
        raise PlanError(f"--ctx {req.ctx}: must be at least 1")
    if req.ctx is not None and 0 < f.n_ctx_train < req.ctx:
        raise PlanError(
            f"--ctx {req.ctx} is beyond {f.name}'s trained context of {f.n_ctx_train} tokens",
            hint="quality degrades past the trained length; ask for at most that",
        )
    batches = (req.n_batch,) if req.n_batch else BATCHES
    kvs = (req.kv_type,) if req.kv_type else KV_TYPES
    chosen: tuple[int, int, str, Budget] | None = None
    smallest: Budget | None = None
    for kv in kvs:
        for batch in batches:
            if req.ctx is not None:
                b = _budget(req, req.ctx, batch, kv, threads)
                smallest = b if smallest is None or _need(b) < _need(smallest) else smallest
                if _fits(req, b):
                    chosen = (req.ctx, batch, kv, b)
            else:
                found = _largest_ctx(req, batch, kv, threads)
                if found is None:
                    b = _budget(req, MIN_CTX, batch, kv, threads)
                    smallest = b if smallest is None or _need(b) < _need(smallest) else smallest
                else:
                    chosen = (found[0], batch, kv, found[1])
            if chosen:
                break
        if chosen:
            break
    if chosen is None:
        assert smallest is not None
        ctx_text = f"n_ctx {req.ctx}" if req.ctx is not None else f"any n_ctx >= {MIN_CTX}"
        need = _need(smallest)
        commit = _commit_total(board, smallest)
        if need <= zone:
            raise PlanError(
                f"{f.name} on {board.name}: {ctx_text} needs a commit charge of {_mib(commit)} "
                f"but vm.overcommit_memory=2 admits at most {_mib(board.ram_bytes)} "
                "(ratio 100, no swap)",
                need_bytes=commit,
                have_bytes=board.ram_bytes,
                hint="use a smaller context or model, or a board with more RAM",
            )
        raise PlanError(
            f"{f.name} does not fit {board.name} at {ctx_text}: it needs {_mib(need)} "
            f"(peak {_mib(smallest.service_hot_bytes)} + {HEADROOM:.0%} headroom) but the "
            f"inference zone has {_mib(zone)} ({_mib(board.ram_bytes)} RAM - OS "
            f"{_mib(board.os_reserve_bytes)} - business {_mib(board.business_reserve_bytes)} - "
            f"NPU {_mib(board.npu_reserve_bytes)})",
            need_bytes=need,
            have_bytes=zone,
            hint="use a smaller --ctx, a smaller quantization (--preset NAME:Q4_K_M) or model",
        )
    n_ctx, n_batch, kv, budget = chosen
    return _assemble(req, n_ctx, n_batch, kv, budget, threads, affinity, why_threads, why_aff)


def _assemble(
    req: PlanRequest,
    n_ctx: int,
    n_batch: int,
    kv: str,
    budget: Budget,
    threads: int,
    affinity: tuple[int, ...],
    why_threads: str,
    why_aff: str,
) -> Plan:
    f, board = req.facts, req.board
    zone = zone_bytes(board)
    peak = budget.service_hot_bytes
    memory_max = zone // MiB * MiB
    gap = max(64 * MiB, math.ceil(memory_max / 20 / MiB) * MiB)
    memory_high = max(memory_max - gap, math.ceil(peak * (1 + HEADROOM / 2) / MiB) * MiB)
    memory_high = min(memory_high, memory_max)
    peak_pct = peak * 100 / memory_high
    # Shed above the planned peak (a full context is normal load, not an
    # emergency); keep the ladder strictly ordered below 100 %, with the
    # governor's own spacing (85 / 92 / 97) wherever the peak leaves room.
    shed = float(min(96, max(85, math.ceil(peak_pct) + 1)))
    degrade = min(98.0, max(92.0, shed + 3))
    critical = min(99.5, max(97.0, degrade + 1.5))
    recover = shed - 8
    commit = _commit_total(board, budget)
    ratio = max(50, _commit_ratio(board, commit))
    reasons: dict[str, str] = {}
    first_batch, first_kv = (req.n_batch or BATCHES[0]), (req.kv_type or KV_TYPES[0])
    if req.ctx is not None:
        reasons["n_ctx"] = f"requested {n_ctx}; it fits with {_mib(zone - _need(budget))} to spare"
    else:
        top = _candidates(f)[0]
        reasons["n_ctx"] = (
            f"largest multiple of {CTX_STEP} up to the trained {f.n_ctx_train} that fits "
            + ("(the trained length itself)" if n_ctx == top else f"the {_mib(zone)} zone")
        )
    reasons["n_batch"] = (
        f"{n_batch} (= n_ubatch): compute buffer reserves {_mib(budget.compute_reserved_bytes)}"
        + (", the default" if n_batch == first_batch else f"; {first_batch} did not fit")
    )
    kv_part = budget.part("kv_cache")
    reasons["kv_type"] = (
        f"{kv}: KV cache {_mib(kv_part.bytes if kv_part else 0)}, allocated in full at load"
        + ("" if kv == first_kv else f"; {first_kv} did not fit (q8_0 needs flash attention)")
    )
    if f.swa_layers:
        reasons["swa"] = (
            f"{len(f.swa_layers)} of {f.n_layer} layers use a {f.sliding_window}-token window, "
            "but llama-cpp-python allocates them full size (swa_full)"
        )
    reasons["n_threads"] = why_threads
    reasons["cpu_affinity"] = why_aff
    reasons["memory_max"] = (
        f"the inference zone: {_mib(board.ram_bytes)} RAM - OS {_mib(board.os_reserve_bytes)}"
        f" - business {_mib(board.business_reserve_bytes)} - NPU/GPU "
        f"{_mib(board.npu_reserve_bytes)}; planned peak {_mib(peak)}"
    )
    reasons["memory_high"] = (
        f"{_mib(memory_max - memory_high)} below MemoryMax so the kernel throttles and "
        "reclaims the cold page cache before it OOM-kills"
    )
    reasons["watermarks"] = (
        f"planned peak is {peak_pct:.0f}% of MemoryHigh; shedding starts above it at {shed:.0f}%"
    )
    if board.cma_bytes is not None:
        reasons["cma"] = (
            f"cma={board.cma_bytes // MiB}M: the NPU's contiguous pool, sized to the "
            f"{_mib(board.npu_reserve_bytes)} NPU reserve instead of a guess"
        )
    else:
        reasons["cma"] = "left as the board boots (no NPU CMA pool to size)"
    reasons["overcommit"] = (
        f"mode 2, ratio {ratio}: CommitLimit {_mib(board.ram_bytes * ratio // 100)} (no swap) "
        f"admits the planned commit charge {_mib(commit)} (service "
        f"{_mib(budget.service_commit_bytes)}, incl. {threads} engine thread stacks and the "
        f"full {_mib(budget.compute_reserved_bytes)} compute reservation, + "
        + (
            f"the host's current Committed_AS {_mib(board.committed_bytes or 0)}"
            if (board.committed_bytes or 0) > board.os_reserve_bytes + board.business_reserve_bytes
            else "OS and business reserves"
        )
        + f") with {HEADROOM:.0%} headroom"
    )
    return Plan(
        model=ModelSpec(
            name=f.name,
            arch=f.arch,
            file_bytes=f.file_bytes,
            n_layer=f.n_layer,
            n_ctx_train=f.n_ctx_train,
            path=req.model_path,
            preset=req.preset,
            quant=req.quant,
        ),
        board=BoardSpec(
            name=board.name,
            ram_bytes=board.ram_bytes,
            cpus=board.cpus,
            big_cores=board.big_cores,
            npu_reserve_bytes=board.npu_reserve_bytes,
            device_nodes=board.device_nodes,
            device_groups=board.device_groups,
            boot_file=board.boot_file,
        ),
        engine=EngineSettings(
            n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads, kv_type=kv
        ),
        limits=Limits(
            memory_high_bytes=memory_high,
            memory_max_bytes=memory_max,
            os_reserve_bytes=board.os_reserve_bytes,
            business_reserve_bytes=board.business_reserve_bytes,
        ),
        budget=budget.parts,
        watermarks=Watermarks(
            shed_pct=shed, degrade_pct=degrade, critical_pct=critical, recover_pct=recover
        ),
        kernel=KernelSettings(
            swappiness=0,
            overcommit_memory=2,
            overcommit_ratio=ratio,
            commit_charge_bytes=commit,
            cma_bytes=board.cma_bytes,
        ),
        cpu_affinity=affinity,
        reasons=reasons,
    )
