"""Presets and the planner: sanity of published numbers, choices, refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slmguard.errors import PlanError, UsageError
from slmguard.plan.boards import PROFILES, get_profile
from slmguard.plan.budget import repacked_bytes
from slmguard.plan.modelfacts import ModelFacts, read_model_facts
from slmguard.plan.planner import PlanRequest, make_plan, zone_bytes
from slmguard.plan.presets import PRESETS, parse_preset, preset_facts, preset_names
from slmguard.plan.schema import dumps_plan, load_plan

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def gemma() -> ModelFacts:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return read_model_facts(ensure_default_model(paths.model_dir()))


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
        # Q8_0 files are larger than Q4_K_M ones of the same model.
        assert p.file_bytes["Q8_0"] > p.file_bytes["Q4_K_M"]
    assert len(PRESETS) >= 8


def test_gemma_preset_matches_the_real_header(gemma: ModelFacts) -> None:
    facts, _, _ = preset_facts("gemma-3-270m-it:Q4_K_M")
    assert facts.file_bytes == gemma.file_bytes
    assert facts.swa_layers == gemma.swa_layers
    assert (facts.n_layer, facts.n_head_kv, facts.key_length) == (18, 1, 256)
    # The synthesized tensor mix predicts the same repacking as the real file (+-1 %).
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
    assert plan.engine.n_ctx == 32768  # the trained length fits everywhere
    assert plan.limits.memory_max_bytes <= zone_bytes(prof)
    assert plan.limits.memory_high_bytes < plan.limits.memory_max_bytes
    k = plan.kernel
    assert k.commit_charge_bytes <= prof.ram_bytes * k.overcommit_ratio // 100
    assert plan.engine.n_threads == len(prof.big_cores)
    if board.startswith("rk3588"):
        assert plan.cpu_affinity == (4, 5, 6, 7)
        assert k.cma_bytes == prof.npu_reserve_bytes
    for key in ("n_ctx", "n_batch", "kv_type", "n_threads", "memory_max", "overcommit", "cma"):
        assert plan.reasons[key]
    # The plan survives the schema's own validation.
    p = tmp_path / "plan.json"
    p.write_text(dumps_plan(plan))
    assert load_plan(p) == plan


def test_largest_context_is_chosen_and_bounded() -> None:
    facts, _, _ = preset_facts("qwen2.5-3b-instruct")
    rk4 = get_profile("rk3588-4g")
    plan = make_plan(PlanRequest(facts, rk4))
    assert plan.engine.n_ctx % 256 == 0
    assert 1024 <= plan.engine.n_ctx < facts.n_ctx_train
    # One step more would not fit.
    with pytest.raises(PlanError):
        make_plan(PlanRequest(facts, rk4, ctx=plan.engine.n_ctx + 256, n_batch=512, kv_type="f16"))
    # The same model on the 8 GB board gets a larger context.
    assert make_plan(PlanRequest(facts, get_profile("rk3588-8g"))).engine.n_ctx > plan.engine.n_ctx


def test_requested_context_falls_back_to_smaller_batch_then_q8() -> None:
    facts, _, _ = preset_facts("llama-3.2-3b-instruct")
    rk4 = get_profile("rk3588-4g")
    largest = make_plan(PlanRequest(facts, rk4)).engine.n_ctx
    target = largest + 1024
    plan = make_plan(PlanRequest(facts, rk4, ctx=target))
    assert plan.engine.n_ctx == target
    assert (plan.engine.n_batch, plan.engine.kv_type) != (512, "f16")
    assert "did not fit" in plan.reasons["n_batch"] + plan.reasons["kv_type"]


def test_refusal_carries_the_numbers() -> None:
    facts, _, _ = preset_facts("phi-3.5-mini-instruct:Q8_0")
    rk4 = get_profile("rk3588-4g")
    with pytest.raises(PlanError) as info:
        make_plan(PlanRequest(facts, rk4))
    err = info.value
    assert err.have_bytes == zone_bytes(rk4)
    assert err.need_bytes is not None and err.need_bytes > err.have_bytes
    assert "does not fit rk3588-4g" in err.message and err.hint


def test_requested_context_too_large(gemma: ModelFacts) -> None:
    tiny = dataclasses.replace(get_profile("rpi5-4g"), ram_bytes=1200 * MiB)
    with pytest.raises(PlanError) as info:
        make_plan(PlanRequest(gemma, tiny, ctx=32768))
    assert "n_ctx 32768" in info.value.message


def test_reserves_larger_than_ram(gemma: ModelFacts) -> None:
    broken = dataclasses.replace(get_profile("generic"), os_reserve_bytes=8 * GiB)
    with pytest.raises(PlanError, match="leave no memory"):
        make_plan(PlanRequest(gemma, broken))


def test_cgroup_quota_caps_threads(gemma: ModelFacts) -> None:
    board = dataclasses.replace(get_profile("rk3588-8g"), max_threads=2)
    plan = make_plan(PlanRequest(gemma, board))
    assert plan.engine.n_threads == 2
    assert "quota" in plan.reasons["n_threads"]


def test_watermarks_sit_above_the_planned_peak(gemma: ModelFacts) -> None:
    facts, _, _ = preset_facts("qwen2.5-3b-instruct")
    plan = make_plan(PlanRequest(facts, get_profile("rk3588-4g")))
    peak = sum(
        p.bytes
        for p in plan.budget
        if p.kind in ("anon", "file") and p.name != "weights_mapped_cold"
    )
    w = plan.watermarks
    assert peak * 100 / plan.limits.memory_high_bytes < w.shed_pct
    assert w.recover_pct < w.shed_pct <= w.degrade_pct <= w.critical_pct <= 100


def test_watermarks_keep_the_governor_spacing_when_the_peak_is_low(gemma: ModelFacts) -> None:
    plan = make_plan(PlanRequest(gemma, get_profile("rk3588-16g"), ctx=4096))
    w = plan.watermarks
    assert (w.shed_pct, w.degrade_pct, w.critical_pct, w.recover_pct) == (85, 92, 97, 77)


def test_context_beyond_training_is_refused(gemma: ModelFacts) -> None:
    with pytest.raises(PlanError, match="beyond Gemma 3 270m's trained context of 32768"):
        make_plan(PlanRequest(gemma, get_profile("rk3588-16g"), ctx=65536))


def test_host_commit_counts_on_auto_boards(gemma: ModelFacts) -> None:
    prof = get_profile("rk3588-8g")
    base = make_plan(PlanRequest(gemma, prof))
    busy = dataclasses.replace(prof, committed_bytes=4 * GiB)
    plan = make_plan(PlanRequest(gemma, busy))
    assert plan.kernel.commit_charge_bytes - base.kernel.commit_charge_bytes == 4 * GiB - (
        prof.os_reserve_bytes + prof.business_reserve_bytes
    )
    assert plan.kernel.overcommit_ratio > base.kernel.overcommit_ratio
    assert "Committed_AS 4,096 MiB" in plan.reasons["overcommit"]
