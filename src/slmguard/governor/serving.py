"""Glue between the governor and ``slmguard.serve``: build it, plug it into the hooks.

Owns :func:`build_governor` (a governor configured from the plan, the model
facts and the server's settings, driving the engine through the server's
``ServeContext``, which implements
:class:`~slmguard.governor.runtime.EngineControl`) and :func:`install`, which
fills the server's ``Hooks`` (admission, max_tokens cap, router, health) and
registers the governor's metrics. The server calls, in order::

    governor = build_governor(ctx, plan=plan, facts=facts, state_dir=state_dir)
    install(ctx, governor)            # before create_app(ctx)
    governor.start()                  # inside the running event loop
    ...
    await governor.aclose()           # on shutdown

Nothing here runs at import time; fastapi and prometheus_client load in
``http`` and ``metrics`` when :func:`install` runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slmguard.errors import EngineError, OverloadedError, RequestTooLargeError
from slmguard.governor.policy import (
    DegradeSettings,
    Level,
    MemoryModel,
    Thresholds,
    Transition,
    kv_bytes_per_token,
)
from slmguard.governor.runtime import Governor, GovernorConfig
from slmguard.governor.signal import MemorySignal, MemorySnapshot

if TYPE_CHECKING:
    from slmguard.plan.modelfacts import ModelFacts
    from slmguard.plan.schema import Plan
    from slmguard.serve.context import ServeContext
    from slmguard.serve.hooks import AdmissionHook, AdmissionInfo, ContextVerdict, HealthContributor

log = logging.getLogger(__name__)


class ServeEngine:
    """The governor's :class:`~slmguard.governor.runtime.EngineControl` over the server's
    llama-server child.

    The governor thinks in KV cells (``n_ctx``, all slots together); this maps
    them onto the engine: a smaller total drops slots first (each keeps its
    planned context), then shrinks the one slot's context
    (:func:`~slmguard.serve.engine.config_for_cells`). A shrink is urgent:
    running generations are aborted (503 with the reason) and the child is
    replaced at once. Growing back waits until every slot is free (queued
    requests wait behind it, as behind a request). A resize asked for while the
    engine is restarting (after a crash or an OOM kill) is not lost: the new
    settings are what the restart comes up with.
    """

    def __init__(self, ctx: ServeContext, ready_timeout_s: float = 120.0) -> None:
        from slmguard.serve.engine import config_for_cells

        self.ctx = ctx
        self.planned = ctx.engine.config
        self.ready_timeout_s = ready_timeout_s
        self._for_cells = config_for_cells

    def config_for(self, n_ctx: int) -> Any:
        return self._for_cells(self.planned, n_ctx)

    async def resize_context(self, n_ctx: int) -> None:
        engine = self.ctx.engine
        new = self.config_for(n_ctx)
        if engine.state != "ready":
            engine.config = new
            if not await engine.wait_ready(self.ready_timeout_s):
                raise EngineError(f"engine not ready to resize to {n_ctx} cells ({engine.state})")
            if engine.config == new and engine.state == "ready":
                return
        if new == engine.config:
            return
        if new.n_ctx >= engine.config.n_ctx:
            queue = self.ctx.queue
            taken = await queue.acquire(queue.slots, bypass_limit=True)
            try:
                await engine.reconfigure(new)
            finally:
                queue.release(taken)
            return
        self.ctx.flights.abort_all(
            "the context is being reduced under memory pressure; retry shortly"
        )
        await engine.reconfigure(new)

    async def abort_newest(self, reason: str) -> bool:
        flight = self.ctx.flights.newest()
        return flight is not None and flight.abort(reason)

    async def drop_prefix_cache(self) -> None:
        """Erase the KV cells of every idle slot (llama-server's slot erase)."""
        from slmguard.serve.upstream import EngineUnreachable

        slots = self.ctx.slots
        if not await slots.refresh(timeout_s=5.0):
            raise EngineError("the engine did not answer /slots")
        for slot in slots.slots:
            if slot.is_processing:
                continue
            try:
                status, data = await self.ctx.engine.client.post_json(
                    f"/slots/{slot.id}?action=erase", {}
                )
            except EngineUnreachable as err:
                raise EngineError(f"slot {slot.id} erase: {err}") from err
            if status != 200:
                raise EngineError(f"slot {slot.id} erase answered {status}: {data}")

    async def park(self, reason: str) -> None:
        """Stop the engine; running generations end with 503 ``aborted`` naming ``reason``."""
        self.ctx.flights.abort_all(reason)
        await self.ctx.engine.park(reason)

    async def resume(self, n_ctx: int) -> None:
        engine = self.ctx.engine
        await engine.resume(self.config_for(n_ctx))
        if not await engine.wait_ready(self.ready_timeout_s):
            raise EngineError(f"engine did not come back from parking ({engine.state})")

    def engine_pid(self) -> int | None:
        return self.ctx.engine.pid


def build_governor(
    ctx: ServeContext,
    *,
    plan: Plan | None,
    facts: ModelFacts | None,
    state_dir: Path,
    budget_bytes: int | None = None,
    enabled: bool = True,
    recover_hold_s: float = 10.0,
    degrade: DegradeSettings | None = None,
    root: Path = Path("/"),
) -> Governor:
    """A governor for ``ctx`` with thresholds from the plan (or defaults).

    ``budget_bytes`` is an operator-configured memory budget (the smallest
    limit wins). The governor trims the server's session store (if it keeps one).
    """
    n_ctx_full = ctx.engine.config.n_ctx
    if plan is not None:
        thresholds = Thresholds.from_watermarks(plan.watermarks, recover_hold_s=recover_hold_s)
        model = MemoryModel.from_plan(plan)
    else:
        thresholds = Thresholds(recover_hold_s=recover_hold_s)
        model = MemoryModel()
    if model.kv_bytes_per_token == 0 and facts is not None:
        model = MemoryModel(
            kv_bytes_per_token=kv_bytes_per_token(
                facts.n_layer,
                facts.n_head_kv,
                facts.key_length,
                facts.value_length,
                ctx.engine.config.kv_type,
            ),
            use_bytes=model.use_bytes,
        )
    degrade = degrade or DegradeSettings()
    floor = min(degrade.n_ctx_floor, n_ctx_full)
    config = GovernorConfig(
        thresholds=thresholds,
        degrade=replace(degrade, n_ctx_floor=floor),
        model=model,
        enabled=enabled,
    )
    signal = MemorySignal(
        root,
        budget_bytes=budget_bytes,
        plan_limit_bytes=plan.limits.memory_high_bytes if plan is not None else None,
        pids=lambda: [p for p in (_own_pid(), ctx.engine.pid) if p is not None],
    )
    return Governor(
        signal,
        config,
        n_ctx_full,
        engine=ServeEngine(ctx),
        sessions=ctx.sessions.store if ctx.sessions is not None else None,
        root=root,
    )


def _own_pid() -> int:
    import os

    return os.getpid()


def install(ctx: ServeContext, governor: Governor) -> None:
    """Register the governor in ``ctx.hooks`` and ``ctx.metrics``; call before create_app."""
    from slmguard.governor.http import build_router
    from slmguard.governor.metrics import GovernorCollector

    def cap(info: AdmissionInfo) -> int | None:
        return governor.max_tokens_cap()

    admin_token = _trim_token(ctx)
    ctx.hooks.context_verdict = _context_verdict(ctx, governor)
    governor.listeners.append(_degraded_marker(ctx))
    ctx.hooks.admission.append(_admission(governor))
    ctx.hooks.max_tokens_caps.append(cap)
    ctx.hooks.routers.append(build_router(governor, admin_token=admin_token, api_key=ctx.api_key))
    ctx.hooks.health.append(_health(governor))
    ctx.metrics.registry.register(GovernorCollector(governor))


def _admission(governor: Governor) -> AdmissionHook:
    """The admission hook: the governor's verdict as the server's 400 or 503."""

    async def admission(info: AdmissionInfo) -> None:
        verdict = governor.admit(info.prompt_tokens, info.max_tokens)
        if not verdict.admitted:
            if verdict.status == 400:
                raise RequestTooLargeError(verdict.message, code=verdict.code)
            raise OverloadedError(
                verdict.message, code=verdict.code, retry_after_s=verdict.retry_after_s
            )

    return admission


def _health(governor: Governor) -> HealthContributor:
    """The governor's part of /health: level, pressure and context."""

    def health() -> dict[str, Any]:
        st = governor.state
        return {
            "governor": {
                "level": st.level.label,
                "pressure_pct": round(governor.pressure_pct, 2),
                "n_ctx": st.n_ctx,
                "n_ctx_full": st.n_ctx_full,
            }
        }

    return health


def _degraded_marker(ctx: ServeContext) -> Callable[[Transition, MemorySnapshot], None]:
    """The transition listener that marks the server degraded (memory) from shed up."""

    def mark_degraded(t: Transition, snap: MemorySnapshot) -> None:
        if t.to_level >= Level.SHED:
            ctx.degraded_reasons["memory"] = (
                f"memory governor at {t.to_level.label}: {t.pressure_pct:.1f}% of "
                f"{snap.limit_bytes} bytes ({snap.limit_source})"
            )
        else:
            ctx.degraded_reasons.pop("memory", None)

    return mark_degraded


def _trim_token(ctx: ServeContext) -> str | None:
    """The admin token for the trim route; None (route disabled) when it equals the API key."""
    admin_token = ctx.admin_token
    if admin_token is not None and admin_token == ctx.api_key:
        # The trim route must not open to every API client.
        log.warning(
            "the admin token equals the API key: /api/v1/context/trim stays disabled; "
            "give --admin-token-file a different secret"
        )
        admin_token = None
    return admin_token


def _context_verdict(ctx: ServeContext, governor: Governor) -> ContextVerdict:
    """How to answer the engine's "exceeds the context" refusal while the context is shrunk."""
    planned_slot = ctx.engine.config.n_ctx_slot

    def verdict(prompt_tokens: int, max_tokens: int | None) -> OverloadedError | None:
        """503 while the context is shrunk and the request would fit the planned one."""
        if prompt_tokens + max(1, max_tokens or 1) > planned_slot:
            return None  # too long for the planned context too: the front's plain 400
        governor.counters.reject("context_degraded")
        return OverloadedError(
            f"the context is reduced to {ctx.engine.config.n_ctx_slot} tokens under memory "
            f"pressure (planned {planned_slot}); retry shortly",
            code="context_degraded",
            retry_after_s=max(1, round(governor.config.thresholds.recover_hold_s)),
        )

    return verdict
