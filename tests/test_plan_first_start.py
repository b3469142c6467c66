"""What a cold first start holds beyond the steady state: a Vulkan engine compiling its
shaders (Mesa's cache empty or unwritable), the plan's ``first_start`` parts.

Budgeted beside the steady state, never in it (the governor's watermarks are for the
steady state); the planner and serve's re-budget hold the steady peak plus the first
start against MemoryMax and refuse with the numbers; the commit charge includes it; the
plan file carries it and refuses it anywhere else. Preset facts (no model file needed).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from planinputs import budget_input
from slmguard.errors import ConfigError, PlanError
from slmguard.plan import offload
from slmguard.plan.boards import PROFILES, BoardProfile
from slmguard.plan.budget import compute_budget
from slmguard.plan.configs import PlanRequest
from slmguard.plan.limits import memory_limits
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.parts import DEVICE_PARTS, BudgetInput
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.planner import make_plan
from slmguard.plan.presets import preset_facts
from slmguard.plan.rebudget import budget_input as rebudget_input
from slmguard.plan.rebudget import rebudget
from slmguard.plan.schema import FIRST_START_PARTS, BudgetGpu, EngineSettings, Plan, Watermarks

MiB = 1 << 20
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SHADER = offload.VULKAN_SHADER_COMPILE_BYTES
PI = PROFILES["rpi5-8g"]  # Vulkan (v3dv), its buffers charged to the cgroup
#: The recovery line just under MemoryHigh, so that only MemoryMax can refuse.
HIGH_LINE = Watermarks(shed_pct=99.5, degrade_pct=99.6, critical_pct=99.7, recover_pct=99.0)


def _facts() -> ModelFacts:
    facts, _, _ = preset_facts("gemma-3-270m-it:Q4_K_M")
    return facts


VULKAN, CUDA = BudgetGpu("vulkan"), BudgetGpu("cuda")


def _input(**fields: Any) -> BudgetInput:
    return budget_input(_facts(), n_ctx=2048, **fields)


def _request(board: BoardProfile, *, layers: int | None = 19, **changes: object) -> PlanRequest:
    engine: dict[str, object] = {"n_parallel": 1, "flash_attn": False}
    if layers is not None:
        engine["n_gpu_layers"] = layers
    req = PlanRequest(
        facts=_facts(), board=board, ctx=2048, engine=engine, gpu=board.gpu,
        preset="gemma-3-270m-it", quant="Q4_K_M",
    )  # fmt: skip
    return dataclasses.replace(req, **changes)  # type: ignore[arg-type]


def _hot(plan: Plan) -> int:
    """The plan's steady peak, host and device (Budget.hot_bytes) from its parts."""
    host = sum(
        p.bytes
        for p in plan.budget
        if p.kind in ("anon", "file") and p.name != "weights_mapped_cold"
    )
    return host + sum(p.bytes for p in plan.budget if p.name in DEVICE_PARTS)


def _board_with_memory_max(memory_max: int) -> BoardProfile:
    """The Pi 5 with RAM such that MemoryMax is ``memory_max`` (the reserves as they are)."""
    reserves = PI.os_reserve_bytes + PI.business_reserve_bytes + PI.npu_reserve_bytes
    return dataclasses.replace(PI, ram_bytes=memory_max + reserves)


# ---------------------------------------------------------------- the budget


def test_a_vulkan_offload_budgets_the_cold_start_beside_the_steady_state() -> None:
    b = compute_budget(_input(gpu=VULKAN, n_gpu_layers=19, device="Vulkan0"))
    assert [(p.name, p.bytes, p.kind) for p in b.first_start] == [
        ("gpu_shader_compile", SHADER, "anon")
    ]
    assert "(lavapipe, -fa off)" in b.first_start[0].note
    assert b.part("gpu_shader_compile") is None  # not a steady-state part
    steady = sum(p.bytes for p in b.parts if p.kind in ("anon", "file"))
    assert b.service_bytes == steady  # no steady total counts it
    assert b.first_start_bytes == SHADER
    assert b.first_start_hot_bytes == b.hot_bytes + SHADER
    assert b.first_start_commit_bytes == b.service_commit_bytes + SHADER


@pytest.mark.parametrize(
    "fields",
    [
        {},  # CPU only
        {"gpu": VULKAN, "device": "none"},  # a Vulkan build with --device none
        {"gpu": VULKAN, "n_gpu_layers": 0},  # the default device
        {"gpu": CUDA, "n_gpu_layers": 19, "device": "CUDA0"},  # not measured
    ],
)
def test_no_first_start_part_without_layers_on_a_vulkan_device(fields: dict[str, object]) -> None:
    b = compute_budget(_input(**fields))
    assert b.first_start == () and b.first_start_hot_bytes == b.hot_bytes


def test_flash_attention_budgets_its_own_cold_start() -> None:
    """A cold start with flash attention compiles its pipelines too, and holds far more:
    the part follows -fa (measured on lavapipe, plan.offload)."""
    on = compute_budget(_input(gpu=VULKAN, n_gpu_layers=9, device="Vulkan0", flash_attn=True))
    assert [(p.name, p.bytes) for p in on.first_start] == [
        ("gpu_shader_compile", offload.VULKAN_SHADER_COMPILE_FA_BYTES)
    ]
    assert "-fa on" in on.first_start[0].note
    assert offload.VULKAN_SHADER_COMPILE_FA_BYTES > SHADER


def test_the_figure_covers_every_committed_cold_cell() -> None:
    """benchmarks/shader_cache.py on the committed cells (cold against the same cells
    warm): the part is the worst offloaded cell's difference, rounded up to a MiB."""
    sys.path.insert(0, str(BENCHMARKS))
    import shader_cache

    warm = json.loads((BENCHMARKS / "plan_accuracy_gpu_cells.json").read_text())
    cold = json.loads((BENCHMARKS / "plan_accuracy_gpu_cells_cold.json").read_text())
    missing = BENCHMARKS / "no-model.gguf"  # the measured differences only, no budget
    rows = shader_cache.rows(warm, cold, missing)
    _, over = shader_cache.worst(rows)
    off = [r for r in rows if r["offloaded"] and not r["cell"]["flash_attn"]]
    assert over is None and [round(r["diff"] / MiB, 1) for r in off] == [
        77.0, 99.8, 87.7, 81.6,
    ]  # fmt: skip
    assert -(-max(r["diff"] for r in off) // MiB) * MiB == SHADER
    # With flash attention, the cold cells against the steady budget (with the model).
    fa = shader_cache.rows(warm, cold, None)
    fa = [r for r in fa if r["offloaded"] and r["cell"]["flash_attn"]]
    if fa and all(r["over"] is not None for r in fa):
        worst = max(r["over"] for r in fa)
        assert -(-worst // MiB) * MiB == offload.VULKAN_SHADER_COMPILE_FA_BYTES
    # No part where nothing is offloaded: those cells differ by 4.3 MiB or less.
    assert all(abs(r["diff"]) <= 4.5 * MiB for r in rows if not r["offloaded"] and r["diff"])


# ---------------------------------------------------------------- the planner


def test_a_vulkan_plan_carries_the_first_start_and_says_why() -> None:
    plan = make_plan(_request(PI))
    assert [p.name for p in plan.first_start] == ["gpu_shader_compile"]
    assert all(p.name not in FIRST_START_PARTS for p in plan.budget)
    why = plan.reasons["first_start"]
    assert "gpu_shader_compile 100 MiB" in why and "MemoryMax" in why
    # The commit charge is what a cold start commits: the first start's heap included.
    facts = _facts()
    b = compute_budget(rebudget_input(plan, facts, plan.engine))
    others = PI.os_reserve_bytes + PI.business_reserve_bytes
    assert plan.kernel.commit_charge_bytes == b.first_start_commit_bytes + others


def test_a_cpu_plan_has_no_first_start() -> None:
    plan = make_plan(_request(PI, gpu=None, layers=None))
    assert plan.first_start == () and "first_start" not in plan.reasons


def test_a_first_start_over_memory_max_is_refused_with_the_numbers() -> None:
    """The steady peak fits the recovery line, the cold start does not fit MemoryMax."""
    hot = _hot(make_plan(_request(PI, watermarks=HIGH_LINE)))
    board = _board_with_memory_max(-(-(hot + SHADER // 2) // MiB) * MiB)
    with pytest.raises(PlanError) as caught:
        make_plan(_request(board, watermarks=HIGH_LINE))
    err = caught.value
    assert "a cold first start (Mesa's shader cache empty) holds" in err.message
    assert "+ 100 MiB of gpu_shader_compile, but MemoryMax is" in err.message
    # The numbers are those of the smallest configuration tried (n_ubatch 64 here).
    assert err.have_bytes == memory_limits(board)[1]  # MemoryMax (v3d: all in the cgroup)
    assert err.need_bytes is not None and err.have_bytes < err.need_bytes <= hot + SHADER
    # With room for it, the same request is planned, within MemoryMax after a cold start.
    roomy = _board_with_memory_max(-(-(hot + SHADER) // MiB) * MiB)
    plan = make_plan(_request(roomy, watermarks=HIGH_LINE))
    assert _hot(plan) + SHADER <= plan.limits.memory_max_bytes


def test_the_planner_offloads_nothing_rather_than_overrun_memory_max() -> None:
    """Left to choose, the planner takes a configuration whose cold start fits."""
    hot = _hot(make_plan(_request(PI, watermarks=HIGH_LINE)))
    board = _board_with_memory_max(-(-(hot + SHADER // 2) // MiB) * MiB)
    plan = make_plan(_request(board, watermarks=HIGH_LINE, layers=None))
    # Every offloaded count needs the same 100 MiB more: none offloaded, nothing compiled.
    assert (plan.engine.n_gpu_layers, plan.engine.device, plan.first_start) == (0, "none", ())
    assert _hot(plan) <= plan.limits.memory_max_bytes


def test_offloading_nothing_for_the_first_start_says_so() -> None:
    """The reason for offloading nothing names the cold start when it is the cause, with
    the numbers: the steady state took the layers, the first start's part did not fit."""
    hot = _hot(make_plan(_request(PI, watermarks=HIGH_LINE)))
    board = _board_with_memory_max(-(-(hot + SHADER // 2) // MiB) * MiB)
    plan = make_plan(_request(board, watermarks=HIGH_LINE, layers=None))
    why = plan.reasons["gpu_layers"]
    assert why.startswith("none of 19 on ") and "--device none" in why
    assert "a cold first start would not fit: 19 layers fit the steady state (1 slot(s) x 2048" in (
        why
    )
    got = re.search(r"adds gpu_shader_compile 100 MiB: ([\d,]+) MiB \+ it = ([\d,]+) MiB, "
                    r"over MemoryMax ([\d,]+) MiB; --device none", why)  # fmt: skip
    assert got is not None, why
    peak, start, memory_max = (int(g.replace(",", "")) for g in got.groups())
    assert memory_max == memory_limits(board)[1] // MiB
    assert start == peak + 100 and peak <= memory_max < start and peak <= hot // MiB
    assert "less context" not in why


def test_offloading_nothing_for_the_steady_state_does_not_blame_the_first_start() -> None:
    """A GPU whose heap holds none of the offloaded buffers: the steady state refuses every
    offload, so the first start is not the reason."""
    assert PI.gpu is not None
    tiny = dataclasses.replace(PI.gpu, max_bytes=MiB)
    plan = make_plan(_request(PI, gpu=tiny, layers=None))
    why = plan.reasons["gpu_layers"]
    assert plan.engine.device == "none" and "first start" not in why
    assert "no configuration with layers on the GPU fits" in why


# ---------------------------------------------------------------- serve's re-budget


def _tight_pi_plan() -> tuple[Plan, int, EngineSettings]:
    """The Pi 5 Vulkan plan with MemoryMax 50 MiB over its planned peak (less than the
    first start needs), its peak, and its engine with one thread less (a change that
    needs a re-budget but keeps the peak)."""
    plan = make_plan(_request(PI))
    hot = _hot(plan)
    tight = dataclasses.replace(
        plan,
        limits=dataclasses.replace(
            plan.limits, memory_high_bytes=hot + 50 * MiB, memory_max_bytes=hot + 50 * MiB
        ),
        watermarks=HIGH_LINE,
    )
    return tight, hot, dataclasses.replace(plan.engine, n_threads=plan.engine.n_threads - 1)


def test_rebudget_holds_the_first_start_against_the_plans_memory_max() -> None:
    tight, hot, engine = _tight_pi_plan()
    r = rebudget(tight, _facts(), engine)
    assert r.changed == ("n_threads",) and r.peak_fits
    assert [p.name for p in r.plan.first_start] == ["gpu_shader_compile"]
    assert r.start_bytes == r.peak_bytes + SHADER
    assert r.start_limit_bytes == hot + 50 * MiB
    assert not r.start_fits and not r.fits
    roomy = dataclasses.replace(
        tight, limits=dataclasses.replace(tight.limits, memory_max_bytes=hot + 2 * SHADER)
    )
    assert rebudget(roomy, _facts(), engine).start_fits


# ---------------------------------------------------------------- the plan file


def _data() -> dict[str, object]:
    data: dict[str, object] = json.loads(dumps_plan(make_plan(_request(PI))))
    return data


def _load(tmp_path: Path, data: object) -> Plan:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return load_plan(path)


def test_the_plan_file_carries_the_first_start(tmp_path: Path) -> None:
    plan = make_plan(_request(PI))
    assert _load(tmp_path, json.loads(dumps_plan(plan))) == plan
    older = _data()
    del older["first_start"]  # a plan written before it: no first start
    assert _load(tmp_path, older).first_start == ()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda d: d["first_start"][0].update(name="kv_cache"),
            "plan.first_start[0].name: 'kv_cache' is not a first-start part",
        ),
        (
            lambda d: d["first_start"].append(dict(d["first_start"][0])),
            "plan.first_start: 2 entries (at most 1)",
        ),
        (
            lambda d: d["budget"].append(dict(d["first_start"][0])),
            "is a first-start part (plan.first_start)",
        ),
        (
            lambda d: d["first_start"][0].update(bytes=-1),
            "plan.first_start[0].bytes: -1 is below 0",
        ),
    ],
)
def test_hostile_first_start_parts_are_refused(
    tmp_path: Path, mutate: object, message: str
) -> None:
    data = _data()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, data)
    assert message in caught.value.message


def test_serve_refuses_a_first_start_over_memory_max_with_the_numbers() -> None:
    from slmguard.serve.modelcheck import _refusal

    tight, hot, engine = _tight_pi_plan()
    err = _refusal(tight, rebudget(tight, _facts(), engine), "--threads 3", "the plan")
    assert "a cold first start (Mesa's shader cache empty) would hold" in err.message
    assert "+ gpu_shader_compile, but the plan's MemoryMax is" in err.message
    assert err.need_bytes is not None and err.have_bytes == hot + 50 * MiB
    assert err.need_bytes > err.have_bytes


def test_plan_shows_the_first_start_apart_from_the_steady_state() -> None:
    from slmguard.commands.plan import render_text

    text = render_text(make_plan(_request(PI)))
    steady, _, after = text.partition("first start only (a cold one")
    assert "gpu_shader_compile" not in steady and "service at peak" in steady
    assert after.splitlines()[1].startswith("gpu_shader_compile      104,857,600      100.0")
    assert "cold start at peak" in after and "(host and GPU; MemoryMax" in after
    assert "first start only" not in render_text(make_plan(_request(PI, gpu=None, layers=None)))
