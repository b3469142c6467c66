"""Governor policy: levels, hysteresis, the degrade ladder, recovery timing, admission.

Pure tables: snapshots are built from a percentage of a 1,000,000-byte limit
and the clock is the ``now_s`` argument, so no test sleeps.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from slmguard.errors import ConfigError, envelope
from slmguard.governor.policy import (
    AbortNewest,
    DegradeSettings,
    Level,
    MemoryModel,
    ParkEngine,
    PolicyState,
    ResizeContext,
    ResumeEngine,
    Thresholds,
    TrimSessions,
    admit,
    context_verdict,
    decide,
    decide_while_reloading,
    kv_bytes_per_token,
    max_tokens_cap,
    pressure_pct,
    raw_level,
)
from slmguard.governor.signal import MemorySnapshot
from slmguard.plan.schema import (
    BoardSpec,
    BudgetPart,
    EngineSettings,
    Limits,
    ModelSpec,
    Plan,
    Watermarks,
)

LIMIT = 1_000_000
TH = Thresholds(recover_hold_s=10.0, psi_shed_pct=40.0)
DEG = DegradeSettings(
    max_tokens_cap=64, keep_recent_tokens=256, n_ctx_floor=512, shrink_cooldown_s=5.0
)
MODEL = MemoryModel(kv_bytes_per_token=100, use_bytes=0)


def snap(pct: float, *, psi: float | None = 0.0, **kw: object) -> MemorySnapshot:
    return MemorySnapshot(
        taken_s=0.0,
        source="cgroup2",
        working_set_bytes=int(LIMIT * pct / 100),
        limit_bytes=LIMIT,
        limit_source="memory.high",
        psi_some_avg10_pct=psi,
        **kw,  # type: ignore[arg-type]
    )


def run(
    steps: list[tuple[float, float]], state: PolicyState | None = None
) -> tuple[PolicyState, list[tuple[Level, list[str]]]]:
    """Feed (now_s, pct) steps; return the final state and (level, action kinds) per step."""
    st = state or PolicyState.initial(2048)
    out = []
    for now, pct in steps:
        d = decide(st, snap(pct), now, TH, DEG, MODEL)
        st = d.state
        kinds = []
        for a in d.actions:
            if isinstance(a, ResizeContext):
                kinds.append(f"{a.kind}:{a.n_ctx_to}")
            elif isinstance(a, TrimSessions):
                kinds.append("trim")
            elif isinstance(a, AbortNewest):
                kinds.append("abort")
            elif isinstance(a, ParkEngine):
                kinds.append(f"park:{a.n_ctx}")
            elif isinstance(a, ResumeEngine):
                kinds.append(f"resume:{a.n_ctx}")
        out.append((st.level, kinds))
    return st, out


@pytest.mark.parametrize(
    ("pct", "psi", "level"),
    [
        (0.0, 0.0, Level.NORMAL),
        (84.99, 0.0, Level.NORMAL),
        (85.0, 0.0, Level.SHED),
        (91.9, 0.0, Level.SHED),
        (92.0, 0.0, Level.DEGRADE),
        (96.9, None, Level.DEGRADE),
        (97.0, 0.0, Level.CRITICAL),
        (120.0, 0.0, Level.CRITICAL),
        (50.0, 39.9, Level.NORMAL),
        (50.0, 40.0, Level.SHED),  # PSI alone sheds
        (93.0, 80.0, Level.DEGRADE),  # but never lowers what memory calls for
    ],
)
def test_raw_level_table(pct: float, psi: float | None, level: Level) -> None:
    assert raw_level(pct, psi, TH) is level


def test_rising_is_immediate_and_runs_every_rung_of_the_ladder() -> None:
    st, out = run([(0, 50), (1, 98)])
    assert out[0] == (Level.NORMAL, [])
    assert out[1] == (Level.CRITICAL, ["trim", "shrink:1024", "abort"])
    assert st.n_ctx == 1024


def test_shed_only_rejects_and_does_nothing_to_the_engine() -> None:
    _, out = run([(0, 86), (1, 91.9), (30, 90)])
    assert out == [(Level.SHED, []), (Level.SHED, []), (Level.SHED, [])]


def test_hysteresis_needs_the_hold_below_recover_pct() -> None:
    # 84% is below shed but above recover (80%): the level stays at shed forever.
    _, out = run([(0, 86), (1, 84), (100, 84), (200, 84)])
    assert [lvl for lvl, _ in out] == [Level.SHED] * 4
    # Below recover: leaves shed only after 10 s continuously below.
    _, out = run([(0, 86), (1, 79), (10.9, 79), (11, 79)])
    assert [lvl for lvl, _ in out] == [Level.SHED, Level.SHED, Level.SHED, Level.NORMAL]


def test_hold_restarts_when_the_signal_comes_back_above_recover() -> None:
    _, out = run([(0, 86), (1, 70), (9, 81), (10, 70), (19, 70), (20, 70)])
    assert [lvl for lvl, _ in out] == [Level.SHED] * 5 + [Level.NORMAL]


def test_steps_back_one_level_per_hold_period() -> None:
    st, out = run([(0, 98), (1, 50), (11, 50), (20, 50), (21, 50), (31, 50), (41, 50)])
    levels = [lvl for lvl, _ in out]
    assert levels == [
        Level.CRITICAL,
        Level.CRITICAL,
        Level.DEGRADE,  # 10 s below recover
        Level.DEGRADE,  # the next step waits a full hold again
        Level.SHED,
        Level.NORMAL,
        Level.NORMAL,
    ]
    # Growing the context back starts only at normal, one doubling per hold period.
    assert out[5][1] == []
    assert out[6][1] == ["grow:2048"]
    assert st.n_ctx == 2048


def test_degrade_keeps_shrinking_after_the_cooldown_down_to_the_floor() -> None:
    st, out = run([(0, 93), (2, 93), (5, 93), (9, 93), (10, 93), (15, 93), (30, 95)])
    assert out[0] == (Level.DEGRADE, ["trim", "shrink:1024"])
    assert out[1] == (Level.DEGRADE, [])  # cooldown (5 s) not over
    assert out[2] == (Level.DEGRADE, ["shrink:512"])
    assert [k for _, k in out[3:]] == [[], [], [], []]  # at the floor
    assert st.n_ctx == 512


def test_no_further_shrink_when_the_shrink_brought_pressure_under_degrade() -> None:
    _, out = run([(0, 93), (10, 88), (20, 88)])
    assert out[1:] == [(Level.DEGRADE, []), (Level.DEGRADE, [])]


def test_shrink_predicts_the_kv_bytes_it_frees() -> None:
    d = decide(PolicyState.initial(2048), snap(93), 0, TH, DEG, MODEL)
    (resize,) = [a for a in d.actions if isinstance(a, ResizeContext)]
    assert resize.predicted_delta_bytes == 1024 * 100


def test_abort_repeats_only_after_its_cooldown_while_still_critical() -> None:
    # A large context: each shrink frees enough that parking is never the answer.
    _, out = run([(0, 98), (1, 98), (2, 98), (3, 96), (5, 99)], PolicyState.initial(8192))
    aborts = ["abort" in kinds for _, kinds in out]
    assert aborts == [True, False, True, False, True]


def test_critical_at_the_floor_parks_the_engine_instead_of_aborting() -> None:
    at_floor = PolicyState(n_ctx_full=2048, n_ctx=512, level=Level.DEGRADE)
    st, out = run([(0, 98)], at_floor)
    assert out == [(Level.CRITICAL, ["park:512"])]
    assert st.parked
    # Above the floor the ladder shrinks first and never parks in the same step.
    st, out = run([(0, 98)])
    assert out == [(Level.CRITICAL, ["trim", "shrink:1024", "abort"])]
    assert not st.parked


def test_critical_parks_above_the_floor_when_the_next_shrink_cannot_help() -> None:
    # At 1024 cells the next shrink frees 512 x 100 bytes = 5.1% of the limit:
    # from 98% that leaves 92.9%, still degrade, and the reload takes seconds.
    # The engine is parked at once (it comes back at the floor context).
    st, out = run([(0, 98)], PolicyState(n_ctx_full=2048, n_ctx=1024, level=Level.DEGRADE))
    assert out == [(Level.CRITICAL, ["park:512"])]
    assert st.parked and st.n_ctx == 512
    # From 96.5% (degrade) the same shrink is worth it: no park.
    st, out = run([(0, 96.5)], PolicyState(n_ctx_full=2048, n_ctx=1024, level=Level.DEGRADE))
    assert out == [(Level.DEGRADE, ["shrink:512"])] and not st.parked
    # Without a KV model there is nothing to weigh: the ladder shrinks as before.
    d = decide(PolicyState(n_ctx_full=2048, n_ctx=1024), snap(98), 0, TH, DEG, MemoryModel())
    assert not d.state.parked


def test_while_reloading_only_critical_acts_and_it_parks() -> None:
    loading = PolicyState(n_ctx_full=2048, n_ctx=1024, level=Level.DEGRADE, last_resize_s=0.0)
    # The reload's dip is no recovery and a rise short of critical changes nothing.
    for pct in (40.0, 93.0, 96.9):
        d = decide_while_reloading(loading, snap(pct), 1.0, TH, DEG)
        assert d.state == loading and d.actions == () and d.transitions == ()
    d = decide_while_reloading(loading, snap(99), 1.0, TH, DEG)
    assert d.actions == (ParkEngine(99.0, 512),)
    assert d.state.parked and d.state.n_ctx == 512 and d.state.level is Level.CRITICAL
    assert [(t.from_level, t.to_level) for t in d.transitions] == [(Level.DEGRADE, Level.CRITICAL)]
    # Parked already, or parking turned off: nothing more.
    assert decide_while_reloading(d.state, snap(99), 2.0, TH, DEG).actions == ()
    off = DegradeSettings(n_ctx_floor=512, park_at_floor=False)
    assert decide_while_reloading(loading, snap(99), 1.0, TH, off).actions == ()


def test_parking_can_be_turned_off() -> None:
    at_floor = PolicyState(n_ctx_full=2048, n_ctx=512, level=Level.DEGRADE)
    deg = DegradeSettings(n_ctx_floor=512, park_at_floor=False)
    d = decide(at_floor, snap(98), 0, TH, deg, MODEL)
    assert d.actions == (AbortNewest(98.0),)
    assert not d.state.parked


def test_parked_engine_resumes_after_the_hold_when_it_fits_again() -> None:
    # Parked holding 100,000 bytes = 10% of the limit.
    parked = PolicyState(
        n_ctx_full=2048, n_ctx=512, level=Level.CRITICAL, parked=True, parked_bytes=100_000
    )
    st, out = run([(0, 99), (1, 60), (10.9, 60), (11, 60)], parked)
    # Nothing to shrink or abort while parked, even at 99%.
    assert [k for _, k in out] == [[], [], [], ["resume:512"]]
    assert not st.parked and st.n_ctx == 512
    # 75% + 10% would reach shed (85%): stays parked however long it waits.
    st, out = run([(0, 75), (11, 75), (100, 75)], parked)
    assert [k for _, k in out] == [[], [], []]
    assert st.parked
    # A worker that alone is 70% of the limit comes back beside 10% of other
    # use (80%: above recover, below shed), or it would stay parked forever.
    big = PolicyState(
        n_ctx_full=512, n_ctx=512, level=Level.CRITICAL, parked=True, parked_bytes=700_000
    )
    st, out = run([(0, 10), (10, 10)], big)
    assert [k for _, k in out] == [[], ["resume:512"]] and not st.parked


def test_after_resuming_the_context_grows_one_hold_later() -> None:
    parked = PolicyState(
        n_ctx_full=2048, n_ctx=512, level=Level.NORMAL, parked=True, parked_bytes=50_000
    )
    st, out = run([(0, 40), (10, 40), (15, 45), (20, 45)], parked)
    assert st.n_ctx == 1024 and not st.parked
    assert [k for _, k in out] == [[], ["resume:512"], [], ["grow:1024"]]


def test_context_grows_back_only_when_the_plan_says_it_fits() -> None:
    degraded = PolicyState(n_ctx_full=2048, n_ctx=512, level=Level.NORMAL, below_since_s=0.0)
    # 512 -> 1024 costs 512 * 100 = 51,200 bytes = 5.1% of the limit.
    d = decide(degraded, snap(70), 20, TH, DEG, MODEL)
    assert [a for a in d.actions if isinstance(a, ResizeContext)] == [
        ResizeContext(512, 1024, -51_200)
    ]
    d = decide(degraded, snap(76), 20, TH, DEG, MODEL)  # 76 + 5.1 >= 80: stay small
    assert d.actions == ()
    assert d.state.n_ctx == 512


def test_commit_pressure_counts_only_under_overcommit_mode_2() -> None:
    commit = {"commit_limit_bytes": 1000, "committed_as_bytes": 950}
    assert pressure_pct(snap(10, overcommit_mode=2, **commit)) == pytest.approx(95.0)
    assert pressure_pct(snap(10, overcommit_mode=0, **commit)) == pytest.approx(10.0)


def test_no_limit_means_no_pressure() -> None:
    s = MemorySnapshot(0.0, "processes", 123, None, None)
    assert pressure_pct(s) == 0.0
    assert decide(PolicyState.initial(2048), s, 0, TH, DEG, MODEL).state.level is Level.NORMAL


@pytest.mark.parametrize(
    ("level", "n_ctx", "cap"),
    [
        (Level.NORMAL, 2048, None),
        (Level.SHED, 2048, None),
        (Level.DEGRADE, 2048, 64),
        (Level.CRITICAL, 1024, 64),
        (Level.NORMAL, 1024, 64),  # still capped until the context is full again
    ],
)
def test_max_tokens_cap(level: Level, n_ctx: int, cap: int | None) -> None:
    assert max_tokens_cap(PolicyState(2048, n_ctx, level=level), DEG) == cap


def test_admission_while_parked_is_503_engine_parked() -> None:
    parked = PolicyState(2048, 512, level=Level.NORMAL, parked=True)
    verdict = admit(state=parked, snap=snap(40), th=TH)
    assert (verdict.status, verdict.code, verdict.retry_after_s) == (503, "engine_parked", 10)
    # A request that can never fit is still told so for good: the front's own 400 (the
    # context verdict has no 503 for it), before admission is asked.
    assert context_verdict(3000, 10, slot_now=512, slot_full=2048, th=TH) is None


@pytest.mark.parametrize(
    ("level", "n_ctx", "pct", "extra", "status", "code"),
    [
        (Level.NORMAL, 2048, 50, 0, 200, "ok"),
        (Level.SHED, 2048, 86, 0, 503, "memory_shedding"),
        (Level.DEGRADE, 1024, 93, 0, 503, "memory_shedding"),
        # Back at normal with a halved context: admitted (the cap and the context
        # verdict below decide the rest).
        (Level.NORMAL, 1024, 60, 0, 200, "ok"),
        # Projected memory: 60% + 300,000 bytes crosses 85%; 200,000 does not.
        (Level.NORMAL, 2048, 60, 300_000, 503, "memory_projection"),
        (Level.NORMAL, 2048, 60, 200_000, 200, "ok"),
        (Level.NORMAL, 2048, 10, 900_000, 400, "request_too_large"),
    ],
)
def test_admission_table(
    level: Level, n_ctx: int, pct: float, extra: int, status: int, code: str
) -> None:
    state = PolicyState(2048, n_ctx, level=level)
    verdict = admit(state=state, snap=snap(pct), th=TH, extra_bytes=extra)
    assert (verdict.status, verdict.code) == (status, code)
    assert verdict.admitted is (status == 200)
    if status == 503:
        assert verdict.retry_after_s == 10
    else:
        assert verdict.retry_after_s is None
    err = verdict.error()
    assert (err is None) is (status == 200)
    if err is not None:
        assert envelope(err).status == status and envelope(err).code == code


@pytest.mark.parametrize(
    ("slot_now", "prompt", "max_tokens", "code"),
    [
        # Not degraded: a request over the slot is over the planned one too (the front's 400).
        (2048, 2000, 49, None),
        (2048, 2000, 100, None),
        # A halved context: what fits the planned slot waits (503), the rest is a 400.
        (1024, 1000, 64, "context_degraded"),
        (1024, 2000, 100, None),
        (1024, 2000, 48, "context_degraded"),
        # It fits the context as it is: nothing to say (the front does not ask).
        (1024, 1000, 24, None),
        (1024, 1000, 0, None),  # "until the context is full": one token
    ],
)
def test_context_verdict_table(
    slot_now: int, prompt: int, max_tokens: int, code: str | None
) -> None:
    verdict = context_verdict(prompt, max_tokens, slot_now=slot_now, slot_full=2048, th=TH)
    if code is None:
        assert verdict is None
        return
    assert verdict is not None
    assert (verdict.status, verdict.code, verdict.retry_after_s) == (503, code, 10)
    assert (
        f"reduced to {slot_now} tokens" in verdict.message and "(planned 2048)" in verdict.message
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shed_pct": 70.0},  # below recover
        {"degrade_pct": 80.0},
        {"critical_pct": 101.0},
        {"recover_pct": 0.0},
        {"recover_hold_s": -1.0},
    ],
)
def test_bad_thresholds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="governor thresholds"):
        Thresholds(**kwargs)


def test_bad_degrade_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="degrade settings"):
        DegradeSettings(max_tokens_cap=0)


def test_thresholds_from_plan_watermarks_with_overrides() -> None:
    th = Thresholds.from_watermarks(Watermarks(shed_pct=80, recover_pct=70), recover_hold_s=3.0)
    assert (th.shed_pct, th.degrade_pct, th.recover_pct, th.recover_hold_s) == (80, 92, 70, 3.0)


def test_kv_bytes_per_token_matches_the_measured_gemma_figure() -> None:
    # Gemma 3 270M: 18 layers x 1 KV head x (256 + 256) x 2 bytes (seed: ~18 KB/token).
    assert kv_bytes_per_token(18, 1, 256, 256, "f16") == 18_432
    assert kv_bytes_per_token(2, (1, 2), 4, 4, "q8_0") == int(3 * 8 * 34 / 32)
    with pytest.raises(ConfigError):
        kv_bytes_per_token(18, 1, 256, 256, "f32")


def test_memory_model_from_plan() -> None:
    plan = Plan(
        model=ModelSpec("m", "gemma3", 1, 18, 32768),
        board=BoardSpec("b", 4 << 30, (0,), (0,)),
        engine=EngineSettings(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2),
        limits=Limits(2 << 30, 3 << 30, 1 << 28),
        budget=(
            BudgetPart("weights", 1000, kind="file"),
            BudgetPart("kv_cache", 2048 * 18_432),
            BudgetPart("compute_buffer", 500, when="use"),
            BudgetPart("npu", 700, when="use", kind="device"),
        ),
    )
    assert MemoryModel.from_plan(plan) == MemoryModel(kv_bytes_per_token=18_432, use_bytes=500)


# ---------------------------------------------------------------- a model without a KV cache

NO_KV = MemoryModel(kv_bytes_per_token=0, use_bytes=0, no_kv_cache=True)


def _run_no_kv(
    steps: list[tuple[float, float]], state: PolicyState
) -> tuple[PolicyState, list[list[object]]]:
    out: list[list[object]] = []
    for now, pct in steps:
        d = decide(state, snap(pct), now, TH, DEG, NO_KV)
        state = d.state
        out.append(list(d.actions))
    return state, out


def test_a_model_without_a_kv_cache_is_never_shrunk() -> None:
    """An encoder (BERT: llama.cpp gives it no KV cache) frees nothing with a smaller
    context: degrade trims and caps but restarts no engine, however long it stays."""
    st, out = _run_no_kv([(0, 93), (5, 93), (10, 95), (30, 96)], PolicyState.initial(2048))
    assert not any(isinstance(a, ResizeContext) for actions in out for a in actions)
    assert out[0] == [TrimSessions(256)]
    assert st.level is Level.DEGRADE and st.n_ctx == 2048 and not st.context_degraded
    assert max_tokens_cap(st, DEG) == 64
    # Shedding still refuses new work.
    shed = decide(PolicyState.initial(2048), snap(86), 0, TH, DEG, NO_KV).state
    assert admit(state=shed, snap=snap(86), th=TH).code == "memory_shedding"


def test_a_model_without_a_kv_cache_parks_at_critical_at_its_own_context() -> None:
    """No shrink can help it, so critical parks at once (above n_ctx_floor), and the
    engine comes back at the context it had, not at the floor."""
    st, out = _run_no_kv([(0, 98)], PolicyState.initial(2048))
    assert out == [[ParkEngine(98.0, 2048)]]
    assert st.parked and st.n_ctx == 2048
    st, out = _run_no_kv([(1, 50), (11, 50)], replace(st, parked_bytes=10_000))
    assert out == [[], [ResumeEngine(2048, 51.0)]] and not st.parked
    # A critical rise while the engine reloads parks it at its context too.
    loading = PolicyState(n_ctx_full=2048, n_ctx=2048, level=Level.DEGRADE)
    d = decide_while_reloading(loading, snap(99), 1.0, TH, DEG, NO_KV)
    assert d.actions == (ParkEngine(99.0, 2048),) and d.state.n_ctx == 2048


def test_memory_model_from_a_plan_whose_kv_parts_are_zero() -> None:
    """A plan whose KV parts are 0 bytes says the engine has no KV cache; host and
    device KV parts are counted together (an offloaded KV is not "no KV")."""

    def plan(*parts: BudgetPart) -> Plan:
        return Plan(
            model=ModelSpec("m", "bert", 1, 2, 512),
            board=BoardSpec("b", 4 << 30, (0,), (0,)),
            engine=EngineSettings(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2),
            limits=Limits(2 << 30, 3 << 30, 1 << 28),
            budget=(BudgetPart("weights", 1000, kind="file"), *parts),
        )

    encoder = MemoryModel.from_plan(plan(BudgetPart("kv_cache", 0)))
    assert encoder == MemoryModel(kv_bytes_per_token=0, use_bytes=0, no_kv_cache=True)
    offloaded = MemoryModel.from_plan(
        plan(BudgetPart("kv_cache", 0), BudgetPart("gpu_kv", 1024 * 300, kind="device"))
    )
    assert offloaded == MemoryModel(kv_bytes_per_token=300, use_bytes=0)
    assert not MemoryModel.from_plan(plan()).no_kv_cache  # no KV part: unknown, not none
