"""The board's additions to the plan schema (issue 39): several models, neighbours, the
sets of models that may be resident together; a one-model plan exactly as before."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from boardplans import board_plan, primary_plan
from slmguard.errors import ConfigError
from slmguard.plan.planfile import dumps_plan, load_plan, loads_plan
from slmguard.plan.relations import neighbours_bytes
from slmguard.plan.schema import Neighbour

FIXTURES = Path(__file__).parent / "fixtures" / "plans"
BOARD_KEYS = ("serving", "models", "neighbours", "resident_sets")


def test_a_one_model_plan_written_before_reads_and_writes_back_byte_for_byte() -> None:
    """The plan main wrote at a9eabe6 (before the board's fields): loaded and written again,
    the same bytes; none of the new keys appears."""
    raw = (FIXTURES / "a9eabe6-rk3588-4g.json").read_text()
    plan = loads_plan(raw.encode())
    assert dumps_plan(plan) == raw
    assert not set(BOARD_KEYS) & set(json.loads(raw))


def test_a_one_model_plan_has_none_of_the_board_keys() -> None:
    data = json.loads(dumps_plan(primary_plan()))
    assert not set(BOARD_KEYS) & set(data)


def test_a_board_plan_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(dumps_plan(board_plan()))
    plan = load_plan(path)
    assert plan == board_plan()
    assert neighbours_bytes(plan) == 800 << 20
    assert plan.models[0].serving.names == ("rerank", "bge-reranker")
    data = json.loads(path.read_text())
    assert [n["name"] for n in data["neighbours"]] == ["whisper", "camera"]


def test_an_old_reader_sees_the_primary_model() -> None:
    """What a reader from before the board sees: unknown keys ignored, the primary alone
    (its engine, budget and limits: the limits are the whole service's)."""
    data = json.loads(dumps_plan(board_plan()))
    for key in BOARD_KEYS:
        data.pop(key)
    assert loads_plan(json.dumps(data).encode()) == primary_plan()


def _bad(mutate: Callable[[dict[str, Any]], object]) -> ConfigError:
    data = json.loads(dumps_plan(board_plan()))
    mutate(data)
    with pytest.raises(ConfigError) as info:
        loads_plan(json.dumps(data).encode(), "plan.json")
    assert info.value.exit_code == 78
    assert "\n" not in str(info.value)
    return info.value


def _model(**values: Any) -> Callable[[dict[str, Any]], object]:
    return lambda d: d["models"][0]["serving"].update(values)


def _neighbour(i: int = 0, **values: Any) -> Callable[[dict[str, Any]], object]:
    return lambda d: d["neighbours"][i].update(values)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_model(name="re\nrank"), "plan.models[0].serving.name: 're\\nrank' contains a control"),
        (_model(name=""), "plan.models[0].serving.name: '' is empty"),
        (_model(name="a b"), "plan.models[0].serving.name: 'a b' does not match"),
        (_model(name="-rm"), "plan.models[0].serving.name: '-rm' does not match"),
        (_model(name="x" * 300), "is 300 characters long"),
        (_model(aliases=["a"] * 2), "plan.models[0].serving.aliases: 'a' appears twice"),
        (_model(aliases=[f"a{i}" for i in range(9)]), "aliases: 9 entries (at most 8)"),
        (_model(role="vision"), "plan.models[0].serving.role: 'vision' is not one of chat"),
        (_model(residency="lazy"), "residency: 'lazy' is not one of pinned, on_demand"),
        (_model(priority=-1), "plan.models[0].serving.priority: -1 is below 0"),
        (_model(priority=True), "plan.models[0].serving.priority: expected an integer"),
        (_model(idle_unload_s=10**9), "idle_unload_s: 1000000000 is above 604800"),
        (_model(name="chat"), "plan.models[0].serving: the name 'chat' is also plan.serving's"),
        (_model(aliases=["rerank"]), "the name 'rerank' is also plan.models[0].serving's"),
        (
            _model(residency="pinned"),
            "plan.models[0].serving.idle_unload_s: 300 for a pinned model",
        ),
        (
            lambda d: d["serving"].update(residency="on_demand"),
            "plan.serving.residency: on_demand (the primary model is pinned",
        ),
        (lambda d: d.pop("serving"), "plan.serving: a plan with several models says how"),
        (
            lambda d: d["models"][0]["engine"].update(n_ubatch=1024),
            "plan.models[0].engine.n_ubatch: 1024 is above n_batch 512",
        ),
        (
            lambda d: d["models"][0]["engine"].update(n_gpu_layers=4),
            "plan.models[0].engine.n_gpu_layers: 4 is above the model's 2 layers",
        ),
        (
            lambda d: d["models"][0]["model"].update(path=None),
            "plan.models[0].model: names neither a file (path) nor a preset",
        ),
        (lambda d: d["models"][0].update(model=None), "plan.models[0].model: expected an obj"),
        (lambda d: d.update(models=[d["models"][0]] * 8), "plan.models: 8 entries (at most 7)"),
        (lambda d: d.update(models={}), "plan.models: expected a list, got an object of 0"),
        (_neighbour(name="whisper\n[Service]"), "plan.neighbours[0].name: 'whisper\\n[Serv"),
        (_neighbour(name="../etc"), "plan.neighbours[0].name: '../etc' does not match"),
        (_neighbour(name="a%n"), "plan.neighbours[0].name: 'a%n' does not match"),
        (_neighbour(memory_bytes=0), "plan.neighbours[0].memory_bytes: 0 is below 1"),
        (_neighbour(memory_bytes=-5), "plan.neighbours[0].memory_bytes: -5 is below 1"),
        (_neighbour(memory_bytes=1 << 60), "memory_bytes: 1152921504606846976 is above"),
        (_neighbour(memory_bytes=1.5), "plan.neighbours[0].memory_bytes: expected an integer"),
        (_neighbour(memory_bytes="600M"), "memory_bytes: expected an integer, got '600M'"),
        (_neighbour(unit="-H host.service"), "plan.neighbours[0].unit: '-H host.service' does"),
        (_neighbour(unit="--help"), "plan.neighbours[0].unit: '--help' does not match"),
        (_neighbour(unit="a\\x2db.service"), "unit: 'a\\\\x2db.service' does not match"),
        (_neighbour(unit="../../x.service"), "plan.neighbours[0].unit: '../../x.service' does"),
        (_neighbour(unit="nginx.slice"), "plan.neighbours[0].unit: 'nginx.slice' does not"),
        (_neighbour(unit="a\nb.service"), "plan.neighbours[0].unit: 'a\\nb.service' contains"),
        (_neighbour(unit="slmguard.service"), "'slmguard.service' is one of slmguard's own"),
        (_neighbour(protection="max"), "plan.neighbours[0].protection: 'max' is not one of"),
        (_neighbour(source="guess"), "plan.neighbours[0].source: 'guess' is not one of"),
        (_neighbour(1, name="whisper"), "plan.neighbours[1].name: 'whisper' appears twice"),
        (_neighbour(1, unit="whisper.service"), "plan.neighbours[1].unit: 'whisper.service' ap"),
        (
            _neighbour(memory_bytes=900 << 20),
            "plan.neighbours: 1153433600 bytes declared, above the business reserve",
        ),
        (lambda d: d.update(neighbours=[d["neighbours"][0]] * 33), "33 entries (at most 32)"),
        (
            lambda d: d["resident_sets"][0].update(models=["gemma", "nope"]),
            "plan.resident_sets[0].models: 'nope' is no model of the plan",
        ),
        (
            lambda d: d["resident_sets"][0].update(models=["rerank"]),
            "plan.resident_sets[0].models: the pinned model 'gemma' is missing",
        ),
        (
            lambda d: d["resident_sets"][0].update(models=["gemma"]),
            "plan.models[0].serving: 'rerank' is in no resident set",
        ),
        (lambda d: d["resident_sets"][0].update(models=[]), "needs at least 1 entries, has 0"),
        (
            lambda d: d["resident_sets"][0].update(peak_bytes=-1),
            "plan.resident_sets[0].peak_bytes: -1 is below 0",
        ),
        (
            lambda d: d.update(models=[], resident_sets=d["resident_sets"]),
            "plan.resident_sets: a plan of one model has no resident sets",
        ),
    ],
)
def test_each_board_field_rule_is_a_78_with_the_field_path(
    mutate: Callable[[dict[str, Any]], object], message: str
) -> None:
    assert message in str(_bad(mutate))


def test_neighbours_alone_make_a_board_plan_of_one_model() -> None:
    """One model beside the board's services: no resident sets, no serving needed."""
    plan = dataclasses.replace(primary_plan(), neighbours=(Neighbour("whisper", 600 << 20),))
    assert loads_plan(dumps_plan(plan).encode()) == plan
    assert "resident_sets" not in json.loads(dumps_plan(plan))
