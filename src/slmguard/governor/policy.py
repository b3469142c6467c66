"""Governor decisions: pure functions of snapshots, the clock and configuration.

Owns the levels and their hysteresis, the degradation ladder (what to do at each
level), the max_tokens cap, admission by prediction and the context verdict (in tokens
of one slot; :mod:`slmguard.governor.request` says when the front asks each). Levels
(percent of the effective limit, thresholds from ``plan.watermarks`` or
configuration)::

    normal     < shed_pct                       serve
    shed       >= shed_pct (85)                 new requests get 503 + Retry-After
    degrade    >= degrade_pct (92)              + cap max_tokens, trim sessions,
                                                  recreate the context at half n_ctx
    critical   >= critical_pct (97)             + abort the newest generation;
                                                  at the context floor: park

Rising is immediate; falling is one level per ``recover_hold_s`` below ``recover_pct``.
A model without a KV cache is never shrunk, parked at critical. ``docs/governor.md``
tells why (the KV cache is sized at context creation), growing back, and when a parked
engine resumes.

It must read no file, sleep, log or touch the engine: ``governor.runtime`` feeds it
:class:`~slmguard.governor.signal.MemorySnapshot` values and carries out the
:class:`Action` values it returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum

from slmguard.errors import ConfigError, OverloadedError, RequestTooLargeError, SlmguardError
from slmguard.governor.signal import MemorySnapshot
from slmguard.plan.schema import Plan, Watermarks
from slmguard.plan.vision import REQUEST_PART

KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # ggml block sizes per element


class Level(IntEnum):
    NORMAL = 0
    SHED = 1
    DEGRADE = 2
    CRITICAL = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Thresholds:
    """When levels change. Percentages of the effective memory limit.

    Example::

        Thresholds.from_watermarks(plan.watermarks, recover_hold_s=10.0)
    """

    shed_pct: float = 85.0
    degrade_pct: float = 92.0
    critical_pct: float = 97.0
    recover_pct: float = 80.0
    recover_hold_s: float = 10.0
    psi_shed_pct: float | None = 40.0  # PSI some avg10 that forces shed; None: ignore PSI

    def __post_init__(self) -> None:
        if not 0 < self.recover_pct < self.shed_pct <= self.degrade_pct <= self.critical_pct:
            raise ConfigError(
                "governor thresholds: need 0 < recover_pct < shed_pct <= degrade_pct "
                f"<= critical_pct (got {self.recover_pct}, {self.shed_pct}, "
                f"{self.degrade_pct}, {self.critical_pct})"
            )
        if self.critical_pct > 100 or self.recover_hold_s < 0:
            raise ConfigError("governor thresholds: critical_pct <= 100 and recover_hold_s >= 0")

    @classmethod
    def from_watermarks(cls, w: Watermarks, **overrides: float | None) -> Thresholds:
        values: dict[str, float | None] = {
            "shed_pct": w.shed_pct,
            "degrade_pct": w.degrade_pct,
            "critical_pct": w.critical_pct,
            "recover_pct": w.recover_pct,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, float | None]:
        return {
            "shed_pct": self.shed_pct,
            "degrade_pct": self.degrade_pct,
            "critical_pct": self.critical_pct,
            "recover_pct": self.recover_pct,
            "recover_hold_s": self.recover_hold_s,
            "psi_shed_pct": self.psi_shed_pct,
        }


@dataclass(frozen=True)
class DegradeSettings:
    """What degrading does, and how often."""

    max_tokens_cap: int = 128
    keep_recent_tokens: int = 512
    n_ctx_floor: int = 512
    shrink_cooldown_s: float = 5.0  # between context shrinks (a reload takes seconds)
    abort_cooldown_s: float = 2.0  # between aborts while still critical
    park_at_floor: bool = True  # stop the engine when critical at the floor context

    def __post_init__(self) -> None:
        if self.max_tokens_cap < 1 or self.keep_recent_tokens < 0 or self.n_ctx_floor < 16:
            raise ConfigError(
                "governor degrade settings: max_tokens_cap >= 1, keep_recent_tokens >= 0, "
                "n_ctx_floor >= 16"
            )


#: Plan parts each request brings and takes away (the images a request may carry: the
#: plan's ``image_requests``, at the bounds, for every slot): the governor counts them per
#: request (``SizedRequest.transient_bytes``), not as memory still to become resident.
PER_REQUEST_PARTS = frozenset({REQUEST_PART})


@dataclass(frozen=True)
class MemoryModel:
    """What the plan predicts about memory, for shrink/grow and admission decisions.

    ``kv_bytes_per_token``: KV cache bytes per token of context (all layers, host and
    device; 0 when unknown).
    ``use_bytes``: anonymous memory the engine touches only while working
    (compute buffers); pages become resident as used and stay resident (not
    :data:`PER_REQUEST_PARTS`: those come and go with each request).
    ``no_kv_cache``: the engine holds no KV cache at all (the plan's KV parts are 0
    bytes: a model llama.cpp runs without one), so a smaller context frees nothing.
    """

    kv_bytes_per_token: int = 0
    use_bytes: int = 0
    no_kv_cache: bool = False

    @classmethod
    def from_plan(cls, plan: Plan) -> MemoryModel:
        kv_parts = [p for p in plan.budget if "kv" in p.name.lower()]
        kv = sum(p.bytes for p in kv_parts)
        per_token = kv // plan.engine.n_ctx if plan.engine.n_ctx else 0
        use = sum(
            p.bytes
            for p in plan.budget
            if p.when == "use" and p.kind == "anon" and p.name not in PER_REQUEST_PARTS
        )
        return cls(
            kv_bytes_per_token=per_token, use_bytes=use, no_kv_cache=bool(kv_parts) and not kv
        )

    @property
    def shrinks(self) -> bool:
        """Whether a smaller context can give memory back (False: no KV cache)."""
        return not self.no_kv_cache

    def kv_bytes(self, n_ctx: int) -> int:
        return self.kv_bytes_per_token * n_ctx


def kv_bytes_per_token(
    n_layer: int,
    n_head_kv: int | tuple[int, ...],
    key_length: int,
    value_length: int,
    kv_type: str = "f16",
) -> int:
    """KV bytes per context token: sum over layers of heads x (key + value) x element size.

    Gemma 3 270M: 18 layers x 1 head x (256 + 256) x 2 bytes = 18,432 bytes,
    which matches the measured 18 KB per token of context.
    """
    heads = n_head_kv if isinstance(n_head_kv, tuple) else (n_head_kv,) * n_layer
    per_elem = KV_TYPE_BYTES.get(kv_type)
    if per_elem is None:
        raise ConfigError(f"unknown kv_type {kv_type!r} (f16, q8_0, q4_0)")
    return int(sum(h * (key_length + value_length) for h in heads) * per_elem)


# ---------------------------------------------------------------- state and actions


@dataclass(frozen=True)
class PolicyState:
    """Everything the policy remembers between samples. Replace, never mutate."""

    n_ctx_full: int
    n_ctx: int
    level: Level = Level.NORMAL
    level_since_s: float = 0.0
    below_since_s: float | None = None  # below recover_pct since (restarts at each step down)
    calm_since_s: float | None = None  # below recover_pct continuously since (never restarts)
    last_resize_s: float | None = None
    last_abort_s: float | None = None
    parked: bool = False  # the engine is stopped by the governor
    parked_bytes: int = 0  # what the engine held when parked (the runtime measures it)

    @classmethod
    def initial(cls, n_ctx_full: int, now_s: float = 0.0) -> PolicyState:
        return cls(n_ctx_full=n_ctx_full, n_ctx=n_ctx_full, level_since_s=now_s)

    @property
    def context_degraded(self) -> bool:
        return self.n_ctx < self.n_ctx_full


@dataclass(frozen=True)
class Transition:
    from_level: Level
    to_level: Level
    pressure_pct: float
    reason: str  # "rising" | "recovered" | "psi"


@dataclass(frozen=True)
class TrimSessions:
    keep_recent_tokens: int


@dataclass(frozen=True)
class ResizeContext:
    n_ctx_from: int
    n_ctx_to: int
    predicted_delta_bytes: int  # KV bytes freed (shrink, > 0) or taken (grow, < 0)
    model: str | None = None  # the engine it acts on (None: the only one)

    @property
    def kind(self) -> str:
        return "shrink" if self.n_ctx_to < self.n_ctx_from else "grow"


@dataclass(frozen=True)
class AbortNewest:
    pressure_pct: float
    model: str | None = None


@dataclass(frozen=True)
class ParkEngine:
    """Stop the engine: critical at the context floor, nothing else left to give back."""

    pressure_pct: float
    n_ctx: int
    model: str | None = None


@dataclass(frozen=True)
class ResumeEngine:
    """Start the parked engine again, at ``n_ctx`` (the floor it was parked at)."""

    n_ctx: int
    projected_pct: float | None  # working set + the parked engine, % of the limit
    model: str | None = None


@dataclass(frozen=True)
class EvictModel:
    """Unload an idle on-demand model (the first rung of the ladder for such a model:
    all its memory at once, and it loads again when a request needs it)."""

    pressure_pct: float
    model: str | None = None


Action = TrimSessions | ResizeContext | AbortNewest | ParkEngine | ResumeEngine | EvictModel


@dataclass(frozen=True)
class Decision:
    state: PolicyState
    pressure_pct: float
    transitions: tuple[Transition, ...] = ()
    actions: tuple[Action, ...] = field(default_factory=tuple)


# ---------------------------------------------------------------- decisions


def pressure_pct(snap: MemorySnapshot) -> float:
    """The pressure the levels compare: max(working-set %, commit % under mode 2)."""
    values = [v for v in (snap.used_pct, snap.commit_used_pct) if v is not None]
    return max(values) if values else 0.0


def raw_level(pct: float, psi_some_pct: float | None, th: Thresholds) -> Level:
    """The level the pressure alone calls for, without hysteresis."""
    if pct >= th.critical_pct:
        return Level.CRITICAL
    if pct >= th.degrade_pct:
        return Level.DEGRADE
    if pct >= th.shed_pct:
        return Level.SHED
    psi_limit = th.psi_shed_pct
    if psi_limit is not None and psi_some_pct is not None and psi_some_pct >= psi_limit:
        return Level.SHED
    return Level.NORMAL


def smaller_n_ctx(n_ctx: int, floor: int) -> int:
    return max(floor, n_ctx // 2)


def larger_n_ctx(n_ctx: int, full: int) -> int:
    return min(full, n_ctx * 2)


def decide(
    state: PolicyState,
    snap: MemorySnapshot,
    now_s: float,
    th: Thresholds,
    deg: DegradeSettings,
    model: MemoryModel,
) -> Decision:
    """One governor step: the new state, level transitions and actions to carry out."""
    pct = pressure_pct(snap)
    new, transitions = step_level(state, pct, snap.psi_some_avg10_pct, now_s, th)
    if new.parked:
        # Nothing runs to shrink or abort: wait until the engine fits again.
        resume = _resume(new, snap, now_s, new.calm_since_s, th)
        if resume is None:
            return Decision(new, pct, transitions)
        resumed = replace(new, parked=False, last_resize_s=now_s)
        return Decision(resumed, pct, transitions, (resume,))

    floor = context_floor(new, deg, model)
    if _must_park(new, snap, pct, th, deg, model, floor):
        # The last rung: memory is about to run out and no smaller context would
        # bring it back in time. Stopping the engine returns all of it at once
        # (and ends what it was running) before the kernel's OOM killer takes it
        # anyway; it comes back at the floor context (a model without a KV cache:
        # at the context it had).
        parked = replace(new, parked=True, n_ctx=floor)
        return Decision(parked, pct, transitions, (ParkEngine(pct, floor),))
    new, actions = _degrade_ladder(new, state.level, pct, now_s, th, deg, model, floor)

    if pct >= th.critical_pct and (
        new.last_abort_s is None or now_s - new.last_abort_s >= deg.abort_cooldown_s
    ):
        actions.append(AbortNewest(pct))
        new = replace(new, last_abort_s=now_s)

    grow = _grow_back(new, snap, now_s, th, model)
    if grow is not None:
        actions.append(grow)
        new = replace(new, n_ctx=grow.n_ctx_to, last_resize_s=now_s)
    return Decision(new, pct, transitions, tuple(actions))


def context_floor(state: PolicyState, deg: DegradeSettings, model: MemoryModel) -> int:
    """The smallest context the ladder goes to: ``n_ctx_floor`` (at most the full
    context); without a KV cache the context it has (it is never shrunk)."""
    if not model.shrinks:
        return state.n_ctx
    return min(deg.n_ctx_floor, state.n_ctx_full)


def decide_while_reloading(
    state: PolicyState,
    snap: MemorySnapshot,
    now_s: float,
    th: Thresholds,
    deg: DegradeSettings,
    model: MemoryModel | None = None,
) -> Decision:
    """A step while the engine reloads a context (a shrink or grow under way).

    The reload's dip is not a recovery, so levels do not fall and nothing is shrunk
    or grown; but a reload takes seconds (5-30 s measured on a contended 2-core
    machine), and memory that reaches critical meanwhile parks the engine at once:
    the loading child would otherwise be OOM-killed and restarted into the same
    shortage, again and again.
    """
    pct = pressure_pct(snap)
    if state.parked or not deg.park_at_floor or pct < th.critical_pct:
        return Decision(state, pct)
    floor = context_floor(state, deg, model or MemoryModel())
    transitions: tuple[Transition, ...] = ()
    new = state
    if state.level < Level.CRITICAL:
        transitions = (Transition(state.level, Level.CRITICAL, pct, "rising"),)
        new = replace(state, level=Level.CRITICAL, level_since_s=now_s)
    new = replace(new, parked=True, n_ctx=floor, below_since_s=None, calm_since_s=None)
    return Decision(new, pct, transitions, (ParkEngine(pct, floor),))


def _must_park(
    state: PolicyState,
    snap: MemorySnapshot,
    pct: float,
    th: Thresholds,
    deg: DegradeSettings,
    model: MemoryModel,
    floor: int,
) -> bool:
    """Critical, and a shrink cannot help in time: the context is at its floor (for a
    model without a KV cache, always: no shrink helps), or the KV memory the next
    shrink returns would not even bring the pressure below degrade_pct (the reload
    takes seconds while memory keeps rising)."""
    if pct < th.critical_pct or not deg.park_at_floor:
        return False
    if state.n_ctx <= floor or not model.shrinks:
        return True
    freed = model.kv_bytes(state.n_ctx - smaller_n_ctx(state.n_ctx, floor))
    if not freed or not snap.limit_bytes:
        return False  # no KV model to say: shrink, as at degrade
    return pct - 100.0 * freed / snap.limit_bytes >= th.degrade_pct


def step_level(
    state: PolicyState, pct: float, psi: float | None, now_s: float, th: Thresholds
) -> tuple[PolicyState, tuple[Transition, ...]]:
    """The hysteresis: rise at once to the level called for, fall one level per hold period."""
    target = raw_level(pct, psi, th)
    old = state.level
    below_since, calm_since = _calm_clocks(state, pct, psi, now_s, th)
    level, level_since = old, state.level_since_s
    transitions: tuple[Transition, ...] = ()
    if target > old:
        level, level_since = target, now_s
        reason = "psi" if pct < th.shed_pct else "rising"
        transitions = (Transition(old, target, pct, reason),)
    elif (
        old > Level.NORMAL and below_since is not None and now_s - below_since >= th.recover_hold_s
    ):
        level, level_since = Level(old - 1), now_s
        below_since = now_s  # the next step down waits a full hold period again
        transitions = (Transition(old, level, pct, "recovered"),)
    new = replace(
        state,
        level=level,
        level_since_s=level_since,
        below_since_s=below_since,
        calm_since_s=calm_since,
    )
    return new, transitions


def _calm_clocks(
    state: PolicyState, pct: float, psi: float | None, now_s: float, th: Thresholds
) -> tuple[float | None, float | None]:
    """Since when the pressure (and PSI) stayed below recover_pct: (below_since, calm_since).

    Both run while it stays below and stop (None) as soon as it is not; only
    ``below_since`` restarts at each step down.
    """
    psi_ok = th.psi_shed_pct is None or psi is None or psi < th.psi_shed_pct
    if not (pct < th.recover_pct and psi_ok):
        return None, None
    below_since = state.below_since_s if state.below_since_s is not None else now_s
    calm_since = state.calm_since_s if state.calm_since_s is not None else now_s
    return below_since, calm_since


def _degrade_ladder(
    new: PolicyState,
    old: Level,
    pct: float,
    now_s: float,
    th: Thresholds,
    deg: DegradeSettings,
    model: MemoryModel,
    floor: int,
) -> tuple[PolicyState, list[Action]]:
    """On entering degrade, trim and shrink; shrink again while the pressure stays at
    degrade after the cooldown (each reload must settle first). A model without a KV
    cache is never shrunk: the restart would free nothing."""
    actions: list[Action] = []
    entering_degrade = new.level >= Level.DEGRADE > old
    if entering_degrade:
        actions.append(TrimSessions(deg.keep_recent_tokens))
    cooled = new.last_resize_s is None or now_s - new.last_resize_s >= deg.shrink_cooldown_s
    if (
        model.shrinks
        and new.level >= Level.DEGRADE
        and new.n_ctx > floor
        and (entering_degrade or (pct >= th.degrade_pct and cooled))
    ):
        to = smaller_n_ctx(new.n_ctx, floor)
        actions.append(ResizeContext(new.n_ctx, to, model.kv_bytes(new.n_ctx - to)))
        new = replace(new, n_ctx=to, last_resize_s=now_s)
    return new, actions


def _grow_back(
    new: PolicyState, snap: MemorySnapshot, now_s: float, th: Thresholds, model: MemoryModel
) -> ResizeContext | None:
    """Recovery of the context: one doubling per hold period at normal, when the
    plan says the larger KV cache keeps the pressure below recover_pct."""
    below_since = new.below_since_s
    if not (
        new.level == Level.NORMAL
        and new.context_degraded
        and below_since is not None
        and now_s - below_since >= th.recover_hold_s
        and (new.last_resize_s is None or now_s - new.last_resize_s >= th.recover_hold_s)
        and snap.limit_bytes
    ):
        return None
    to = larger_n_ctx(new.n_ctx, new.n_ctx_full)
    grow_bytes = model.kv_bytes(to - new.n_ctx)
    projected = 100.0 * (snap.used_bytes + grow_bytes) / snap.limit_bytes
    if projected >= th.recover_pct:
        return None
    return ResizeContext(new.n_ctx, to, -grow_bytes)


def _resume(
    state: PolicyState,
    snap: MemorySnapshot,
    now_s: float,
    calm_since: float | None,
    th: Thresholds,
) -> ResumeEngine | None:
    """Resume the parked engine once the pressure held low and the engine fits again."""
    if calm_since is None or now_s - calm_since < th.recover_hold_s:
        return None
    if not snap.limit_bytes:
        return ResumeEngine(state.n_ctx, None)
    projected = 100.0 * (snap.used_bytes + state.parked_bytes) / snap.limit_bytes
    if projected >= th.shed_pct:
        return None
    return ResumeEngine(state.n_ctx, projected)


def max_tokens_cap(state: PolicyState, deg: DegradeSettings) -> int | None:
    """The max_tokens cap in force: while degrading and until the context is full again."""
    if state.level >= Level.DEGRADE or state.context_degraded:
        return deg.max_tokens_cap
    return None


# ---------------------------------------------------------------- admission


@dataclass(frozen=True)
class Admission:
    """A verdict on one request.

    ``status`` is the HTTP status the front answers: 200 (admit), 400 (can never
    fit: ``code`` ``request_too_large``) or 503 (cannot fit now; ``retry_after_s``
    set). :meth:`error` is the refusal as the error the front raises.
    """

    status: int
    # "ok" | "request_too_large" | "memory_shedding" | "context_degraded"
    # | "memory_projection" | "engine_parked"
    code: str
    message: str
    retry_after_s: int | None = None

    @property
    def admitted(self) -> bool:
        return self.status == 200

    def error(self) -> SlmguardError | None:
        """None when admitted; else the 400 or 503 of :mod:`slmguard.errors`."""
        if self.admitted:
            return None
        if self.status == 400:
            return RequestTooLargeError(self.message, code=self.code)
        return OverloadedError(self.message, code=self.code, retry_after_s=self.retry_after_s)


ADMITTED = Admission(200, "ok", "admitted")


def retry_after_s(th: Thresholds) -> int:
    """The Retry-After of the governor's 503s: one hold period, at least a second."""
    return max(1, math.ceil(th.recover_hold_s))


def admit(
    *,
    state: PolicyState,
    snap: MemorySnapshot | None,
    th: Thresholds,
    extra_bytes: int = 0,
) -> Admission:
    """Admission by prediction, for a request the front has sized to fit a slot.

    ``extra_bytes`` is the memory this request may still make resident (the
    runtime's estimate of compute-buffer pages not touched yet). Order: a
    request that alone would need the memory up to the shed watermark is
    refused for good (400); then a parked engine, shedding and the projected
    memory give 503. (The context rules are :func:`context_verdict`'s: the
    front asks it when a request does not fit a slot.)
    """
    retry = retry_after_s(th)
    limit = snap.limit_bytes if snap is not None else None
    shed_bytes = None if not limit else limit * th.shed_pct / 100.0
    refusal = (
        _exceeds_memory_limit(extra_bytes, shed_bytes)
        or _engine_held_back(state, retry)
        or _crosses_shed_watermark(snap, extra_bytes, shed_bytes, retry)
    )
    return refusal or ADMITTED


def _exceeds_memory_limit(extra_bytes: int, shed_bytes: float | None) -> Admission | None:
    """400 for good: the request alone would need the memory up to the shed watermark."""
    if shed_bytes is None or extra_bytes < shed_bytes:
        return None
    return Admission(
        400,
        "request_too_large",
        f"the request would need {extra_bytes} bytes, more than the memory limit allows",
    )


def _engine_held_back(state: PolicyState, retry: int) -> Admission | None:
    """503 while the engine is parked or the level sheds load."""
    if state.parked:
        return Admission(
            503,
            "engine_parked",
            "the engine is stopped under memory pressure; it restarts once memory is "
            "available again",
            retry_after_s=retry,
        )
    if state.level >= Level.SHED:
        return Admission(
            503,
            "memory_shedding",
            f"server is shedding load: memory at {state.level.label} level",
            retry_after_s=retry,
        )
    return None


def _crosses_shed_watermark(
    snap: MemorySnapshot | None, extra_bytes: int, shed_bytes: float | None, retry: int
) -> Admission | None:
    """503: the working set plus what the request may still take would reach shed."""
    if (
        snap is None
        or shed_bytes is None
        or extra_bytes <= 0
        or snap.used_bytes + extra_bytes < shed_bytes
    ):
        return None
    return Admission(
        503,
        "memory_projection",
        f"the request may need {extra_bytes} more bytes; the projected working set "
        "would cross the shed watermark",
        retry_after_s=retry,
    )


def context_verdict(
    prompt_tokens: int, max_tokens: int, *, slot_now: int, slot_full: int, th: Thresholds
) -> Admission | None:
    """A request that does not fit one slot now: 503 when only the reduced context is
    too small, None when it would not fit the planned one either (the front's 400).

    In per-slot tokens: ``slot_now`` is the context one slot has now,
    ``slot_full`` the one it has at the planned context. The 503 says to retry:
    the request fits again once the context has grown back.
    """
    need = prompt_tokens + max(1, max_tokens)
    if not slot_now < need <= slot_full:
        return None
    return Admission(
        503,
        "context_degraded",
        f"the context is reduced to {slot_now} tokens under memory pressure "
        f"(planned {slot_full}); retry shortly",
        retry_after_s=retry_after_s(th),
    )


def room_for(
    name: str,
    need_bytes: int,
    evictable: Sequence[tuple[str, int]],
    *,
    state: PolicyState | None,
    snap: MemorySnapshot | None,
    th: Thresholds,
    resident: Sequence[str] = (),
    sets: Sequence[frozenset[str]] = (),
) -> tuple[tuple[str, ...], Admission]:
    """Whether the on-demand model ``name`` may load now, and the models to evict first.

    ``need_bytes`` is what it makes resident (its plan's, or the most it held before);
    ``evictable`` the idle on-demand models in memory, in the order they are given up
    (lowest priority first), each with what it holds; ``resident`` every model in
    memory now; ``sets`` the plan's sets of models that may be resident together (none:
    no such rule). A model parked by the governor (``state``) or a level at shed or above
    waits (503). Then the plan: models are evicted, in order, until ``name`` and those
    left are within one set, else 503 ``model_does_not_fit`` naming them. Then the
    memory: the working set plus the model must stay below the shed watermark, after
    evicting as few more as that takes, else 503 ``model_does_not_fit`` naming the
    memory. Without a known limit only the plan's sets decide.
    """
    retry = retry_after_s(th)
    held = _engine_held_back(state, retry) if state is not None else None
    if held is not None:
        return (), held
    evict, refused = _within_sets(name, evictable, resident, sets, retry)
    if refused is not None:
        return (), refused
    limit = snap.limit_bytes if snap is not None else None
    if snap is None or not limit:
        return evict, ADMITTED
    line = limit * th.shed_pct / 100.0
    freed = dict(evictable)
    used = snap.used_bytes - sum(freed[n] for n in evict)
    more = [(n, b) for n, b in evictable if n not in evict]
    for candidate, bytes_held in more:
        if used + need_bytes < line:
            break
        evict += (candidate,)
        used -= bytes_held
    if used + need_bytes < line:
        return evict, ADMITTED
    left = (
        f"; evicting every idle on-demand model would free only {_mib(snap.used_bytes - used)} MiB"
        if evictable
        else "; no idle on-demand model is left to evict"
    )
    return (), Admission(
        503,
        "model_does_not_fit",
        f"{name} cannot be loaded now: it needs {_mib(need_bytes)} MiB and the service uses "
        f"{_mib(snap.used_bytes)} MiB of its {_mib(limit)} MiB memory limit "
        f"({snap.limit_source}), whose shed watermark ({th.shed_pct:g}%) is at "
        f"{_mib(int(line))} MiB{left}",
        retry_after_s=retry,
    )


def _within_sets(
    name: str,
    evictable: Sequence[tuple[str, int]],
    resident: Sequence[str],
    sets: Sequence[frozenset[str]],
    retry: int,
) -> tuple[tuple[str, ...], Admission | None]:
    """The evictions (in order) that leave ``name`` and the models in memory within one
    of the plan's resident ``sets``, or the refusal naming what stays in the way."""
    if not sets:
        return (), None
    remaining = {r for r in resident if r != name}
    evict: list[str] = []
    for candidate, _ in evictable:
        if any({name, *remaining} <= s for s in sets):
            break
        evict.append(candidate)
        remaining.discard(candidate)
    if any({name, *remaining} <= s for s in sets):
        return tuple(evict), None
    beside = set().union(*(s for s in sets if name in s))
    blocking = sorted(r for r in remaining if r not in beside) or sorted(remaining)
    return (), Admission(
        503,
        "model_does_not_fit",
        f"{name} cannot be loaded now: the plan lets it be resident only in the sets "
        f"{_sets(sets, name)}, and {', '.join(blocking)} stay in memory (busy or pinned)",
        retry_after_s=retry,
    )


def _sets(sets: Sequence[frozenset[str]], name: str) -> str:
    return "; ".join("{" + ", ".join(sorted(s)) + "}" for s in sets if name in s) or "(none)"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f}"
