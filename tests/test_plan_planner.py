"""Presets and the planner: sanity of published numbers, choices, refusals with numbers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slmguard.errors import PlanError, UsageError
from slmguard.plan.allocation import repacked_bytes
from slmguard.plan.boards import PROFILES, get_profile
from slmguard.plan.configs import PlanRequest
from slmguard.plan.inputs import PlanChoices
from slmguard.plan.limits import memory_limits, zone_bytes
from slmguard.plan.modelfacts import ModelFacts, read_model_facts
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.planner import make_plan
from slmguard.plan.presets import PRESETS, parse_preset, preset_facts, preset_names
from slmguard.plan.schema import Plan, Watermarks

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_MARKS = (85.0, 92.0, 97.0, 80.0)


@pytest.fixture(scope="module")
def gemma() -> ModelFacts:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return read_model_facts(ensure_default_model(paths.model_dir()))


def _peak(plan: Plan) -> int:
    return sum(
        p.bytes
        for p in plan.budget
        if p.kind in ("anon", "file") and p.name != "weights_mapped_cold"
    )


def _marks(plan: Plan) -> tuple[float, ...]:
    w = plan.watermarks
    return (w.shed_pct, w.degrade_pct, w.critical_pct, w.recover_pct)


def _below_recovery(plan: Plan) -> bool:
    return _peak(plan) <= plan.limits.memory_high_bytes * plan.watermarks.recover_pct / 100


def test_3b_q4_k_m_weights_near_the_source_documents_1_8_gb() -> None:
    for name in ("qwen2.5-3b-instruct", "llama-3.2-3b-instruct"):
        facts, _, quant = preset_facts(name)
        assert quant == "Q4_K_M"
        assert 1.7 * GiB < facts.tensor_bytes < 1.95 * GiB, name


def test_every_preset_and_quant_is_consistent() -> None:
    for spec in preset_names():
        if ":" not in spec:
            continue
        facts, p, quant = preset_facts(spec)
        assert facts.file_bytes == p.file_bytes[quant]
        assert 0 < facts.data_offset_bytes < 10_000_000
        assert facts.n_layer == p.n_layer and facts.n_vocab == p.n_vocab
        assert p.file_bytes["Q8_0"] > p.file_bytes["Q4_K_M"]
    assert len(PRESETS) >= 8
    qwen, _, _ = preset_facts("qwen2.5-0.5b-instruct")
    assert qwen.tensor("blk.0.attn_q.bias") is not None  # Qwen2's Q/K/V biases


def test_gemma_preset_matches_the_real_header(gemma: ModelFacts) -> None:
    facts, _, _ = preset_facts("gemma-3-270m-it:Q4_K_M")
    assert facts.file_bytes == gemma.file_bytes
    assert facts.swa_layers == gemma.swa_layers
    assert (facts.n_layer, facts.n_head_kv, facts.key_length) == (18, 1, 256)
    real = repacked_bytes(gemma, "x86_avx2")
    assert abs(repacked_bytes(facts, "x86_avx2") - real) <= real / 100


def test_preset_errors() -> None:
    with pytest.raises(UsageError, match="unknown preset"):
        parse_preset("gpt-5")
    with pytest.raises(UsageError, match="no Q2_K size"):
        parse_preset("qwen2.5-3b-instruct:Q2_K")
    assert parse_preset("QWEN2.5-3B-INSTRUCT:q8_0")[1] == "Q8_0"


@pytest.mark.parametrize("board", sorted(PROFILES))
def test_default_model_plans_on_every_board(gemma: ModelFacts, board: str, tmp_path: Path) -> None:
    prof = get_profile(board)
    plan = make_plan(PlanRequest(gemma, prof, model_path="/m.gguf"))
    assert _marks(plan) == DEFAULT_MARKS  # fixed first, never moved
    assert _below_recovery(plan)
    assert plan.limits.memory_max_bytes <= zone_bytes(prof)
    assert plan.limits.memory_high_bytes < plan.limits.memory_max_bytes
    k = plan.kernel
    assert k.commit_charge_bytes <= prof.ram_bytes * k.overcommit_ratio // 100
    assert plan.engine.n_threads == len(prof.big_cores)
    e = plan.engine
    assert e.flash_attn and e.cache_ram_mib == 0 and e.n_ctx % (256 * e.n_parallel) == 0
    if board.startswith("rk3588"):
        assert plan.cpu_affinity == (4, 5, 6, 7)
        assert k.cma_bytes == prof.npu_reserve_bytes
    for key in (
        "n_ctx",
        "slots",
        "flash_attn",
        "n_batch",
        "kv_type",
        "swa",
        "cache_ram",
        "n_threads",
        "memory_max",
        "watermarks",
        "overcommit",
        "cma",
    ):
        assert plan.reasons[key]
    p = tmp_path / "plan.json"
    p.write_text(dumps_plan(plan))
    assert load_plan(p) == plan


def test_issue_example_keeps_the_watermarks_and_the_peak_below_recovery() -> None:
    """`plan --preset qwen2.5-0.5b-instruct --board rk3588-4g`: before this planner it
    chose n_ctx 32256 with a 1,764 MiB compute buffer, a peak at 95% of MemoryHigh
    and watermarks raised to 96/98/99.5."""
    facts, _, _ = preset_facts("qwen2.5-0.5b-instruct")
    plan = make_plan(PlanRequest(facts, get_profile("rk3588-4g")))
    assert _marks(plan) == DEFAULT_MARKS
    assert _below_recovery(plan)
    assert _peak(plan) * 100 / plan.limits.memory_high_bytes < 80
    e = plan.engine
    assert e.flash_attn and e.n_parallel == 4 and e.n_ctx // 4 >= 30_000
    cb = next(p for p in plan.budget if p.name == "compute_buffer")
    assert cb.bytes < 100 * MiB
    why = plan.reasons["flash_attn"]
    assert "with -fa on" in why and "with -fa off" in why
    assert "below the recovery line" in plan.reasons["watermarks"]


def test_largest_context_is_chosen_and_bounded() -> None:
    facts, _, _ = preset_facts("llama-3.2-3b-instruct")
    rk4 = get_profile("rk3588-8g")
    plan = make_plan(PlanRequest(facts, rk4, engine={"n_parallel": 1}))
    ctx = plan.engine.n_ctx
    assert ctx % 256 == 0 and 4096 <= ctx < facts.n_ctx_train
    assert _below_recovery(plan)
    # One step more is refused with the numbers: need = its peak, have = the recovery line.
    with pytest.raises(PlanError) as info:
        make_plan(
            PlanRequest(
                facts,
                rk4,
                ctx=ctx + 256,
                engine={"n_parallel": 1, "n_batch": 512, "kv_type": "f16"},
            )
        )
    err = info.value
    high, _ = memory_limits(rk4)
    assert err.have_bytes == int(high * 0.80)
    assert err.need_bytes is not None and err.need_bytes > err.have_bytes
    assert "recovery line" in err.message
    assert (
        make_plan(
            PlanRequest(facts, get_profile("rk3588-16g"), engine={"n_parallel": 1})
        ).engine.n_ctx
        > ctx
    )


def test_slots_and_ctx_are_honoured(gemma: ModelFacts) -> None:
    board = get_profile("rk3588-8g")
    plan = make_plan(PlanRequest(gemma, board, ctx=2000, engine={"n_parallel": 3}))
    e = plan.engine
    assert (e.n_parallel, e.n_ctx) == (3, 3 * 2048)  # padded per slot to 256 cells
    assert "padded to 2048" in plan.reasons["n_ctx"]
    assert plan.reasons["slots"].startswith("3 as requested")


def test_slots_fall_back_when_the_context_would_be_too_small() -> None:
    facts, _, _ = preset_facts("qwen2.5-3b-instruct")
    plan = make_plan(PlanRequest(facts, get_profile("rk3588-4g")))
    assert plan.engine.n_parallel == 1
    assert "2 would leave a slot fewer than 4096 tokens" in plan.reasons["slots"]
    roomy = make_plan(PlanRequest(facts, get_profile("rk3588-8g")))
    assert roomy.engine.n_parallel == 4 and roomy.engine.n_ctx // 4 >= 4096
    small = make_plan(PlanRequest(preset_facts("gemma-3-270m-it")[0], get_profile("rpi5-8g")))
    assert small.engine.n_parallel == 4


def test_requested_context_falls_back_to_smaller_batch_then_q8() -> None:
    facts, _, _ = preset_facts("llama-3.2-3b-instruct")
    rk8 = get_profile("rk3588-8g")
    largest = make_plan(PlanRequest(facts, rk8, engine={"n_parallel": 1})).engine.n_ctx
    plan = make_plan(PlanRequest(facts, rk8, ctx=largest + 2048, engine={"n_parallel": 1}))
    assert plan.engine.n_ctx == largest + 2048
    assert plan.engine.kv_type == "q8_0" and plan.engine.flash_attn
    assert "did not fit" in plan.reasons["kv_type"]


def test_flash_attention_can_be_forced_off(gemma: ModelFacts) -> None:
    board = get_profile("rk3588-8g")
    on = make_plan(PlanRequest(gemma, board, ctx=8192, engine={"n_parallel": 1}))
    off = make_plan(
        PlanRequest(gemma, board, ctx=8192, engine={"n_parallel": 1, "flash_attn": False})
    )
    assert on.engine.flash_attn and not off.engine.flash_attn
    assert _peak(off) > _peak(on)
    assert "(requested)" in off.reasons["flash_attn"]
    with pytest.raises(PlanError, match="needs flash attention"):
        make_plan(PlanRequest(gemma, board, engine={"kv_type": "q8_0", "flash_attn": False}))


def test_watermarks_from_the_caller_and_cache_ram(gemma: ModelFacts) -> None:
    board = get_profile("rk3588-8g")
    marks = Watermarks(shed_pct=75.0, degrade_pct=85.0, critical_pct=95.0, recover_pct=60.0)
    plan = make_plan(PlanRequest(gemma, board, watermarks=marks))
    assert plan.watermarks == marks and _below_recovery(plan)
    base = make_plan(PlanRequest(gemma, board, ctx=4096, engine={"n_parallel": 1}))
    cached = make_plan(
        PlanRequest(gemma, board, ctx=4096, engine={"n_parallel": 1, "cache_ram_mib": 512})
    )
    assert cached.engine.cache_ram_mib == 512
    assert _peak(cached) - _peak(base) == 512 * MiB
    assert "budgeted in full" in cached.reasons["cache_ram"]


def test_choices_are_validated() -> None:
    PlanChoices(engine={"n_parallel": 4, "cache_ram_mib": 0}).validate()
    for bad, needle in (
        (PlanChoices(engine={"n_parallel": 0}), "--n-parallel 0"),
        (PlanChoices(engine={"n_threads": 2}), "the planner does not take engine.n_threads"),
        (PlanChoices(engine={"cache_ram_mib": -1}), "cannot be budgeted"),
        (PlanChoices(watermarks=Watermarks(shed_pct=80.0, recover_pct=85.0)), "recover < shed"),
    ):
        with pytest.raises(UsageError, match=needle):
            bad.validate()


def test_refusal_carries_the_numbers() -> None:
    facts, _, _ = preset_facts("phi-3.5-mini-instruct:Q8_0")
    rk4 = get_profile("rk3588-4g")
    with pytest.raises(PlanError) as info:
        make_plan(PlanRequest(facts, rk4))
    err = info.value
    assert err.need_bytes is not None and err.have_bytes is not None
    assert err.need_bytes > err.have_bytes
    assert "does not fit rk3588-4g" in err.message and err.hint


def test_requested_context_too_large(gemma: ModelFacts) -> None:
    tiny = dataclasses.replace(get_profile("rpi5-4g"), ram_bytes=1200 * MiB)
    with pytest.raises(PlanError) as info:
        make_plan(PlanRequest(gemma, tiny, ctx=32768, engine={"n_parallel": 2}))
    assert "2 slot(s) x n_ctx 32768" in info.value.message


def test_reserves_larger_than_ram(gemma: ModelFacts) -> None:
    broken = dataclasses.replace(get_profile("generic"), os_reserve_bytes=8 * GiB)
    with pytest.raises(PlanError, match="leave no memory"):
        make_plan(PlanRequest(gemma, broken))


def test_cgroup_quota_caps_threads_and_slots(gemma: ModelFacts) -> None:
    board = dataclasses.replace(get_profile("rk3588-8g"), max_threads=2)
    plan = make_plan(PlanRequest(gemma, board))
    assert plan.engine.n_threads == 2 and plan.engine.n_parallel <= 2
    assert "quota" in plan.reasons["n_threads"]


def test_context_beyond_training_is_refused(gemma: ModelFacts) -> None:
    with pytest.raises(PlanError, match="beyond Gemma 3 270m's trained context of 32768"):
        make_plan(PlanRequest(gemma, get_profile("rk3588-16g"), ctx=65536))


def test_host_commit_counts_on_auto_boards(gemma: ModelFacts) -> None:
    prof = get_profile("rk3588-8g")
    base = make_plan(PlanRequest(gemma, prof))
    busy = dataclasses.replace(prof, committed_bytes=3 * GiB)
    plan = make_plan(PlanRequest(gemma, busy))
    assert plan.kernel.commit_charge_bytes - base.kernel.commit_charge_bytes == 3 * GiB - (
        prof.os_reserve_bytes + prof.business_reserve_bytes
    )
    assert plan.kernel.overcommit_ratio > base.kernel.overcommit_ratio
    assert "Committed_AS 3,072 MiB" in plan.reasons["overcommit"]


def test_the_context_reason_names_the_commit_when_it_is_the_bound(gemma: ModelFacts) -> None:
    """A host that already commits 4 GiB of an 8 GB board: the context stops where the
    commit charge reaches the recovery line at ratio 100, not at the peak's line, and the
    reason says so (it said the peak's line)."""
    prof = get_profile("rk3588-8g")
    base = make_plan(PlanRequest(gemma, prof))  # the trained 32768 per slot
    busy = dataclasses.replace(prof, committed_bytes=4 * GiB)
    plan = make_plan(PlanRequest(gemma, busy))
    assert plan.engine.n_ctx < base.engine.n_ctx
    why = plan.reasons["n_ctx"]
    assert "whose commit charge stays at the recovery line of the largest CommitLimit" in why
    line = int(prof.ram_bytes * 80 / 100)
    assert f"{line / (1 << 20):,.0f} MiB" in why
    assert plan.kernel.commit_charge_bytes <= line < plan.kernel.commit_charge_bytes * 1.1
    assert plan.kernel.overcommit_ratio == 100  # the largest CommitLimit, reached


def test_the_planned_commit_sits_at_the_governors_recovery_line(gemma: ModelFacts) -> None:
    """Under mode 2 the governor reads Committed_AS / CommitLimit as pressure: a commit that
    reaches the plan must not be past the shed line, so the ratio puts it at recover_pct."""
    for marks in (Watermarks(), Watermarks(shed_pct=80, degrade_pct=90, critical_pct=96,
                                           recover_pct=70)):  # fmt: skip
        plan = make_plan(PlanRequest(gemma, get_profile("rk3588-8g"), watermarks=marks))
        k = plan.kernel
        limit = plan.board.ram_bytes * k.overcommit_ratio // 100
        assert k.commit_charge_bytes * 100 <= limit * marks.recover_pct
        assert (k.overcommit_ratio - 1) * plan.board.ram_bytes * marks.recover_pct < (
            k.commit_charge_bytes * 100 * 100
        )  # the smallest ratio that does


def test_seed_case_part_by_part() -> None:
    """The source document's 4 GB board: Qwen2.5-0.5B and 3B at -c 2048 (docs/plan.md)."""
    rk4 = get_profile("rk3588-4g")
    small = make_plan(
        PlanRequest(
            preset_facts("qwen2.5-0.5b-instruct")[0], rk4, ctx=2048, engine={"n_parallel": 1}
        )
    )
    assert _peak(small) < 800 * MiB and _below_recovery(small)
    q3, _, _ = preset_facts("qwen2.5-3b-instruct")
    # 1.8 GB of weights: on the A76 nearly all of them are repacked into anonymous memory.
    with pytest.raises(PlanError) as info:
        make_plan(PlanRequest(q3, rk4, ctx=2048, engine={"n_parallel": 1}))
    assert info.value.need_bytes is not None and info.value.have_bytes is not None
    assert info.value.need_bytes - info.value.have_bytes < 64 * MiB
    # With the recovery line at 85% (shed 90) it fits, still below MemoryHigh.
    marks = Watermarks(shed_pct=90.0, degrade_pct=95.0, critical_pct=98.0, recover_pct=85.0)
    plan = make_plan(PlanRequest(q3, rk4, ctx=2048, watermarks=marks, engine={"n_parallel": 1}))
    assert _below_recovery(plan) and plan.engine.n_ctx == 2048


def test_an_encoder_is_planned_without_a_kv_cache(rerank_model: Path) -> None:
    """A BERT reranker (llama.cpp runs it without a KV cache): the plan budgets no KV
    and says why, and n_batch = n_ubatch = the context per slot, since every input is
    computed whole in one ubatch (a shorter one would refuse inputs the context admits)."""
    facts = read_model_facts(rerank_model)
    assert not facts.causal_attn and facts.pooling_type == 4 and not facts.has_kv_cache
    for board in ("rk3588-4g", "rpi5-4g"):
        plan = make_plan(PlanRequest(facts, get_profile(board)))
        kv = plan.part("kv_cache")
        assert kv is not None and kv.bytes == 0, board
        assert "without a KV cache" in kv.note
        assert plan.part("ctx_checkpoints") is None
        e = plan.engine
        assert e.n_ctx_slot == facts.n_ctx_train == 512
        assert e.n_batch == e.n_ubatch == e.n_ctx_slot
        assert e.kv_type == "f16"
        assert plan.reasons["kv_type"].startswith("none: llama.cpp runs bert without a KV cache")
        assert "never shrinks" in plan.reasons["kv_type"]
        assert "one ubatch" in plan.reasons["n_batch"]
        assert _below_recovery(plan)
    # A context asked for is honoured the same way: its batch is the slot's context.
    plan = make_plan(
        PlanRequest(facts, get_profile("rk3588-4g"), ctx=256, engine={"n_parallel": 2})
    )
    assert (plan.engine.n_ctx, plan.engine.n_batch, plan.engine.n_ubatch) == (512, 256, 256)
    assert plan.part("kv_cache").bytes == 0  # type: ignore[union-attr]
