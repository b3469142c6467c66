"""The degrade ladder over several engines: which one the governor acts on, lowest first.

Owns :func:`decide_board`, one governor step for a server of several models (pure, as
:mod:`slmguard.governor.policy` whose rules it applies). The memory signal and the
level are one (the service's); each model has its own context, floor and parking
(its :class:`~slmguard.governor.policy.PolicyState`'s ``n_ctx``, ``parked``; the
level, its clocks and the cooldowns are shared). Each step acts on one model:

- **going down** (the pressure at degrade or above), the model of the lowest
  priority (of equals, the later one) that still has something to give: an idle
  on-demand model is evicted (:class:`~slmguard.governor.policy.EvictModel`: all its
  memory at once, it loads again when asked); otherwise its context is shrunk to its
  floor; at critical it is parked; then the next model. A busy on-demand model is
  shrunk like a pinned one, never evicted.
- **coming back**, the model of the highest priority that is parked or runs a reduced
  context first (resume, then grow back), in the reverse order of the way down.

Only the service's engines are acted on: the board's other services (neighbours)
are outside its memory cgroup and never in these rungs. One model alone is exactly
:func:`~slmguard.governor.policy.decide`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from slmguard.governor.policy import (
    Action,
    Decision,
    DegradeSettings,
    EvictModel,
    Level,
    MemoryModel,
    PolicyState,
    Thresholds,
    Transition,
    TrimSessions,
    context_floor,
    decide,
    decide_while_reloading,
    pressure_pct,
    raw_level,
    step_level,
)
from slmguard.governor.signal import MemorySnapshot

#: The fields of PolicyState the models share: the one level and its clocks, cooldowns.
SHARED = ("level", "level_since_s", "below_since_s", "calm_since_s", "last_resize_s",
          "last_abort_s")  # fmt: skip


@dataclass(frozen=True)
class Rung:
    """One engine as the ladder sees it."""

    name: str
    state: PolicyState
    model: MemoryModel
    priority: int = 100
    on_demand: bool = False
    resident: bool = True  # in memory (not unloaded, not parked, not failed)
    busy: bool = False  # requests hold or wait for it


@dataclass(frozen=True)
class BoardDecision:
    """The step's new state of each model (in the order given), its level changes and its
    actions, each naming the model it acts on."""

    states: tuple[PolicyState, ...]
    pressure_pct: float
    transitions: tuple[Transition, ...] = ()
    actions: tuple[Action, ...] = ()


def ladder_order(rungs: Sequence[Rung]) -> list[int]:
    """The models' indexes the way down: lowest priority first, of equals the later one."""
    return sorted(range(len(rungs)), key=lambda i: (rungs[i].priority, -i))


def target(
    rungs: Sequence[Rung], pct: float, psi: float | None, th: Thresholds, deg: DegradeSettings
) -> tuple[int, bool]:
    """The model this step acts on and whether it is evicted (see the module docstring)."""
    level = raw_level(pct, psi, th)
    order = ladder_order(rungs)
    if level >= Level.DEGRADE:
        standing = [i for i in order if rungs[i].resident and not rungs[i].state.parked]
        for i in standing:
            r = rungs[i]
            if r.on_demand and not r.busy:
                return i, True
            floor = context_floor(r.state, deg, r.model)
            if r.model.shrinks and r.state.n_ctx > floor:
                return i, False
            if level >= Level.CRITICAL:
                return i, False
        return (standing[0] if standing else order[-1]), False
    for i in reversed(order):
        if rungs[i].state.parked or rungs[i].state.context_degraded:
            return i, False
    return order[-1], False


def decide_board(
    rungs: Sequence[Rung],
    snap: MemorySnapshot,
    now_s: float,
    th: Thresholds,
    deg: DegradeSettings,
    *,
    reloading: bool = False,
) -> BoardDecision:
    """One governor step over several engines (see the module docstring); ``reloading``:
    an engine is being recreated (only critical acts, as
    :func:`~slmguard.governor.policy.decide_while_reloading`)."""
    pct = pressure_pct(snap)
    i, evict = target(rungs, pct, snap.psi_some_avg10_pct, th, deg)
    r = rungs[i]
    if reloading:
        decision = decide_while_reloading(r.state, snap, now_s, th, deg, r.model)
    elif evict:
        decision = _evict(r, snap, pct, now_s, th, deg)
    else:
        decision = decide(r.state, snap, now_s, th, deg, r.model)
    named = len(rungs) > 1
    actions = tuple(_named(a, r.name) if named else a for a in decision.actions)
    shared = {k: getattr(decision.state, k) for k in SHARED}
    states = tuple(
        decision.state if j == i else replace(other.state, **shared)
        for j, other in enumerate(rungs)
    )
    return BoardDecision(states, decision.pressure_pct, decision.transitions, actions)


def _evict(
    r: Rung, snap: MemorySnapshot, pct: float, now_s: float, th: Thresholds, deg: DegradeSettings
) -> Decision:
    """The level's step, and the idle on-demand model evicted when the ladder's cooldown
    allows (one eviction or reload at a time: the next step sees the memory it freed)."""
    new, transitions = step_level(r.state, pct, snap.psi_some_avg10_pct, now_s, th)
    actions: list[Action] = []
    if new.level >= Level.DEGRADE > r.state.level:
        actions.append(TrimSessions(deg.keep_recent_tokens))
    last = new.last_resize_s
    if last is None or now_s - last >= deg.shrink_cooldown_s or new.level > r.state.level:
        actions.append(EvictModel(pct))
        new = replace(new, last_resize_s=now_s)
    return Decision(new, pct, transitions, tuple(actions))


def _named(action: Action, name: str) -> Action:
    return action if isinstance(action, TrimSessions) else replace(action, model=name)
