"""slmguard bench: one short run of the real engine as serve starts it, its record, the
table and the comparison, and every input the bench refuses.

The run is the embedded model with a plan of two slots of 256 tokens, 16-token prompts
and 4 generated tokens: seconds, and shared by the module. Nothing here compares
speeds (that is benchmarks/bench_vs_bare.py's); the records of captured board states
(tests/fixtures/boards) show what the table and the comparison say about a board.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from boardtuning import cpu_governor, zone_temp
from hostboards import copy_board, plan_for_rk3588
from serveproc import engine_available
from slmguard.bench import measure, record, report
from slmguard.bench.runner import BenchOptions, Measured, build_record, run
from slmguard.bench.target import BenchTarget, plan_digest, resolve_target
from slmguard.cli import main
from slmguard.errors import ConfigError, EngineError
from slmguard.host.boardstate import read_board_state
from slmguard.plan.planfile import load_plan
from slmguard.plan.schema import EngineSettings
from slmguard.serve.llamaserver import EngineConfig
from slmguard.settings import ServeSettings

# ---------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Any]]:
    if not engine_available():  # pragma: no cover - depends on the machine
        pytest.skip("the llama-server binary is not there (run `make`)")
    base = tmp_path_factory.mktemp("bench")
    plan_file = base / "plan.json"
    with pytest.raises(SystemExit) as done:
        main(["plan", "--ctx", "256", "--slots", "2", "--json", "--out", str(plan_file)])
    assert done.value.code == 0
    target = resolve_target(plan_file, None, base / "state")
    lines: list[str] = []
    yield (
        run(target, BenchOptions(prompt_tokens=16, decode_tokens=4), lines.append),
        (
            target,
            lines,
            plan_file,
        ),
    )


@pytest.mark.engine
def test_a_real_run_records_figures_and_state(real_run: tuple[dict[str, Any], Any]) -> None:
    rec, (target, lines, plan_file) = real_run
    assert json.loads(record.dumps(rec)) == rec  # plain JSON, nothing lost
    assert record.validate(rec, Path("-")) == rec
    assert rec["settings"] == {
        "prompt_tokens": 16,
        "decode_tokens": 4,
        "slots": 2,
        "n_ctx_slot": 256,
        "threads": target.config.n_threads,
    }
    one = rec["figures"]["one_stream"]
    assert one["prompt_tokens"] == 16 and one["decode_tokens"] == 4
    assert one["prefill_tokens_per_s"] > 0 and one["decode_tokens_per_s"] > 0
    assert 0 < one["first_token_s"] <= one["wall_s"]
    slots = rec["figures"]["all_slots"]
    assert slots["streams"] == 2 and len(slots["each"]) == 2
    assert all(s["decode_tokens"] == 4 for s in slots["each"])
    memory = rec["figures"]["memory"]
    assert memory["engine_peak_bytes"] >= memory["engine_rss_bytes"] > 0
    assert memory["planned_engine_bytes"] > 0 and memory["peak_of_plan_pct"] > 0
    # What ran: the plan's model (its sha256 verified), this plan, serve's engine flags.
    plan = load_plan(plan_file)
    ident = rec["identity"]
    assert ident["model"]["sha256"] == plan.model.sha256 and ident["plan"]["sha256"] == plan_digest(
        plan
    )
    assert ident["engine"]["version"] and ident["engine"]["profile"]
    flags = ident["engine"]["flags"]
    assert flags[flags.index("--ctx-size") + 1] == "512"  # two slots of 256
    assert flags[flags.index("--parallel") + 1] == "2" and "--host" not in flags
    # The board's state, before and after, and the load of everyone else.
    for when in ("before", "after"):
        state = rec["state"][when]
        assert state["online"] and "cpufreq" in state and "zones" in state
    load = rec["state"]["load"]
    assert load["cpus"] >= 1 and load["busy_cores"] >= 0 and load["engine_cores"] > 0
    assert load["others_cores"] is not None and load["others_cores"] >= 0
    lacks = rec["state"]["lacks"]
    assert ("thermal zones (temperatures, trip points)" in lacks) == (
        not rec["state"]["before"]["zones"]
    )
    assert any(line.startswith("one stream: 16 prompt tokens") for line in lines)
    assert lines[-1] == "done"
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("slmguard-bench-*/engine.sock"))


@pytest.mark.engine
def test_the_table_of_a_real_run(real_run: tuple[dict[str, Any], Any]) -> None:
    text = report.table(real_run[0])
    assert "one stream: decode" in text and "engine peak memory" in text
    assert "other processes while it ran:" in text
    engine = real_run[0]["state"]["load"]["engine_cores"]
    assert f", the engine {engine:.2f}" in text  # the engine's own share beside the others'


@pytest.mark.engine
def test_without_a_plan_the_target_is_serves_plan_for_this_host(tmp_path: Path) -> None:
    """``slmguard bench`` with no arguments: the host's own plan of the embedded model,
    made and checked as serve makes it (serve.startup.prepare), nothing started."""
    if not engine_available():  # pragma: no cover - depends on the machine
        pytest.skip("the llama-server binary is not there (run `make`)")
    from slmguard.default_model import is_default_model

    target = resolve_target(None, None, tmp_path / "state")
    assert target.plan_source.startswith("planned for this host")
    assert target.model_sha256 is not None and is_default_model(target.model_sha256)
    for f in fields(EngineSettings):  # the engine starts with the checked plan's settings
        assert getattr(target.config, f.name) == getattr(target.plan.engine, f.name), f.name
    assert target.plan_sha256 == plan_digest(target.plan)
    assert target.serve.state_dir == tmp_path / "state"


# ---------------------------------------------------------------- measure (the stream's parsing)


class Scripted:
    """Answers with scripted lines: the tests of the stream's parsing, not of the engine."""

    def __init__(self, lines: list[str], status: int = 200) -> None:
        self.lines, self.status_code = lines, status
        self.bodies: list[Any] = []

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        text = body["content"]
        return 200, {"tokens": list(range(len(text.split())))}

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[Scripted]:
        self.bodies.append(body)
        yield self

    async def aiter_lines(self) -> AsyncIterator[str]:
        for line in self.lines:
            yield line

    async def aread(self) -> bytes:
        return b'{"error": "busy"}'


TIMINGS = {"prompt_n": 3, "prompt_per_second": 30.0, "predicted_n": 2, "predicted_per_second": 9.5}


def test_one_stream_reads_timings_and_the_first_token() -> None:
    import asyncio

    clock = iter([0.0, 0.25, 1.0]).__next__
    lines = [
        ": ping",
        'data: {"content": "", "stop": false}',
        'data: {"content": "Hi", "stop": false}',
        "data: not json",
        f"data: {json.dumps({'content': '', 'stop': True, 'timings': TIMINGS})}",
    ]
    t = Scripted(lines)
    got = asyncio.run(measure.one_stream(t, [1, 2, 3], 2, clock=clock))
    assert (got.first_token_s, got.wall_s, got.decode_tokens) == (0.25, 1.0, 2)
    assert (got.prefill_tokens_per_s, got.decode_tokens_per_s) == (30.0, 9.5)
    assert t.bodies[0] == {
        "prompt": [1, 2, 3],
        "n_predict": 2,
        "ignore_eos": True,
        "cache_prompt": False,
        "temperature": 0,
        "stream": True,
    }


@pytest.mark.parametrize(
    ("lines", "status", "message"),
    [
        (['data: {"content": "x"}'], 200, "ended without its timings"),
        ([], 503, "answered 503"),
    ],
)
def test_a_broken_stream_is_an_engine_error(lines: list[str], status: int, message: str) -> None:
    import asyncio

    with pytest.raises(EngineError, match=message):
        asyncio.run(measure.one_stream(Scripted(lines, status), [1], 1))


def test_a_prompt_of_exactly_n_tokens() -> None:
    import asyncio

    t = Scripted([])
    for n in (1, 7, 100):
        assert len(asyncio.run(measure.make_prompt(t, n, "stream 1"))) == n


# ---------------------------------------------------------------- sizes, records, reports


@pytest.mark.parametrize(
    ("prompt", "decode", "message"),
    [(None, 300, "--decode-tokens 300"), (250, 8, "--prompt-tokens 250"), (None, 0, "--decode")],
)
def test_sizes_that_do_not_fit_a_slot(prompt: int | None, decode: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BenchOptions(prompt_tokens=prompt, decode_tokens=decode).sized(256)
    assert BenchOptions(decode_tokens=8).sized(256) == (244, 8)  # the slot filled


def _board_record(root: Path, decode: float, governor_cpu6: str | None = None) -> dict[str, Any]:
    """A record of a run on a captured board: figures made up, the state read."""
    if governor_cpu6:
        cpu_governor(root, 6, governor_cpu6)
    plan = plan_for_rk3588()
    state = read_board_state(root)
    cfg = EngineConfig.of(plan.engine, model_path="/m.gguf")
    target = BenchTarget(
        plan, "plan.json", plan_digest(plan), Path("/m.gguf"), "ab" * 32, 1, Path("/e"),
        "version: 1", "dotprod", ("asimddp",), cfg, {}, ServeSettings(),
    )  # fmt: skip
    one = measure.StreamFigures(244, 8, 0.5, 1.0, 100.0, decode, 400.0, 800.0)
    slots = measure.SlotsFigures((one, replace(one, decode_tokens_per_s=decode / 2)), 2.0)
    seen = Measured(1.0, 2.0, one, slots, None, None, state, state)
    return build_record(target, BenchOptions(decode_tokens=8), seen)


def test_compare_names_the_state_that_differs(tmp_path: Path) -> None:
    a = _board_record(copy_board("rk3588-rock5b", tmp_path / "a"), 20.0)
    b_root = copy_board("rk3588-rock5b", tmp_path / "b")
    zone_temp(b_root, 1, 84_000)
    b = _board_record(b_root, 10.0, governor_cpu6="powersave")
    text = report.compare(a, b)
    assert "one stream: decode            20.0 tok/s" in text and "0.50" in text
    assert "  - governor cpu6-7: schedutil | powersave" in text
    assert "  - hottest zone before: 45.3 °C bigcore0-thermal | 84.0 °C bigcore0-thermal" in text
    assert "no recorded state differs" in report.compare(a, a)


def test_the_table_shows_the_boards_state(tmp_path: Path) -> None:
    rec = _board_record(copy_board("jetson-orin-nano-devkit", tmp_path / "o"), 12.0)
    text = report.table(rec)
    assert "power mode" in text and "0 15W" in text
    assert "devfreq 17000000.gpu" in text and "nvhost_podgov, 612 MHz" in text
    assert "governor cpu0-3" in text and "governor cpu4-5" in text and "1497.6 MHz" in text
    assert rec["state"]["lacks"] == [
        "cooling devices",
        "firmware throttle flags (not a Raspberry Pi)",
    ]


def test_load_window() -> None:
    a = record.CpuMark(busy_ticks=100, total_ticks=1000, cpus=2, engine_ticks=10, self_ticks=5)
    b = record.CpuMark(busy_ticks=700, total_ticks=2000, cpus=2, engine_ticks=310, self_ticks=55)
    w = record.load_window(a, b)
    assert w is not None and (w.busy_cores, w.engine_cores, w.bench_cores) == (1.2, 0.6, 0.1)
    assert w.others_cores == pytest.approx(0.5)
    assert record.load_window(a, a) is None and record.load_window(None, b) is None


def _write(tmp_path: Path, name: str, data: Any) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(argv)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_cli_compares_two_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "a.json", _board_record(copy_board("rpi5", tmp_path / "p"), 9.0))
    code, out, err = _run(["bench", "--compare", str(a), str(a)], capsys)
    assert code == 0 and "no recorded state differs" in out and err == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not JSON"),
        ({"schema": "other/1"}, "not a bench record (schema slmguard.bench/1 expected)"),
        ({"schema": record.SCHEMA}, "no started_unix_s"),
        ("x" * (record.MAX_RECORD_BYTES + 1), "larger than 4 MiB"),
    ],
)
def test_cli_refuses_what_is_not_a_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, message: str
) -> None:
    bad = _write(tmp_path, "bad.json", content)
    code, _, err = _run(["bench", "--compare", str(bad), str(bad)], capsys)
    assert code == 78 and message in err


def test_cli_refuses_a_record_with_a_wrong_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _board_record(copy_board("rpi5", tmp_path / "p"), 9.0)
    rec["figures"]["one_stream"]["decode_tokens_per_s"] = "fast"
    bad = _write(tmp_path, "bad.json", rec)
    code, _, err = _run(["bench", "--compare", str(bad), str(bad)], capsys)
    assert code == 78 and "figures.one_stream.decode_tokens_per_s is not" in err
    rec["figures"]["one_stream"]["decode_tokens_per_s"] = 1e400  # inf in JSON: Infinity
    bad = _write(tmp_path, "inf.json", json.dumps(rec))
    code, _, err = _run(["bench", "--compare", str(bad), str(bad)], capsys)
    assert code == 78 and "not a finite number" in err


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--compare", "a", "b", "c"], 64, "--compare takes one record"),
        (["--decode-tokens", "0"], 64, "must be at least 1"),
        (["--compare", "/nonexistent.json"], 78, "No such file"),
    ],
)
def test_cli_usage(
    argv: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    got, _, err = _run(["bench", *argv], capsys)
    assert got == code and message in err
