"""One bench run: the board's state, the engine started as serve starts it, the measures.

Owns :func:`run_bench`: read the board's state (:func:`slmguard.host.boardstate
.read_board_state`), start the engine with :class:`slmguard.serve.engine.EngineProcess`
(the supervisor serve uses: :func:`~slmguard.serve.llamaserver.engine_argv`'s command
line, a private unix socket and key, serve's ``oom_score_adj`` and environment) and wait
until it serves, warm it up with one short generation (not recorded), measure one stream
and then every slot at once at the planned context (:mod:`slmguard.bench.measure`), read
the engine's peak RSS (VmHWM) against the plan's budget for it, mark the CPU use of
everyone else while it measured, read the state again, stop the engine and remove its
directory. An engine that restarts during the run fails the run (its figures would mix two
engines). Progress lines go to ``progress``; the record is :mod:`slmguard.bench.record`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.bench import measure, record
from slmguard.bench.target import BenchTarget
from slmguard.errors import ConfigError, EngineError
from slmguard.host.boardstate import BoardState, read_board_state
from slmguard.host.files import ROOT
from slmguard.host.process import ProcessStatus, read_status
from slmguard.plan.planfile import plan_to_dict
from slmguard.serve.engine import EngineProcess, RestartPolicy
from slmguard.serve.llamaserver import engine_argv

Progress = Callable[[str], None]

#: Tokens generated per stream unless told (enough for a steady decode rate).
DEFAULT_DECODE_TOKENS = 128
#: Room left in a slot beyond the prompt and the decode (llama.cpp's own bookkeeping).
SLACK_TOKENS = 4


@dataclass(frozen=True)
class BenchOptions:
    """``prompt_tokens`` None: fill the planned slot (the planned context)."""

    prompt_tokens: int | None = None
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    root: Path = ROOT

    def sized(self, n_ctx_slot: int) -> tuple[int, int]:
        """(prompt, decode) tokens for a slot of ``n_ctx_slot`` cells; ConfigError when
        they do not fit one."""
        decode = self.decode_tokens
        room = n_ctx_slot - SLACK_TOKENS
        if decode < 1 or decode >= room:
            raise ConfigError(
                f"--decode-tokens {decode}: a slot of the plan holds {n_ctx_slot} tokens",
                hint=f"give 1 to {max(1, room - 2)}",
            )
        prompt = self.prompt_tokens if self.prompt_tokens is not None else room - decode
        if prompt < 1 or prompt + decode > room:
            raise ConfigError(
                f"--prompt-tokens {prompt} with --decode-tokens {decode}: a slot of the plan "
                f"holds {n_ctx_slot} tokens",
                hint=f"give --prompt-tokens {room - decode} or less",
            )
        return prompt, decode


def _flags(argv: list[str]) -> list[str]:
    """The engine's command line without the run's own paths (socket, key, slots dir)."""
    out: list[str] = []
    skip = {"--host", "--api-key-file", "--slot-save-path"}
    it = iter(argv[1:])
    for arg in it:
        if arg in skip:
            next(it, None)
            continue
        out.append(arg)
    return out


async def _start(target: BenchTarget, runtime: Path, progress: Progress) -> EngineProcess:
    s = target.serve
    engine = EngineProcess(
        target.binary, target.config, RestartPolicy(max_restarts=1, window_s=1.0),
        alias="bench", runtime_dir=runtime, version=target.version,
        oom_score_adj=s.engine_oom_score_adj, load_timeout_s=s.engine_load_timeout_s,
        env=target.env,
    )  # fmt: skip
    progress(f"starting {target.binary.name} ({target.version}) with the plan's settings")
    await engine.start()
    if not await engine.wait_ready(engine.load_bound_s()):
        if engine.load_error is not None:
            raise engine.load_error
        raise EngineError(f"the engine did not become ready ({engine.state})")
    return engine


async def _measure(
    engine: EngineProcess, target: BenchTarget, opts: BenchOptions, progress: Progress
) -> tuple[measure.StreamFigures, measure.SlotsFigures | None]:
    t = engine.client
    cfg = target.config
    prompt_n, decode_n = opts.sized(cfg.n_ctx_slot)
    progress("warming up (one short generation, not recorded)")
    warm = await measure.make_prompt(t, min(8, prompt_n), "warm-up")
    await measure.one_stream(t, warm, min(2, decode_n))
    progress(f"one stream: {prompt_n} prompt tokens, {decode_n} generated")
    prompt = await measure.make_prompt(t, prompt_n, "stream 0")
    step = max(1, decode_n // 4)

    def ticker(n: int) -> None:
        if n % step == 0:
            progress(f"  {n}/{decode_n} tokens")

    one = await measure.one_stream(t, prompt, decode_n, on_token=ticker)
    if cfg.n_parallel < 2:
        return one, None
    progress(f"all {cfg.n_parallel} slots at once: {prompt_n} + {decode_n} tokens each")
    prompts = [
        await measure.make_prompt(t, prompt_n, f"stream {i + 1}") for i in range(cfg.n_parallel)
    ]
    slots = await measure.all_slots(t, prompts, decode_n)
    return one, slots


@dataclass(frozen=True)
class Measured:
    """What one run saw, before it becomes a record."""

    started_unix_s: float
    load_s: float
    one: measure.StreamFigures
    slots: measure.SlotsFigures | None
    engine_status: ProcessStatus | None
    window: record.LoadWindow | None
    before: BoardState
    after: BoardState


async def run_bench(target: BenchTarget, opts: BenchOptions, progress: Progress) -> dict[str, Any]:
    """Run the bench on ``target`` and return its record (see the module docstring)."""
    root = opts.root
    opts.sized(target.config.n_ctx_slot)  # refuse sizes that cannot fit before starting
    progress("reading the board's state")
    before = read_board_state(root)
    started = time.time()
    runtime = Path(tempfile.mkdtemp(prefix="slmguard-bench-"))
    engine: EngineProcess | None = None
    try:
        t0 = time.monotonic()
        engine = await _start(target, runtime, progress)
        load_s = time.monotonic() - t0
        mark = record.cpu_mark(root, engine.pid)
        one, slots = await _measure(engine, target, opts, progress)
        window = record.load_window(mark, record.cpu_mark(root, engine.pid))
        status = read_status(root, engine.pid) if engine.pid is not None else None
        if engine.starts != 1:
            raise EngineError("the engine restarted during the bench: its figures would mix runs")
    finally:
        if engine is not None:
            with contextlib.suppress(EngineError, OSError):
                await engine.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    after = read_board_state(root)
    progress("done")
    seen = Measured(started, load_s, one, slots, status, window, before, after)
    return build_record(target, opts, seen)


def _identity(target: BenchTarget) -> dict[str, Any]:
    argv = engine_argv(
        target.binary, target.config, socket_path=Path("-"), api_key_file=Path("-"), alias="bench"
    )
    return {
        "model": {
            "path": str(target.model_path),
            "sha256": target.model_sha256,
            "file_bytes": target.model_file_bytes,
        },
        "plan": {
            "source": target.plan_source,
            "sha256": target.plan_sha256,
            "board": target.plan.board.name,
        },
        "engine": {
            "binary": str(target.binary),
            "version": target.version,
            "profile": target.profile,
            "cpu_features": list(target.cpu_features),
            "flags": _flags(argv),
        },
    }


def build_record(target: BenchTarget, opts: BenchOptions, seen: Measured) -> dict[str, Any]:
    """The record of a run (schema :data:`slmguard.bench.record.SCHEMA`)."""
    cfg = target.config
    prompt_n, decode_n = opts.sized(cfg.n_ctx_slot)
    planned = record.planned_engine_bytes(plan_to_dict(target.plan)["budget"])
    status = seen.engine_status
    peak = status.hwm_bytes if status is not None else None
    window = seen.window
    return {
        "schema": record.SCHEMA,
        "started_unix_s": round(seen.started_unix_s, 3),
        "finished_unix_s": round(time.time(), 3),
        "settings": {
            "prompt_tokens": prompt_n,
            "decode_tokens": decode_n,
            "slots": cfg.n_parallel,
            "n_ctx_slot": cfg.n_ctx_slot,
            "threads": cfg.n_threads,
        },
        "identity": _identity(target),
        "figures": {
            "load_s": round(seen.load_s, 3),
            "one_stream": _rounded(dataclasses.asdict(seen.one)),
            "all_slots": _slots(seen.slots),
            "memory": {
                "engine_peak_bytes": peak,
                "engine_rss_bytes": status.rss_bytes if status is not None else None,
                "planned_engine_bytes": planned,
                "peak_of_plan_pct": (
                    None if not peak or not planned else round(100 * peak / planned, 1)
                ),
            },
        },
        "state": {
            "before": seen.before.as_dict(),
            "after": seen.after.as_dict(),
            "load": {
                "loadavg_before": _plain(seen.before.loadavg),
                "loadavg_after": _plain(seen.after.loadavg),
                **(_rounded(dataclasses.asdict(window)) if window is not None else {"cpus": None}),
            },
            "lacks": record.missing_state(seen.before),
        },
    }


def _plain(value: tuple[float, ...] | None) -> list[float] | None:
    return None if value is None else list(value)


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def _slots(slots: measure.SlotsFigures | None) -> dict[str, Any]:
    if slots is None:
        return {"streams": 1, "note": "one slot: the same as one stream"}
    return _rounded(
        {
            "streams": len(slots.streams),
            "wall_s": slots.wall_s,
            "tokens_per_s": slots.tokens_per_s,
            "decode_tokens_per_s_mean": slots.decode_tokens_per_s_mean,
            "prefill_tokens_per_s_mean": slots.prefill_tokens_per_s_mean,
            "first_token_s_max": slots.first_token_s_max,
            "each": [_rounded(dataclasses.asdict(s)) for s in slots.streams],
        }
    )


def run(target: BenchTarget, opts: BenchOptions, progress: Progress) -> dict[str, Any]:
    """:func:`run_bench` in its own event loop (the CLI's entry)."""
    return asyncio.run(run_bench(target, opts, progress))
