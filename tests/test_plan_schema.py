"""The plan schema: round trip, versioning and validation errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slmguard.errors import ConfigError
from slmguard.plan.schema import (
    SCHEMA,
    BoardSpec,
    BudgetPart,
    EngineSettings,
    Limits,
    ModelSpec,
    Plan,
    dumps_plan,
    load_plan,
)


def _plan() -> Plan:
    return Plan(
        model=ModelSpec(
            name="m",
            arch="gemma3",
            file_bytes=253_000_000,
            n_layer=18,
            n_ctx_train=32768,
            path="/m.gguf",
        ),
        board=BoardSpec(
            name="rk3588-4g",
            ram_bytes=4 << 30,
            cpus=(0, 1, 2, 3, 4, 5, 6, 7),
            big_cores=(4, 5, 6, 7),
        ),
        engine=EngineSettings(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=4),
        limits=Limits(
            memory_high_bytes=2 << 30, memory_max_bytes=3 << 30, os_reserve_bytes=512 << 20
        ),
        budget=(BudgetPart("kv_cache", 37_748_736, when="load"),),
        cpu_affinity=(4, 5, 6, 7),
        reasons={"n_ctx": "largest that fits"},
    )


def test_round_trip(tmp_path: Path) -> None:
    p = tmp_path / "plan.json"
    p.write_text(dumps_plan(_plan()))
    assert json.loads(p.read_text())["schema"] == SCHEMA
    assert load_plan(p) == _plan()


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(schema="slmguard.plan/2"), "not supported"),
        (lambda d: d.update(schema="other/1"), "not an slmguard plan"),
        (lambda d: d["engine"].update(n_ctx="big"), "plan.engine.n_ctx: expected an integer"),
        (lambda d: d["engine"].update(kv_type="f32"), "kv_type"),
        (lambda d: d["limits"].update(memory_high_bytes=4 << 30), "memory_high_bytes"),
        (lambda d: d.pop("model"), "missing field 'model'"),
        (lambda d: d["watermarks"].update(shed_pct=99.0), "watermarks"),
    ],
)
def test_invalid_plans_name_the_problem(tmp_path: Path, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(dumps_plan(_plan()))
    mutate(data)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_plan(p)
    assert needle in str(info.value)
    assert str(p) in str(info.value)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_plan(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_plan(bad)


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    data = json.loads(dumps_plan(_plan()))
    data["future_field"] = {"x": 1}
    data["engine"]["flash_attn"] = True
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    assert load_plan(p).engine.n_ctx == 2048
