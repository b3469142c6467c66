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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slmguard.errors import EngineError
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
from slmguard.serve.sessions import FILENAME, SessionStore

if TYPE_CHECKING:
    from slmguard.plan.modelfacts import ModelFacts
    from slmguard.plan.schema import Plan
    from slmguard.serve.app import ServeContext
    from slmguard.serve.hooks import AdmissionInfo

log = logging.getLogger(__name__)


class _ServeEngine:
    """The server's EngineControl (``ServeContext``), plus what to do when the worker is down.

    A resize asked for while the worker is restarting (after a crash or an OOM
    kill) must not be lost: the supervisor's config gets the new n_ctx so the
    restart already comes up small, and once the worker is ready the context
    is recreated if it still has another size.
    """

    def __init__(self, ctx: ServeContext, ready_timeout_s: float = 120.0) -> None:
        self.ctx = ctx
        self.ready_timeout_s = ready_timeout_s

    async def resize_context(self, n_ctx: int) -> None:
        from slmguard.serve.supervisor import WorkerGone, WorkerNotReady

        sup = self.ctx.supervisor
        if sup.state != "ready":
            sup.config = replace(sup.config, n_ctx=n_ctx)
            if not await sup.wait_ready(self.ready_timeout_s):
                raise EngineError(f"engine not ready to resize to {n_ctx} tokens ({sup.state})")
            if sup.n_ctx == n_ctx:
                return
        if n_ctx >= sup.n_ctx:
            # Growing back is not urgent: wait for the engine slot like a request.
            await self.ctx.resize_context(n_ctx)
            return
        # Shrinking is: waiting behind queued requests (seconds each on a busy
        # board) lets memory run out first. Abort what runs (its client gets a
        # 503), and send the reload now; the worker handles it right after the
        # aborted generation stops, and requests waiting for the slot get 503
        # (engine loading) until it is done.
        for rid in sup.pending_ids():
            sup.abort(rid, "the context is being reduced under memory pressure; retry shortly")
        try:
            await sup.reload(n_ctx)
        except (WorkerGone, WorkerNotReady) as err:
            raise EngineError(f"cannot shrink the context to {n_ctx} tokens: {err}") from err

    async def abort_newest(self, reason: str) -> bool:
        return await self.ctx.abort_newest(reason)

    async def drop_prefix_cache(self) -> None:
        await self.ctx.drop_prefix_cache()

    async def park(self, reason: str) -> None:
        await self.ctx.supervisor.park(reason)

    async def resume(self, n_ctx: int) -> None:
        sup = self.ctx.supervisor
        await sup.resume(n_ctx)
        if not await sup.wait_ready(self.ready_timeout_s):
            raise EngineError(f"engine did not come back from parking ({sup.state})")

    def worker_pid(self) -> int | None:
        return self.ctx.worker_pid()


def build_governor(
    ctx: ServeContext,
    *,
    plan: Plan | None,
    facts: ModelFacts | None,
    state_dir: Path,
    budget_bytes: int | None = None,
    enabled: bool = True,
    sessions: bool = True,
    recover_hold_s: float = 10.0,
    degrade: DegradeSettings | None = None,
    root: Path = Path("/"),
) -> Governor:
    """A governor for ``ctx`` with thresholds from the plan (or defaults).

    ``budget_bytes`` is an operator-configured memory budget (the smallest
    limit wins). Sessions live in ``<state_dir>/sessions.sqlite3``.
    """
    n_ctx_full = ctx.supervisor.config.n_ctx
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
                ctx.supervisor.config.kv_type,
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
        pids=lambda: [p for p in (_own_pid(), ctx.supervisor.worker_pid) if p is not None],
    )
    store = SessionStore.open(state_dir / FILENAME) if sessions else None
    return Governor(
        signal,
        config,
        n_ctx_full,
        engine=_ServeEngine(ctx),
        sessions=store,
        root=root,
    )


def _own_pid() -> int:
    import os

    return os.getpid()


def install(ctx: ServeContext, governor: Governor) -> None:
    """Register the governor in ``ctx.hooks`` and ``ctx.metrics``; call before create_app."""
    from slmguard.governor.http import build_router
    from slmguard.governor.metrics import GovernorCollector
    from slmguard.serve.hooks import AdmissionRejected

    async def admission(info: AdmissionInfo) -> None:
        verdict = governor.admit(None, info.max_tokens)
        if not verdict.admitted:
            raise AdmissionRejected(
                verdict.message,
                status=verdict.status,
                code=verdict.code,
                retry_after_s=verdict.retry_after_s,
            )

    def cap(info: AdmissionInfo) -> int | None:
        return governor.max_tokens_cap()

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

    def mark_degraded(t: Transition, snap: MemorySnapshot) -> None:
        if t.to_level >= Level.SHED:
            ctx.degraded_reasons["memory"] = (
                f"memory governor at {t.to_level.label}: {t.pressure_pct:.1f}% of "
                f"{snap.limit_bytes} bytes ({snap.limit_source})"
            )
        else:
            ctx.degraded_reasons.pop("memory", None)

    admin_token = ctx.admin_token
    if admin_token is not None and admin_token == ctx.api_key:
        # The trim route must not open to every API client.
        log.warning(
            "the admin token equals the API key: /api/v1/context/trim stays disabled; "
            "give --admin-token-file a different secret"
        )
        admin_token = None

    def verdict(prompt_tokens: int, max_tokens: int | None) -> AdmissionRejected | None:
        v = governor.context_verdict(prompt_tokens, max_tokens)
        if v.status != 503:
            return None  # too long for the full context too: the front's plain 400
        return AdmissionRejected(v.message, status=503, code=v.code, retry_after_s=v.retry_after_s)

    if governor.sessions is not None:
        ctx.hooks.sessions = governor
    ctx.hooks.context_verdict = verdict
    governor.listeners.append(mark_degraded)
    ctx.hooks.admission.append(admission)
    ctx.hooks.max_tokens_caps.append(cap)
    ctx.hooks.routers.append(build_router(governor, admin_token=admin_token, api_key=ctx.api_key))
    ctx.hooks.health.append(health)
    ctx.metrics.registry.register(GovernorCollector(governor))
