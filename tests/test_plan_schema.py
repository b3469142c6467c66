"""The plan schema: round trip, versioning and validation errors."""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slmguard.errors import ConfigError
from slmguard.plan.planfile import check_plan, dumps_plan, load_plan
from slmguard.plan.schema import (
    SCHEMA,
    BoardSpec,
    BudgetPart,
    EngineSettings,
    Limits,
    ModelSpec,
    Plan,
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
            sha256="0" * 64,
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
        (lambda d: d.update(schema="slmguard.plan/9"), "not supported"),
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


# -- Validation: every field's rule, declared once, checked by the one reader ---------


def _bad(tmp_path: Path, mutate: Callable[[dict[str, Any]], object]) -> ConfigError:
    data = json.loads(dumps_plan(_plan()))
    mutate(data)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_plan(p)
    assert info.value.exit_code == 78
    assert "\n" not in str(info.value)
    return info.value


def _set(section: str, **values: Any) -> Callable[[dict[str, Any]], object]:
    return lambda d: d[section].update(values)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set("engine", n_threads=1_000_000), "plan.engine.n_threads: 1000000 is above 4096"),
        (_set("engine", n_threads=0), "plan.engine.n_threads: 0 is below 1"),
        (_set("engine", n_ctx=10**12), "plan.engine.n_ctx: 1000000000000 is above 16777216"),
        (_set("engine", n_ctx=-1), "plan.engine.n_ctx: -1 is below 1"),
        (_set("engine", n_batch=1 << 20), "plan.engine.n_batch: 1048576 is above 65536"),
        (_set("engine", n_ubatch=1024), "plan.engine.n_ubatch: 1024 is above n_batch 512"),
        (_set("engine", n_parallel=0), "plan.engine.n_parallel: 0 is below 1"),
        (_set("engine", n_parallel=4096), "plan.engine.n_parallel: 4096 is above 256"),
        (_set("engine", cache_ram_mib=-1), "plan.engine.cache_ram_mib: -1 is below 0"),
        (_set("engine", kv_type="f32"), "plan.engine.kv_type: 'f32' is not one of f16, q8_0"),
        (_set("engine", use_mmap="yes"), "plan.engine.use_mmap: expected true/false, got 'yes'"),
        (_set("engine", llama_server="bin/llama"), "llama_server: 'bin/llama' is not an absolute"),
        (_set("limits", memory_high_bytes=4 << 30), "memory_high_bytes: 4294967296 is above"),
        (_set("limits", memory_max_bytes=0), "plan.limits.memory_max_bytes: 0 is below 1"),
        (
            _set("limits", memory_high_bytes=5 << 30, memory_max_bytes=6 << 30),
            "plan.limits.memory_max_bytes: 6442450944 is above the board's ram_bytes",
        ),
        (_set("limits", os_reserve_bytes=-5), "plan.limits.os_reserve_bytes: -5 is below 0"),
        (_set("watermarks", shed_pct=99.0), "plan.watermarks: need 0 < recover_pct < shed_pct"),
        (_set("watermarks", critical_pct=150), "plan.watermarks.critical_pct: 150 is above 100"),
        # Issue 37: both were applied.
        (
            _set("engine", cache_ram_mib=10**9),
            "plan.engine.cache_ram_mib: 1000000000 MiB of prompt cache is above memory_max_bytes",
        ),
        (
            _set(
                "watermarks",
                recover_pct=0.001,
                shed_pct=0.002,
                degrade_pct=0.003,
                critical_pct=0.004,
            ),
            "plan.watermarks.recover_pct: 0.001 is below 10 (percent of the memory limit",
        ),
        (_set("kernel", swappiness=-5), "plan.kernel.swappiness: -5 is below 0"),
        (_set("kernel", swappiness=201), "plan.kernel.swappiness: 201 is above 200"),
        (_set("kernel", overcommit_memory=7), "plan.kernel.overcommit_memory: 7 is above 2"),
        (_set("kernel", overcommit_ratio=101), "plan.kernel.overcommit_ratio: 101 is above 100"),
        (_set("kernel", cma_bytes=-1), "plan.kernel.cma_bytes: -1 is below 0"),
        (_set("kernel", cma_bytes=8 << 30), "plan.kernel.cma_bytes: 8589934592 is above"),
        (_set("board", cpus=[0, 1, 1]), "plan.board.cpus: 1 appears twice"),
        (_set("board", cpus=[0, -2]), "plan.board.cpus[1]: -2 is below 0"),
        (_set("board", cpus=[0, 4096]), "plan.board.cpus[1]: 4096 is above 4095"),
        (_set("board", cpus=[]), "plan.board.cpus: needs at least 1 entries, has 0"),
        (_set("board", big_cores=[9]), "plan.board.big_cores: CPU 9 is not in board.cpus"),
        (lambda d: d.update(cpu_affinity=[-2, -1]), "plan.cpu_affinity[0]: -2 is below 0"),
        (lambda d: d.update(cpu_affinity=[4, 12]), "plan.cpu_affinity: CPU 12 is not in board"),
        (
            _set("board", name="rk\n[Service]"),
            "plan.board.name: 'rk\\n[Service]' contains a control",
        ),
        (_set("board", name=""), "plan.board.name: '' is empty"),
        (_set("board", name="x" * 200), "plan.board.name: 'xxx"),
        (
            _set("board", device_nodes=["/etc/shadow"]),
            "device_nodes[0]: '/etc/shadow' is not under",
        ),
        (
            _set("board", device_nodes=["/dev/../etc/shadow"]),
            "plan.board.device_nodes[0]: '/dev/../etc/shadow' has a '..' component",
        ),
        (_set("board", device_groups=["render;rm"]), "device_groups[0]: 'render;rm' does not"),
        (_set("board", boot_file="/boot/../etc/passwd"), "plan.board.boot_file: '/boot/../etc"),
        (_set("board", boot_file="armbianEnv.txt"), "boot_file: 'armbianEnv.txt' is not an abs"),
        (_set("board", boot_file="/boot/a\x00b"), "plan.board.boot_file: '/boot/a\\x00b' contains"),
        (_set("model", name="tiny\nExecStartPre=+/bin/sh"), "plan.model.name: 'tiny\\nExec"),
        (_set("model", name="a\u202eb"), "plan.model.name: 'a\\u202eb' contains a control"),
        (_set("model", sha256="ABC"), "plan.model.sha256: 'ABC' does not match [0-9a-f]{64}"),
        (_set("model", arch="llama\n"), "plan.model.arch: 'llama\\n' contains a control"),
        (_set("model", path="m.gguf"), "plan.model.path: 'm.gguf' is not an absolute path"),
        (_set("model", path=None), "plan.model: names neither a file (path) nor a preset"),
        (_set("model", n_layer=10**9), "plan.model.n_layer: 1000000000 is above 1024"),
        (_set("model", file_bytes=-1), "plan.model.file_bytes: -1 is below 0"),
        (lambda d: d["budget"].append({"name": "x", "bytes": -1}), "plan.budget[1].bytes: -1"),
        (lambda d: d["budget"][0].update(kind="gpu"), "plan.budget[0].kind: 'gpu' is not one of"),
        (lambda d: d.update(budget=[d["budget"][0]] * 65), "plan.budget: 65 entries (at most 64)"),
        (lambda d: d["reasons"].update(x="a\x1b[2J"), "plan.reasons.x: 'a\\x1b[2J' contains"),
        (lambda d: d["reasons"].update({"a\nb": "c"}), "plan.reasons key: 'a\\nb' contains"),
        (lambda d: d.update(engine=[1, 2]), "plan.engine: expected an object, got a list of 2"),
        (lambda d: d["engine"].update(n_ctx={"a": 1}), "plan.engine.n_ctx: expected an integer"),
        (lambda d: d["engine"].update(n_ctx=2048.0), "plan.engine.n_ctx: expected an integer"),
        (_set("watermarks", shed_pct=True), "plan.watermarks.shed_pct: expected a number"),
    ],
)
def test_each_field_rule_is_a_78_with_the_field_path(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], object], message: str
) -> None:
    err = _bad(tmp_path, mutate)
    assert message in err.message
    assert err.message.startswith(str(tmp_path / "plan.json"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"schema": "slmguard.plan/2", "x": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
        ("[" * 5000 + "]" * 5000, "JSON nested 5000 deep"),
        ('{"a": ' * 3000 + "1" + "}" * 3000, "JSON nested 3000 deep"),
        ('{"schema": "slmguard.plan/2", "x": NaN}', "NaN is not a number JSON allows"),
        ('{"schema": "slmguard.plan/2", "x": 1e999}', "the number 1e999 is not finite"),
        ('{"schema": "slmguard.plan/2", "schema": "x"}', "duplicate key 'schema'"),
        ('"just a string"', "plan: expected a JSON object"),
        ("", "not valid JSON"),
        ('{"schema": "slmguard.plan/2\\ud800"}', "unreadable plan schema"),
    ],
)
def test_json_reader_bounds(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "plan.json"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_plan(p)
    assert message in info.value.message
    assert "\n" not in info.value.message


def test_huge_and_odd_files(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        load_plan(big)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"schema": "\xff"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_plan(latin)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # a plain open() would wait for a writer forever
    with pytest.raises(ConfigError, match="a FIFO"):
        load_plan(fifo)
    with pytest.raises(ConfigError, match="a directory"):
        load_plan(tmp_path)


def test_version_1_plans_are_refused_with_the_way_out(tmp_path: Path) -> None:
    err = _bad(tmp_path, lambda d: d.update(schema="slmguard.plan/1"))
    assert "from an older slmguard" in err.message
    assert err.hint is not None and "re-run `slmguard plan`" in err.hint


def test_same_major_with_a_minor_is_accepted(tmp_path: Path) -> None:
    data = json.loads(dumps_plan(_plan()))
    data["schema"] = "slmguard.plan/2.7"
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    assert load_plan(p) == _plan()


def _fields(tp: Any) -> list[tuple[str, dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(tp)
    out = []
    for f in dataclasses.fields(tp):
        hint = hints[f.name]
        out.append((f"{tp.__name__}.{f.name}", f, hint))
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hint):
            inner.append(hint)
        for sub in inner:
            out.extend(_fields(sub))
    return out


def test_every_field_declares_its_rule_next_to_it() -> None:
    # Booleans need no range; nested plan sections are checked field by field.
    missing = [
        name
        for name, f, hint in _fields(Plan)
        if hint is not bool
        and not dataclasses.is_dataclass(hint)
        and name != "Plan.schema"
        and "rule" not in f.metadata
        and not (typing.get_args(hint) and dataclasses.is_dataclass(typing.get_args(hint)[0]))
    ]
    assert missing == []


def test_check_plan_validates_a_plan_in_memory() -> None:
    check_plan(_plan())
    with pytest.raises(ConfigError, match=r"plan\.engine\.n_threads: 0 is below 1"):
        check_plan(dataclasses.replace(_plan(), engine=EngineSettings(2048, 512, 512, 0)))
