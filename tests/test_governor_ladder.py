"""The governor over several engines (issue 39): which model a step acts on, and whether an
on-demand model may load. Pure tables, as test_governor_policy.py: snapshots are a
percentage of a 1,000,000-byte limit, the clock is ``now_s``.

The board in these tables: ``chat`` (pinned, priority 100), ``embed`` (on demand,
priority 30, no KV cache) and ``big`` (on demand, priority 20)."""

from __future__ import annotations

from dataclasses import replace

from slmguard.errors import OverloadedError
from slmguard.governor.ladder import Rung, decide_board, ladder_order
from slmguard.governor.policy import (
    DegradeSettings,
    Level,
    MemoryModel,
    ParkEngine,
    PolicyState,
    ResizeContext,
    ResumeEngine,
    Thresholds,
    decide,
    room_for,
)
from slmguard.governor.signal import MemorySnapshot

LIMIT = 1_000_000
TH = Thresholds(recover_hold_s=10.0, psi_shed_pct=None)
DEG = DegradeSettings(n_ctx_floor=512, shrink_cooldown_s=5.0, keep_recent_tokens=64)
KV = MemoryModel(kv_bytes_per_token=10)
NO_KV = MemoryModel(no_kv_cache=True)


def snap(pct: float) -> MemorySnapshot:
    return MemorySnapshot(0.0, "cgroup2", int(LIMIT * pct / 100), LIMIT, "memory.high")


def board(**changes: dict[str, object]) -> list[Rung]:
    rungs = {
        "chat": Rung("chat", PolicyState.initial(4096), KV, priority=100),
        "embed": Rung("embed", PolicyState.initial(512), NO_KV, priority=30, on_demand=True),
        "big": Rung("big", PolicyState.initial(2048), KV, priority=20, on_demand=True),
    }
    for name, fields in changes.items():
        rungs[name] = replace(rungs[name], **fields)
    return list(rungs.values())


def acted(rungs: list[Rung], pct: float, now: float = 100.0) -> list[tuple[str, str | None]]:
    d = decide_board(rungs, snap(pct), now, TH, DEG)
    return [(type(a).__name__, getattr(a, "model", None)) for a in d.actions]


def test_the_ladder_order_is_lowest_priority_first_and_later_first_among_equals() -> None:
    rungs = board()
    assert [rungs[i].name for i in ladder_order(rungs)] == ["big", "embed", "chat"]
    tied = board(big={"priority": 30})
    assert [tied[i].name for i in ladder_order(tied)] == ["big", "embed", "chat"]
    tied = board(embed={"priority": 20})
    assert [tied[i].name for i in ladder_order(tied)] == ["big", "embed", "chat"]


def test_degrade_evicts_the_lowest_idle_on_demand_model_first() -> None:
    assert acted(board(), 93.0) == [("TrimSessions", None), ("EvictModel", "big")]


def test_a_busy_on_demand_model_is_shrunk_never_evicted() -> None:
    # big is busy: its context is shrunk (it is the lowest); embed is idle, but the
    # ladder finishes with the lowest before it reaches the next.
    assert acted(board(big={"busy": True}), 93.0) == [
        ("TrimSessions", None),
        ("ResizeContext", "big"),
    ]


def test_then_the_next_model_when_the_lowest_has_nothing_left() -> None:
    # big is out of memory (evicted), embed idle: evicted next; then chat is shrunk.
    gone = {"resident": False}
    assert acted(board(big=gone), 93.0)[-1] == ("EvictModel", "embed")
    assert acted(board(big=gone, embed=gone), 93.0)[-1] == ("ResizeContext", "chat")
    # big busy at its floor and not critical: nothing more of it, the next one gives.
    floor = {"busy": True, "state": replace(PolicyState.initial(2048), n_ctx=512)}
    assert acted(board(big=floor), 93.0)[-1] == ("EvictModel", "embed")


def test_critical_parks_the_lowest_before_touching_the_next() -> None:
    at_floor = replace(PolicyState.initial(2048), n_ctx=512)
    rungs = board(big={"busy": True, "state": at_floor}, embed={"resident": False})
    d = decide_board(rungs, snap(98.0), 100.0, TH, DEG)
    assert [a for a in d.actions if isinstance(a, ParkEngine)] == [ParkEngine(98.0, 512, "big")]
    assert d.states[2].parked and not d.states[0].parked
    assert d.states[0].n_ctx == 4096  # chat untouched


def test_the_level_and_its_clocks_are_one_for_every_model() -> None:
    d = decide_board(board(), snap(93.0), 100.0, TH, DEG)
    assert {s.level for s in d.states} == {Level.DEGRADE}
    assert {s.last_resize_s for s in d.states} == {100.0}  # the eviction's cooldown
    # Within the cooldown nothing more is evicted or shrunk.
    later = [replace(r, state=s) for r, s in zip(board(), d.states, strict=True)]
    later[2] = replace(later[2], resident=False)
    assert acted(later, 93.5, now=101.0) == []


def test_coming_back_resumes_the_highest_priority_first() -> None:
    parked = replace(PolicyState.initial(512), parked=True, calm_since_s=0.0, below_since_s=0.0)
    small = replace(PolicyState.initial(4096), n_ctx=1024, calm_since_s=0.0, below_since_s=0.0)
    rungs = board(chat={"state": small}, embed={"state": parked})
    d = decide_board(rungs, snap(10.0), 100.0, TH, DEG)
    assert d.actions == (ResizeContext(1024, 2048, -10240, "chat"),)
    rungs = board(embed={"state": parked})
    d = decide_board(rungs, snap(10.0), 100.0, TH, DEG)
    assert d.actions == (ResumeEngine(512, 10.0, "embed"),)


def test_one_model_is_exactly_decide() -> None:
    state = replace(PolicyState.initial(4096), level=Level.SHED)
    for pct in (50.0, 86.0, 93.0, 98.0):
        alone = decide_board([Rung("m", state, KV)], snap(pct), 50.0, TH, DEG)
        plain = decide(state, snap(pct), 50.0, TH, DEG, KV)
        assert (alone.states[0], alone.actions, alone.transitions) == (
            plain.state, plain.actions, plain.transitions,
        )  # fmt: skip
        assert all(getattr(a, "model", None) is None for a in alone.actions)  # the only one


# ---------------------------------------------------------------- room for an on-demand load

MIB = 1 << 20
BIG = 100_000_000
ROOM_LIMIT = 1000 * MIB


def used(mib: int) -> MemorySnapshot:
    return MemorySnapshot(0.0, "cgroup2", mib * MIB, ROOM_LIMIT, "memory.max")


NORMAL = PolicyState.initial(512)


def test_a_model_that_fits_loads_and_evicts_nothing() -> None:
    evict, verdict = room_for("embed", 70 * MIB, [("big", 300 * MIB)], state=NORMAL,
                              snap=used(500), th=TH)  # fmt: skip
    assert (evict, verdict.admitted) == ((), True)


def test_idle_models_are_evicted_in_order_until_it_fits() -> None:
    evictable = [("big", 300 * MIB), ("other", 100 * MIB)]
    evict, verdict = room_for("embed", 70 * MIB, evictable, state=NORMAL, snap=used(800), th=TH)
    assert (evict, verdict.admitted) == (("big",), True)  # 800 - 300 + 70 < 850
    evict, verdict = room_for("embed", 70 * MIB, evictable, state=NORMAL, snap=used(1150),
                              th=TH)  # fmt: skip
    assert (evict, verdict.admitted) == (("big", "other"), True)  # 1150 - 400 + 70 < 850


def test_a_model_that_cannot_fit_is_refused_naming_the_memory() -> None:
    evict, verdict = room_for("embed", 70 * MIB, [("big", 30 * MIB)], state=NORMAL,
                              snap=used(830), th=TH)  # fmt: skip
    assert evict == () and verdict.status == 503 and verdict.code == "model_does_not_fit"
    err = verdict.error()
    assert isinstance(err, OverloadedError) and err.retry_after_s == 10
    for words in ("embed cannot be loaded now", "needs 70 MiB", "uses 830 MiB",
                  "1,000 MiB memory limit (memory.max)", "shed watermark (85%) is at 850 MiB",
                  "would free only 30 MiB"):  # fmt: skip
        assert words in verdict.message, words
    _, verdict = room_for("embed", 70 * MIB, [], state=NORMAL, snap=used(830), th=TH)
    assert "no idle on-demand model is left to evict" in verdict.message


def test_shedding_or_parked_waits() -> None:
    shedding = replace(NORMAL, level=Level.SHED)
    assert room_for("e", 1, [], state=shedding, snap=used(10), th=TH)[1].code == "memory_shedding"
    parked = replace(NORMAL, parked=True)
    assert room_for("e", 1, [], state=parked, snap=used(10), th=TH)[1].code == "engine_parked"


def test_the_plans_resident_sets_decide_first() -> None:
    sets = (frozenset({"chat", "big"}), frozenset({"chat", "embed"}))
    resident = ["chat", "big"]
    evict, verdict = room_for("embed", 1, [("big", 1)], state=NORMAL, snap=None, th=TH,
                              resident=resident, sets=sets)  # fmt: skip
    assert (evict, verdict.admitted) == (("big",), True)
    # big is busy (not evictable): the plan does not let embed in beside it.
    evict, verdict = room_for("embed", 1, [], state=NORMAL, snap=None, th=TH,
                              resident=resident, sets=sets)  # fmt: skip
    assert evict == () and verdict.code == "model_does_not_fit"
    assert "{chat, embed}" in verdict.message and "big stay in memory" in verdict.message
    # Without sets, no limit: it loads.
    assert room_for("embed", BIG, [], state=NORMAL, snap=None, th=TH)[1].admitted
