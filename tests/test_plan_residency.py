"""What the server asks of a board plan (plan/residency.py): names, peaks, resident sets,
the degrade ladder's order."""

from __future__ import annotations

import dataclasses

from boardplans import board_plan, primary_plan
from slmguard.plan.parts import hot_bytes
from slmguard.plan.residency import (
    degrade_order,
    find,
    name_for,
    planned_models,
    primary_serving,
    resident_together,
    served_name,
)
from slmguard.plan.schema import BoardModel, BudgetPart, ModelSpec, Plan, ResidentSet, Serving


def _three() -> Plan:
    plan = board_plan()
    embed = dataclasses.replace(
        plan.models[0],
        serving=Serving(name="embed", role="embedding", residency="pinned", priority=10),
    )
    return dataclasses.replace(
        plan,
        models=(*plan.models, embed),
        resident_sets=(ResidentSet(("gemma", "embed", "rerank"), 1 << 30),),
    )


def test_models_are_found_by_name_and_alias() -> None:
    plan = board_plan()
    chat, rerank = find(plan, "chat"), find(plan, "bge-reranker")
    assert chat is not None and chat.index is None
    assert rerank is not None and rerank.index == 0
    assert find(plan, "nope") is None
    assert [m.serving.name for m in planned_models(plan)] == ["gemma", "rerank"]


def test_a_models_peak_is_its_budgets_hot_bytes() -> None:
    parts = (
        BudgetPart("weights_mapped", 100, kind="file"),
        BudgetPart("weights_mapped_cold", 1000, kind="file"),
        BudgetPart("kv_cache", 10),
        BudgetPart("gpu_kv", 7, kind="device"),
        BudgetPart("os_reserve", 5000, kind="reserve"),
    )
    assert hot_bytes(parts) == 117
    assert planned_models(dataclasses.replace(primary_plan(), budget=parts))[0].peak_bytes == 117


def test_resident_together_is_within_a_recorded_set() -> None:
    plan = board_plan()
    assert resident_together(plan, ["gemma", "rerank"])
    assert resident_together(plan, ["gemma"])
    two_sets = dataclasses.replace(
        _three(),
        resident_sets=(
            ResidentSet(("gemma", "embed"), 1 << 30),
            ResidentSet(("gemma", "embed", "rerank"), 1 << 30),
        ),
    )
    assert resident_together(two_sets, ["embed", "rerank"])
    only = dataclasses.replace(two_sets, resident_sets=(ResidentSet(("gemma", "embed"), 1),))
    assert not resident_together(only, ["gemma", "rerank"])
    one = primary_plan()
    assert resident_together(one, ["gemma"]) and not resident_together(one, ["other"])


def test_the_ladder_takes_the_lowest_priority_first_and_the_later_of_equals() -> None:
    plan = _three()
    assert degrade_order(plan) == ("embed", "rerank", "gemma")
    rerank = plan.models[0]
    same = dataclasses.replace(rerank, serving=dataclasses.replace(rerank.serving, priority=10))
    equal = dataclasses.replace(plan, models=(same, plan.models[1]))
    assert degrade_order(equal) == ("embed", "rerank", "gemma")


def test_served_names_come_from_the_file_or_preset() -> None:
    spec = primary_plan().model
    assert served_name(spec) == "gemma"
    assert name_for("/m/My Model (v2).gguf", None) == "My-Model--v2-"
    assert name_for("/m/\n.gguf", None) == ""
    assert name_for(None, "qwen2.5-0.5b-instruct") == "qwen2.5-0.5b-instruct"
    assert primary_serving(primary_plan()) == Serving(name="gemma", priority=100)
    assert isinstance(board_plan().models[0], BoardModel) and isinstance(spec, ModelSpec)
