"""Pure parts of the server: the engine's command line, slots, the queue, settings,
restart budget, log handling, /proc parsing, sd_notify and the model probe (no engine)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slmguard import notify, settings
from slmguard.errors import (
    ConfigError,
    EngineUnavailableError,
    ModelError,
    ModelNotFoundError,
    QueueFullError,
)
from slmguard.plan.overrides import EngineOverrides
from slmguard.plan.schema import BoardSpec, EngineSettings, Limits, ModelSpec, Plan
from slmguard.serve.answers import TurnBuilder
from slmguard.serve.engine import (
    LogRate,
    RestartBudget,
    RestartPolicy,
    config_for_cells,
    describe_exit,
    engine_log_level,
)
from slmguard.serve.llamaserver import EngineConfig, engine_argv, find_llama_server, load_mode
from slmguard.serve.modelcheck import probe_model
from slmguard.serve.queue import SlotQueue
from slmguard.serve.slots import parse_slots

# The engine's command line


def cfg(**changes: object) -> EngineConfig:
    base = EngineConfig(model_path="/m/model.gguf", n_ctx=4096, n_batch=512, n_ubatch=256,
                        n_threads=3)  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_engine_argv_carries_the_plan_and_the_fixed_choices() -> None:
    argv = engine_argv(
        Path("/opt/llama-server"),
        cfg(n_parallel=4, kv_unified=True, flash_attn=True, kv_type="q8_0", cache_ram_mib=256,
            use_mlock=True, swa_full=False),
        socket_path=Path("/run/s/engine.sock"), api_key_file=Path("/run/s/key"), alias="m",
        slot_dir=Path("/run/s/slots"),
    )  # fmt: skip
    assert argv[0] == "/opt/llama-server"
    assert flag(argv, "--host") == "/run/s/engine.sock"  # a unix socket, never TCP
    assert flag(argv, "--api-key-file") == "/run/s/key" and "--api-key" not in argv
    assert (flag(argv, "--ctx-size"), flag(argv, "--batch-size"), flag(argv, "--ubatch-size"),
            flag(argv, "--threads"), flag(argv, "--threads-batch")) == (
        "4096", "512", "256", "3", "3")  # fmt: skip
    assert flag(argv, "--parallel") == "4" and "--kv-unified" in argv
    assert flag(argv, "--flash-attn") == "on"
    assert flag(argv, "--cache-type-k") == flag(argv, "--cache-type-v") == "q8_0"
    assert flag(argv, "--cache-ram") == "256" and flag(argv, "--load-mode") == "mmap+mlock"
    for fixed in ("--no-context-shift", "--no-webui", "--metrics", "--slots", "--jinja"):
        assert fixed in argv
    assert "--swa-full" not in argv and flag(argv, "--slot-save-path") == "/run/s/slots"
    plain = engine_argv(Path("/x"), cfg(), socket_path=Path("/s.sock"),
                        api_key_file=Path("/k"), alias="m")  # fmt: skip
    assert "--no-kv-unified" in plain and flag(plain, "--flash-attn") == "off"
    assert flag(plain, "--cache-ram") == "0"  # llama-server's own default grows RSS by GiBs
    assert "--swa-full" in plain and "--slot-save-path" not in plain


def test_load_mode() -> None:
    assert [load_mode(a, b) for a, b in ((True, False), (True, True), (False, False),
                                          (False, True))] == [
        "mmap", "mmap+mlock", "none", "mlock"]  # fmt: skip


def test_slot_context_with_and_without_a_unified_cache() -> None:
    assert cfg(n_parallel=4).n_ctx_slot == 1024
    assert cfg(n_parallel=4, kv_unified=True).n_ctx_slot == 4096


def test_shrinking_drops_slots_before_context() -> None:
    planned = cfg(n_ctx=8192, n_parallel=4)  # 4 slots of 2048
    steps = [config_for_cells(planned, n) for n in (8192, 4096, 2048, 1024, 512)]
    assert [(c.n_parallel, c.n_ctx, c.n_ctx_slot) for c in steps] == [
        (4, 8192, 2048), (2, 4096, 2048), (1, 2048, 2048), (1, 1024, 1024), (1, 512, 512),
    ]  # fmt: skip
    assert config_for_cells(planned, 6000).n_parallel == 2  # whole slots only
    unified = cfg(n_ctx=8192, n_parallel=4, kv_unified=True)
    assert (config_for_cells(unified, 2048).n_parallel, config_for_cells(unified, 2048).n_ctx) == (
        4, 2048)  # fmt: skip


def test_find_llama_server(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailableError) as info:
        find_llama_server(tmp_path / "missing")
    assert info.value.exit_code == 69 and "--llama-server" in (info.value.hint or "")
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(EngineUnavailableError):
        find_llama_server(script)  # not executable
    script.chmod(0o755)
    assert find_llama_server(script) == script


# Engine logs and exits


def test_engine_log_levels_follow_llama_cpp_prefixes() -> None:
    assert engine_log_level("0.00.014.778 E srv  start: couldn't bind") == logging.ERROR
    # The engine's warnings and info lines are chatter in the front's log (INFO, DEBUG).
    assert engine_log_level("0.01.055.040 W load: control-looking token") == logging.INFO
    assert engine_log_level("0.00.001.818 I srv  llama_server: initializing") == logging.DEBUG
    assert engine_log_level("warning: no usable GPU found") == logging.INFO


def test_log_rate_limits_and_counts_what_it_dropped() -> None:
    now = [0.0]
    rate = LogRate(per_s=10, burst=5, clock=lambda: now[0])
    assert sum(rate.allow() for _ in range(20)) == 5 and rate.dropped == 15
    now[0] = 1.0  # a second later: 10 more
    assert sum(rate.allow() for _ in range(20)) == 5  # capped by the burst


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(1) == "exit status 1" and describe_exit(None) == "unknown status"


# Slots and streamed turns


def test_parse_slots_and_cells_used() -> None:
    data = [
        {"id": 0, "n_ctx": 1024, "is_processing": False},
        {"id": 1, "n_ctx": 1024, "is_processing": True, "n_prompt_tokens": 25,
         "next_token": [{"n_decoded": 7}]},
        {"id": 2, "n_ctx": 1024, "is_processing": False, "n_prompt_tokens": 40,
         "next_token": [{"n_decoded": 12}]},
        {"n_ctx": 3}, "junk",
    ]  # fmt: skip
    slots = parse_slots(data)
    assert [s.id for s in slots] == [0, 1, 2]
    # n_prompt_tokens already holds the tokens generated so far (llama-server appends each
    # sampled token to the slot's list): n_decoded is not added again; an idle slot keeps
    # its cache.
    assert [s.kv_cells_used for s in slots] == [0, 25, 40]
    assert parse_slots({"error": 1}) == ()


def test_turn_builder_assembles_content_and_tool_calls() -> None:
    b = TurnBuilder()
    b.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
    b.feed({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function",
         "function": {"name": "get_", "arguments": '{"ci'}}]}}]})  # fmt: skip
    b.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "function": {"name": "weather", "arguments": 'ty": "Paris"}'},
                            }
                        ]
                    },
                }
            ]
        }
    )
    b.feed({"choices": [{"index": 1, "delta": {"content": "other choice"}}]})
    msg = b.message()
    assert msg["content"] is None
    assert msg["tool_calls"] == [{"id": "c1", "type": "function",
                                  "function": {"name": "get_weather",
                                               "arguments": '{"city": "Paris"}'}}]  # fmt: skip
    text = TurnBuilder()
    text.feed({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    text.feed({"choices": [{"index": 0, "delta": {"content": "lo"}}]})
    assert text.message() == {"role": "assistant", "content": "Hello"}


# Settings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return parser.parse_args(argv)


def plan_with(n_ctx: int, n_threads: int) -> Plan:
    return Plan(
        model=ModelSpec("m", "gemma3", 1, 18, 32768),
        board=BoardSpec("b", 4 << 30, (0, 1), (0, 1)),
        engine=EngineSettings(n_ctx=n_ctx, n_batch=256, n_ubatch=128, n_threads=n_threads,
                              kv_type="q8_0", use_mlock=True, flash_attn=True, n_parallel=2,
                              llama_server="/opt/llama/llama-server"),
        limits=Limits(1 << 30, 2 << 30, 1 << 29),
    )  # fmt: skip


def test_admin_token_never_falls_back_to_the_api_key(tmp_path: Path) -> None:
    s = settings.resolve(parse(["--api-key", "k"]), {}, None)
    assert settings.api_key(s) == "k" and settings.admin_token(s) is None
    (tmp_path / "admin").write_text("adm\n")
    s = settings.resolve(parse(["--admin-token-file", str(tmp_path / "admin")]), {}, None)
    assert settings.admin_token(s) == "adm"


def test_settings_precedence_flag_env_plan_default() -> None:
    plan = plan_with(4096, 3)

    def engine(argv: list[str], env: dict[str, str]) -> EngineSettings:
        return settings.engine_settings(plan.engine, settings.resolve(parse(argv), env, plan))

    e = engine(["--n-ctx", "1024"], {"SLMGUARD_N_CTX": "2000"})
    assert e.n_ctx == 1024  # flag wins
    e = engine([], {"SLMGUARD_N_CTX": "2000", "SLMGUARD_USE_MLOCK": "no"})
    assert (e.n_ctx, e.use_mlock) == (2000, False)  # env beats plan
    e = engine([], {})
    assert (e.n_ctx, e.n_threads, e.kv_type, e.n_batch, e.use_mlock, e.n_parallel) == (
        4096, 3, "q8_0", 256, True, 2,
    )  # fmt: skip
    # A plan's engine binary is not a setting: build_server only checks it (it must be the
    # engine slmguard selects, else --llama-server must name it; test_serve_hostile.py).
    s = settings.resolve(parse([]), {}, plan)
    assert e.flash_attn is True and s.llama_server is None
    # Nothing given: no engine setting over the plan's, the defaults of the rest.
    s = settings.resolve(parse([]), {}, None)
    assert (s.overrides(), s.host, s.port) == (EngineOverrides(), "127.0.0.1", 8080)
    assert settings.resolve(parse(["--no-use-mmap"]), {}, None).overrides().fields == {
        "use_mmap": False
    }


def test_ctx_is_per_slot_as_in_plan_and_n_ctx_the_deprecated_total() -> None:
    plan = plan_with(4096, 3)  # 2 slots

    def engine(argv: list[str], env: dict[str, str], base: EngineSettings) -> EngineSettings:
        return settings.engine_settings(base, settings.resolve(parse(argv), env, plan))

    e = engine(["--ctx", "1000"], {}, plan.engine)
    assert (e.n_ctx, e.n_parallel) == (2000, 2)  # the engine's -c: per slot x slots
    assert engine(["--ctx", "1000", "--n-parallel", "3"], {}, settings.UNPLANNED).n_ctx == 3000
    assert engine([], {"SLMGUARD_CTX": "700"}, plan.engine).n_ctx == 1400
    with pytest.raises(ConfigError, match="not both"):
        settings.resolve(parse(["--ctx", "512"]), {"SLMGUARD_N_CTX": "512"}, None)
    assert settings.deprecations(parse(["--ctx", "512"]), {}) == []
    (notice,) = settings.deprecations(parse(["--n-ctx", "4096"]), {})
    assert "deprecated" in notice and "4096" in notice and "--ctx" in notice


def test_what_serve_asks_the_host_planner_for() -> None:
    from slmguard.serve.startup import host_choices

    def asked(argv: list[str]) -> tuple[Any, ...]:
        return host_choices(settings.resolve(parse(argv), {}, None))

    model, ctx, choices = asked([])
    assert (model, ctx, choices.engine) == (None, None, {})
    model, ctx, choices = asked(
        ["--model", "m.gguf", "--ctx", "1024", "--n-parallel", "3", "--flash-attn",
         "--kv-unified", "--cache-ram-mib", "64", "--n-batch", "128", "--kv-type", "q8_0"]
    )  # fmt: skip
    assert (model, ctx) == (Path("m.gguf"), 1024)
    # What the planner chooses is asked of it; the rest goes over its plan, re-budgeted.
    assert choices.engine == {
        "n_parallel": 3, "flash_attn": True, "kv_unified": True, "cache_ram_mib": 64,
    }  # fmt: skip
    # The deprecated total keeps its meaning: over --n-parallel slots, 1 unless given.
    assert asked(["--n-ctx", "4096"])[1:2] == (4096,)
    assert asked(["--n-ctx", "4096"])[2].engine == {"n_parallel": 1}
    assert asked(["--n-ctx", "4096", "--n-parallel", "4"])[1] == 1024
    # Out of range: refused before the host is planned, with the flag.
    with pytest.raises(ConfigError, match="--ctx must be > 0"):
        asked(["--ctx", "0", "--n-parallel", "999"])


def test_default_max_tokens_is_a_quarter_slot_at_most_512() -> None:
    s = settings.resolve(parse([]), {}, None)
    assert [settings.default_max_tokens(s, n) for n in (2, 256, 2048, 32768)] == [1, 64, 512, 512]
    s = settings.resolve(parse(["--default-max-tokens", "100"]), {}, None)
    assert settings.default_max_tokens(s, 32768) == 100
    with pytest.raises(ConfigError, match="--default-max-tokens must be > 0"):
        settings.resolve(parse(["--default-max-tokens", "0"]), {}, None)


def test_every_setting_has_a_flag_an_env_name_and_help() -> None:
    from slmguard import options

    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    text = parser.format_help()
    for spec in options.specs(settings.ServeSettings, settings.ENV_PREFIX):
        assert spec.flag in text and spec.env in text and spec.help, spec.name
    # The engine's flags are EngineSettings' own declarations, each of those serve takes.
    engine = [s.name for s in options.specs(settings.ServeSettings, "X_") if s.path[0] == "engine"]
    assert engine[0] == "ctx" and set(engine[1:]) < {
        f.name for f in dataclasses.fields(EngineSettings)
    }


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--queue-size", "0"], {}, "--queue-size"),
        (["--max-tokens-cap", "0"], {}, "--max-tokens-cap"),
        ([], {"SLMGUARD_PORT": "http"}, "SLMGUARD_PORT"),
        ([], {"SLMGUARD_USE_MLOCK": "maybe"}, "SLMGUARD_USE_MLOCK"),
        (["--engine-oom-score-adj", "2000"], {}, "oom_score_adj"),
        (["--kv-type", "q4_0"], {}, "needs --flash-attn"),
        (["--n-ctx", "4", "--n-parallel", "8"], {}, "no context for 8 slots"),
        (["--restart-backoff-initial-s", "5", "--restart-backoff-max-s", "1"], {}, "backoff"),
    ],
)
def test_invalid_settings(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings.resolve(parse(argv), env, None)
    assert needle in str(info.value)


def test_api_key_sources(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert settings.api_key(settings.resolve(parse(["--api-key-file", str(key_file)]), {})) == (
        "from-file"
    )
    s = settings.resolve(parse([]), {"SLMGUARD_API_KEY": "from-env"})
    assert settings.api_key(s) == "from-env"
    assert s.redacted()["api_key"] == "***"
    assert settings.api_key(settings.resolve(parse([]), {})) is None


def test_default_threads_follow_the_affinity_mask() -> None:
    import os

    assert settings.default_threads() == len(os.sched_getaffinity(0))


# Restart budget


def test_backoff_doubles_up_to_the_maximum() -> None:
    p = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [p.delay_s(i) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_failed_engine_cannot_be_parked_into_looking_healthy(tmp_path: Path) -> None:
    """A failed engine must make the front exit non-zero; parking must not mask it."""
    from slmguard.serve.engine import EngineProcess

    async def main() -> None:
        engine = EngineProcess(Path("/nonexistent/llama-server"), cfg(), RestartPolicy(),
                               alias="m", runtime_dir=tmp_path / "run")  # fmt: skip
        engine.state = "failed"
        await engine.park("late governor tick")
        assert engine.state == "failed" and not engine.parked
        await engine.resume(cfg(n_ctx=512))
        assert engine.state == "failed"

    asyncio.run(main())


def test_restart_budget_is_a_sliding_window() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=60))
    assert budget.allow(0.0) and budget.allow(10.0)
    assert not budget.allow(20.0)  # a third within 60 s
    assert budget.allow(70.5)  # the first fell out of the window


# Queue


def test_queue_is_fifo_and_bounded() -> None:
    async def main() -> list[str]:
        q = SlotQueue(slots=1, capacity=2)
        order: list[str] = []
        held = await q.acquire()  # the running request

        async def waiter(name: str) -> None:
            taken = await q.acquire()
            order.append(name)
            q.release(taken)

        tasks = [asyncio.create_task(waiter(n)) for n in ("first", "second")]
        await asyncio.sleep(0)
        assert q.waiting == 2
        with pytest.raises(QueueFullError):
            await q.acquire()
        q.release(held)
        await asyncio.gather(*tasks)
        assert q.waiting == 0 and not q.busy
        return order

    assert asyncio.run(main()) == ["first", "second"]


def test_slots_run_together_and_follow_the_engine() -> None:
    async def main() -> None:
        q = SlotQueue(slots=3, capacity=4)
        a, b = await q.acquire(), await q.acquire(2)  # n=2 takes two slots
        assert q.busy == 3
        c = asyncio.create_task(q.acquire())
        await asyncio.sleep(0)
        assert q.waiting == 1 and not c.done()
        q.resize(1)  # the governor dropped slots: in-flight keep theirs
        q.release(a)
        await asyncio.sleep(0)
        assert not c.done()  # 2 still held, 1 slot now
        q.release(b)
        await asyncio.sleep(0)
        assert c.done() and q.busy == 1
        q.release(c.result())
        # A request for more slots than there are takes all of them.
        assert await q.acquire(5) == 1
        q.release(1)
        # A cancelled waiter gives its place back.
        held = await q.acquire()
        w = asyncio.create_task(q.acquire())
        await asyncio.sleep(0)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert q.waiting == 0
        q.release(held)
        assert q.busy == 0

    asyncio.run(main())


def test_a_limit_admits_fewer_at_once_never_none() -> None:
    """The governor's heat rule: fewer generations at once; running ones keep theirs."""

    async def main() -> None:
        q = SlotQueue(slots=4, capacity=8)
        held = [await q.acquire() for _ in range(3)]
        q.limit(1)
        assert q.allowed == 1 and q.slots == 4
        w = asyncio.create_task(q.acquire())
        await asyncio.sleep(0)
        assert not w.done()  # three held, one allowed: it waits
        for taken in held[:2]:
            q.release(taken)
        await asyncio.sleep(0)
        assert not w.done()
        q.release(held[2])
        await asyncio.sleep(0)
        assert w.done() and q.busy == 1
        assert await asyncio.wait_for(_blocked(q), 0.1) is True
        q.limit(0)  # never below one
        assert q.allowed == 1
        q.release(w.result())
        q.limit(2)
        assert await q.acquire(3) == 2  # n=3 takes what is allowed now
        q.release(2)
        q.limit(None)
        assert q.allowed == 4

    async def _blocked(q: SlotQueue) -> bool:
        t = asyncio.create_task(q.acquire())
        await asyncio.sleep(0)
        blocked = not t.done()
        t.cancel()
        return blocked

    asyncio.run(main())


# sd_notify


def test_notify_sends_datagrams_to_a_real_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(path)
        assert notify.notify("READY=1\nSTATUS=up", env={"NOTIFY_SOCKET": path})
        assert sink.recv(100) == b"READY=1\nSTATUS=up"
    assert not notify.notify("READY=1", env={})
    assert not notify.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "none")})


def test_notify_abstract_socket() -> None:
    name = f"slmguard-test-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind("\0" + name)
        assert notify.notify("WATCHDOG=1", env={"NOTIFY_SOCKET": "@" + name})
        assert sink.recv(100) == b"WATCHDOG=1"


def test_watchdog_interval() -> None:
    import os

    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "20000000"}) == 10.0
    pid = str(os.getpid())
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": pid}) == 1.0
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None
    assert notify.watchdog_interval_s({}) is None


# Model probe (forked header check)


def test_probe_model_errors_cross_the_fork(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        probe_model(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_text("nope")
    with pytest.raises(ModelError) as info:
        probe_model(tmp_path / "bad.gguf")
    assert info.value.path == tmp_path / "bad.gguf"
    assert not isinstance(info.value, ModelNotFoundError)


def test_probe_model_reads_the_default_model() -> None:
    from serveproc import default_model_path

    model = default_model_path()
    if not model.exists():
        pytest.skip("default model not prepared (run `slmguard model prepare`)")
    probe = probe_model(model)
    assert probe == probe_model(model, fork=False)
    assert probe.arch == "gemma3" and probe.chat_template is None and probe.pooling_type is None
    assert probe.n_layer == 18 and probe.n_vocab == 262144


def test_engine_settings_are_the_plans_with_serves_values_over_them() -> None:
    plan = plan_with(4096, 3)
    s = settings.resolve(parse(["--n-ctx", "1024", "--n-batch", "128"]), {}, plan)
    assert s.overrides() == EngineOverrides(fields={"n_ctx": 1024, "n_batch": 128})
    e = settings.engine_settings(plan.engine, s)
    assert e == dataclasses.replace(plan.engine, n_ctx=1024, n_batch=128)  # flags win
    assert (e.n_ubatch, e.kv_type, e.flash_attn, e.n_parallel, e.n_threads) == (
        128, "q8_0", True, 2, 3)  # the plan's  # fmt: skip
    assert e.llama_server == "/opt/llama/llama-server"  # a field serve does not override
    assert e.n_ctx_slot == 512  # 1024 cells, 2 slots
    config = EngineConfig.of(e, model_path="/m.gguf")
    assert isinstance(config, EngineSettings) and config.model_path == "/m.gguf"
    assert {f: getattr(config, f) for f in e.__dataclass_fields__} == e.__dict__
