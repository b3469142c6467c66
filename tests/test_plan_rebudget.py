"""A plan re-budgeted for other engine settings (serve's flags over it): the planner's
arithmetic and rules, the plan's limits, the largest context that fits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slmguard.governor.policy import MemoryModel
from slmguard.plan.boards import get_profile
from slmguard.plan.budget import compute_budget
from slmguard.plan.configs import PlanRequest
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.parts import BudgetInput
from slmguard.plan.planfile import check_plan
from slmguard.plan.planner import make_plan
from slmguard.plan.rebudget import budget_input, changed_fields, legacy_inputs, rebudget
from slmguard.plan.schema import BudgetBoard, EngineSettings, Plan

MiB = 1 << 20


def _plan(preset: str, board: str, ctx: int, slots: int) -> tuple[Plan, ModelFacts]:
    from slmguard.plan.presets import preset_facts

    facts, p, quant = preset_facts(preset)
    req = PlanRequest(
        facts=facts,
        board=get_profile(board),
        ctx=ctx,
        preset=p.name,
        quant=quant,
        engine={"n_parallel": slots},
    )
    return make_plan(req), facts


@pytest.fixture(scope="module")
def llama_4g() -> tuple[Plan, ModelFacts]:
    """Llama 3.2 1B (trained on 131,072 tokens) planned for 2 slots x 4096 on a 4 GB board."""
    return _plan("llama-3.2-1b-instruct", "rk3588-4g", 4096, 2)


def _ctx(e: EngineSettings, ctx: int, slots: int | None = None) -> EngineSettings:
    slots = slots or e.n_parallel
    return dataclasses.replace(e, n_ctx=ctx * slots, n_parallel=slots)


@pytest.mark.parametrize(
    ("preset", "board"),
    [
        ("llama-3.2-1b-instruct", "rk3588-4g"),
        ("qwen2.5-0.5b-instruct", "generic"),
        ("gemma-3-270m-it", "rpi5-4g"),
        ("qwen2.5-1.5b-instruct:Q8_0", "jetson-orin-nano-8g"),
    ],
)
def test_the_plans_own_settings_give_the_plans_own_budget(preset: str, board: str) -> None:
    """The arithmetic at the plan's settings is the plan's: every part to the byte (from
    the inputs the plan records), and nothing counts as changed."""
    plan, facts = _plan(preset, board, 2048, 1)
    r = rebudget(plan, facts, plan.engine)
    assert r.plan.budget == plan.budget
    assert r.changed == () and r.fits
    assert r.peak_bytes == r.planned_peak_bytes and r.commit_bytes == r.planned_commit_bytes
    assert r.commit_bytes == plan.kernel.commit_charge_bytes
    assert r.line_bytes == int(plan.limits.memory_high_bytes * plan.watermarks.recover_pct / 100)


def test_a_context_the_memory_cannot_hold_is_refused_with_the_largest_that_fits(
    llama_4g: tuple[Plan, ModelFacts],
) -> None:
    """The issue's case: a plan for 2 x 4096 on a 4 GB board, served with --ctx 131072
    (the model's trained context): over the plan's recovery line; the largest context
    per slot that fits is searched with the same rules and is really the largest."""
    plan, facts = llama_4g
    r = rebudget(plan, facts, _ctx(plan.engine, 131072))
    assert r.changed == ("n_ctx",)
    assert not r.peak_fits and not r.fits
    assert r.peak_bytes > r.line_bytes > r.planned_peak_bytes
    largest = r.largest_ctx
    assert largest is not None and 4096 <= largest < 131072 and largest % 256 == 0
    assert rebudget(plan, facts, _ctx(plan.engine, largest)).fits
    assert not rebudget(plan, facts, _ctx(plan.engine, largest + 256)).fits


def test_the_kv_cache_grows_as_the_planners_arithmetic_says() -> None:
    """A context that fits: each part is what compute_budget makes for the new settings
    (the plan's figures are the arithmetic's here, so nothing is corrected), the peak moves
    by what they add, and the re-budgeted plan carries the new settings and stays valid."""
    plan, facts = _plan("llama-3.2-1b-instruct", "rk3588-8g", 3072, 2)
    engine = _ctx(plan.engine, 6144)
    r = rebudget(plan, facts, engine)
    assert r.fits and r.largest_ctx is None
    fresh = compute_budget(budget_input(plan, facts, engine))
    assert r.plan.budget == fresh.parts
    assert r.plan.engine == engine
    new_kv, old_kv = r.plan.part("kv_cache"), plan.part("kv_cache")
    assert new_kv is not None and old_kv is not None and new_kv.bytes == 2 * old_kv.bytes
    assert r.peak_bytes > r.planned_peak_bytes
    assert r.commit_bytes - r.planned_commit_bytes >= new_kv.bytes - old_kv.bytes
    check_plan(r.plan)
    # The governor's memory model from the re-budgeted plan: the new KV and use parts.
    model, stale = MemoryModel.from_plan(r.plan), MemoryModel.from_plan(plan)
    assert model.kv_bytes(engine.n_ctx) == new_kv.bytes
    assert model.use_bytes > stale.use_bytes  # the compute buffer grows with the context


def test_a_quantized_kv_cache_changes_the_governors_cost_per_token(
    llama_4g: tuple[Plan, ModelFacts],
) -> None:
    plan, facts = llama_4g
    engine = dataclasses.replace(plan.engine, kv_type="q8_0", flash_attn=True)
    r = rebudget(plan, facts, engine)
    assert r.fits and "kv_type" in r.changed
    per_token = MemoryModel.from_plan(r.plan).kv_bytes_per_token
    assert per_token < MemoryModel.from_plan(plan).kv_bytes_per_token
    assert per_token * 32 == MemoryModel.from_plan(plan).kv_bytes_per_token * 17  # 34 B / 32


def test_the_commit_charge_against_the_plans_overcommit_ratio() -> None:
    """Under vm.overcommit_memory=2 the plan's ratio is a limit as MemoryHigh is: a
    context whose peak fits but whose commit charge the plan's CommitLimit does not admit
    is refused too; a plan that does not ask for mode 2 has no commit limit."""
    plan, facts = _plan("gemma-3-270m-it", "rpi5-4g", 4096, 2)
    engine = _ctx(plan.engine, 16384)
    r = rebudget(plan, facts, engine)
    assert r.peak_fits and not r.commit_fits and not r.fits
    assert r.commit_limit_bytes == plan.board.ram_bytes * plan.kernel.overcommit_ratio // 100
    assert r.largest_ctx is not None and 4096 <= r.largest_ctx < 16384
    mode0 = dataclasses.replace(plan, kernel=dataclasses.replace(plan.kernel, overcommit_memory=0))
    loose = rebudget(mode0, facts, engine)
    assert loose.commit_limit_bytes is None and loose.fits


def test_the_commit_may_reach_the_recovery_line_of_commit_limit_or_the_plans_own() -> None:
    """The planner puts the commit charge at recover_pct of CommitLimit (the governor reads
    the commit as pressure under mode 2); a plan written with the older 10 % headroom
    (ratio 1.1 x its commit) keeps serving its own settings, and not one byte more."""
    plan, facts = _plan("gemma-3-270m-it", "rpi5-4g", 16384, 2)
    k, ram = plan.kernel, plan.board.ram_bytes
    assert k.overcommit_ratio > 50  # not the floor: the ratio is the commit's
    own = rebudget(plan, facts, plan.engine)
    assert own.fits and own.commit_line_bytes == int(ram * k.overcommit_ratio // 100 * 0.8)
    assert own.commit_bytes <= own.commit_line_bytes
    older = -(-k.commit_charge_bytes * 110 // ram)  # the ratio 1.1 x the charge needed
    assert older < k.overcommit_ratio
    old = dataclasses.replace(plan, kernel=dataclasses.replace(k, overcommit_ratio=older))
    kept = rebudget(old, facts, old.engine)
    assert kept.commit_line_bytes == kept.planned_commit_bytes == k.commit_charge_bytes
    assert kept.fits
    more = rebudget(old, facts, _ctx(old.engine, old.engine.n_ctx + 512))
    assert more.peak_fits and not more.commit_fits


def test_what_the_plan_records_differently_is_kept() -> None:
    """A part the plan records other than the arithmetic makes it (a hand-edited plan, a
    preset planned and a file served) keeps that difference; a changed part moves by what
    the arithmetic says the new settings change."""
    plan, facts = _plan("qwen2.5-0.5b-instruct", "rk3588-8g", 4096, 1)
    extra = 100 * MiB
    edited = dataclasses.replace(
        plan,
        budget=tuple(
            dataclasses.replace(p, bytes=p.bytes + extra)
            if p.name in ("kv_cache", "server_runtime")
            else p
            for p in plan.budget
        ),
    )
    engine = _ctx(plan.engine, 8192)
    fresh = rebudget(plan, facts, engine).plan
    r = rebudget(edited, facts, engine)
    for name in ("kv_cache", "server_runtime"):
        new, base = r.plan.part(name), fresh.part(name)
        assert new is not None and base is not None and new.bytes == base.bytes + extra
    assert r.planned_peak_bytes == rebudget(plan, facts, plan.engine).peak_bytes + 2 * extra


def test_a_context_padded_to_the_plans_cells_changes_nothing(
    llama_4g: tuple[Plan, ModelFacts],
) -> None:
    """llama.cpp allocates 256 cells at a time: --ctx 4000 over a plan of 4096 per slot
    is the same cache; 4097 is not; slots and the KV type are fields of their own."""
    plan, _ = llama_4g
    e = plan.engine
    assert changed_fields(e, _ctx(e, 4000)) == ()
    assert changed_fields(e, _ctx(e, 4097)) == ("n_ctx",)
    assert changed_fields(e, _ctx(e, 2048, slots=4)) == ("n_parallel",)
    assert changed_fields(e, dataclasses.replace(e, n_threads=e.n_threads + 1)) == ("n_threads",)
    assert changed_fields(e, dataclasses.replace(e, n_ubatch=64, n_batch=64)) == (
        "n_batch",
        "n_ubatch",
    )
    assert changed_fields(e, dataclasses.replace(e, llama_server="/usr/bin/llama-server")) == ()


def test_budget_input_is_the_planners_for_the_plans_settings(
    llama_4g: tuple[Plan, ModelFacts],
) -> None:
    """The inputs the plan records give the planner's parts: the board's ISA, CPUs and
    reserves, with the plan's engine settings (threads, slots ...) as they are."""
    plan, facts = llama_4g
    inp = budget_input(plan, facts, plan.engine)
    board = get_profile("rk3588-4g")
    assert isinstance(inp, BudgetInput) and inp.engine == plan.engine and inp.gpu is None
    assert inp.board == BudgetBoard(
        isa="arm_dotprod",
        n_cpus=len(board.cpus),
        npu_reserve_bytes=board.npu_reserve_bytes,
        os_reserve_bytes=board.os_reserve_bytes,
        business_reserve_bytes=board.business_reserve_bytes,
    )
    assert compute_budget(inp).parts == plan.budget


@pytest.mark.parametrize(
    ("preset", "board", "gpu"),
    [
        ("llama-3.2-1b-instruct", "rk3588-4g", "auto"),
        ("qwen2.5-0.5b-instruct", "generic", "auto"),
        ("qwen2.5-1.5b-instruct:Q8_0", "jetson-orin-nano-8g", "auto"),  # CUDA offload
        ("gemma-3-270m-it", "rpi5-8g", "none"),
    ],
)
def test_a_plan_from_before_the_recorded_inputs_re_budgets_alike(
    preset: str, board: str, gpu: str
) -> None:
    """A plan without ``budget_inputs`` (written before they were recorded): its inputs
    are found from it (the ISA whose repacking gives its repacked part, its CPUs and
    reserves, its engine's backend) and re-budget it as the recorded ones do."""
    from slmguard.plan.inputs import PlanChoices, resolve
    from slmguard.plan.presets import preset_facts

    facts = preset_facts(preset)[0]
    req = dataclasses.replace(
        resolve(Path("/"), preset=preset, board=board, choices=PlanChoices(gpu=gpu)).request,
        ctx=4096,
    )
    plan = make_plan(req)
    old = dataclasses.replace(plan, budget_inputs=None)
    assert legacy_inputs(old, facts) == plan.budget_inputs
    engine = _ctx(plan.engine, 8192)
    assert rebudget(old, facts, engine) == dataclasses.replace(
        rebudget(plan, facts, engine),
        plan=dataclasses.replace(rebudget(plan, facts, engine).plan, budget_inputs=None),
    )


OLD_PLANS = Path(__file__).parent / "fixtures" / "plans"


@pytest.mark.parametrize(
    ("name", "preset", "board", "slots"),
    [
        ("3f5600b-rpi5-4g.json", "gemma-3-270m-it", "rpi5-4g", 2),
        ("3f5600b-orin-8g-cuda.json", "qwen2.5-0.5b-instruct", "jetson-orin-nano-8g", None),
    ],
)
def test_an_old_plan_file_loads_and_re_budgets_as_a_new_one(
    name: str, preset: str, board: str, slots: int | None
) -> None:
    """A plan file written by 3f5600b (no ``budget_inputs``) still loads, is today's plan
    for the same request but for that field, and is re-budgeted as today's is."""
    from slmguard.plan.planfile import load_plan
    from slmguard.plan.presets import preset_facts

    old = load_plan(OLD_PLANS / name)
    assert old.budget_inputs is None
    from slmguard.plan.inputs import PlanChoices, resolve

    facts = preset_facts(preset)[0]
    choices = PlanChoices(engine={"n_parallel": slots} if slots else {})
    new = make_plan(
        resolve(Path("/"), preset=preset, board=board, ctx=4096, choices=choices).request
    )
    assert new.budget_inputs is not None
    assert dataclasses.replace(new, budget_inputs=None, reasons=old.reasons) == old
    # the one reason today's planner words further: where the commit charge sits
    assert new.reasons.keys() == old.reasons.keys()
    assert all(new.reasons[k] == v for k, v in old.reasons.items() if k != "overcommit")
    said, was = new.reasons["overcommit"], old.reasons["overcommit"]
    assert said.rsplit(" with ", 1)[0] == was.rsplit(" with ", 1)[0]
    assert was.endswith("with 10% headroom") and "with 25% headroom or more" in said
    wider = _ctx(old.engine, 8192)
    r_old, r_new = rebudget(old, facts, wider), rebudget(new, facts, wider)
    assert r_old.plan.budget == r_new.plan.budget and r_old.fits == r_new.fits
    assert (r_old.peak_bytes, r_old.commit_bytes) == (r_new.peak_bytes, r_new.commit_bytes)
