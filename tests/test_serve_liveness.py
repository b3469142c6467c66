"""A wedged engine is found, reported and replaced (real engine, real model).

``kill -STOP`` stands in for a deadlocked decode or a stuck NPU driver: the
engine's HTTP threads stop with it, but so they do on a real board only when
the whole process hangs, so the front judges liveness by progress of the
decode loop, never by a ping. A CPU-throttled engine (a real ``cpu`` cgroup
quota of 10% of one core) working through a long prompt is slow, not stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from serveproc import MODEL_ID, REQUEST_TIMEOUT_S, ServeFactory, ServerProcess, scaled
from slmguard.errors import (
    EngineStalledError,
    EngineUnreachableError,
    GenerationStalledError,
    RequestError,
    envelope,
)
from slmguard.serve.blame import CrashMemory
from slmguard.serve.flights import Flight, Flights
from slmguard.serve.liveness import (
    PROBE_MARGIN,
    SLOTS_WHILE_STREAMING_S,
    SMALL_BATCH,
    Liveness,
    LivenessSettings,
    all_streaming,
    full_probe_bound_s,
    probe_request,
    stall_after_s,
)
from slmguard.serve.queue import SlotQueue
from slmguard.serve.slots import SlotState

STALL = ("--stall-timeout-s", "4", "--restart-backoff-initial-s", "0.2")
LONG = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}


# ------------------------------------------------------------------ pure


def test_the_stall_time_is_derived_from_the_fronts_own_step_probe() -> None:
    cfg = LivenessSettings(floor_s=15.0, factor=8.0)
    assert stall_after_s(cfg, None) == 15.0  # nothing measured yet: the floor
    # A 512-token batch that took 5.12 s here: 8 of them is the stall time.
    assert stall_after_s(cfg, 5.12) == pytest.approx(40.96)
    assert stall_after_s(cfg, 0.4) == 15.0  # a fast board keeps the floor
    assert stall_after_s(LivenessSettings(factor=8.0, floor_s=1.0), 0.5) == 4.0
    assert stall_after_s(LivenessSettings(fixed_s=3.0), 100.0) == 3.0


class _Flights:
    def __init__(self, n: int, last_progress_s: float | None) -> None:
        self.n, self.last = n, last_progress_s

    def __len__(self) -> int:
        return self.n

    def last_progress_s(self) -> float | None:
        return self.last


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_request_waiting_for_the_fronts_own_probe_keeps_the_watchdog_fed() -> None:
    # The step probe after a start may take longer than the floor
    # on a slow board; a request that came meanwhile made no progress of its own, and
    # systemd's 30 s WatchdogSec killed the whole front (the systest's Ansible gate).
    clock = _Clock()
    engine = SimpleNamespace(state="ready", pid=7)
    flights = _Flights(1, None)
    live = Liveness(
        engine, flights, None, None, None, LivenessSettings(floor_s=15.0, factor=8.0),  # type: ignore[arg-type]
        state_dir=None, clock=clock,
    )  # fmt: skip
    clock.now += 40.0  # no progress for 40 s, past the 15 s floor
    assert live.watchdog_ok() is False  # the liveness loop is free and should act
    live._probing = True
    assert live.watchdog_ok() is True  # the probe holds the engine, bounded by its timeout
    engine.state = "failed"
    assert live.watchdog_ok() is False  # failed for good: never fed


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, n: int = 1) -> None:
        self.n += n

    def labels(self, *_: str) -> _Count:
        return self


class _Engine:
    """An engine whose prompt batches cost ``per_token_s`` each token on the fake clock;
    a request that needs longer than its timeout advances the clock by the timeout and
    fails as the real client does. ``wedged_over`` tokens or more never answer."""

    def __init__(self, clock: _Clock, per_token_s: float, *, n_batch: int = 512) -> None:
        self.clock = clock
        self.per_token_s = per_token_s
        self.wedged_over: int | None = None
        self.state = "ready"
        self.pid = 2**22 + 17  # no such process: the stall evidence reads nothing
        self.version = "test"
        self.tail: list[str] = []
        self.config = SimpleNamespace(n_batch=n_batch, n_ctx_slot=2048, pooling_type=None)
        self.client = self
        self.sent: list[tuple[int, float]] = []  # (prompt tokens, timeout) of each probe
        self.stalls = 0
        self.on_request: Any = None

    async def request(
        self, method: str, path: str, body: Any = None, *, timeout_s: float = 0.0
    ) -> tuple[int, bytes, str]:
        tokens = body["prompt"].count(" a")
        self.sent.append((tokens, timeout_s))
        if self.on_request is not None:
            self.on_request()
        wedged = self.wedged_over is not None and tokens >= self.wedged_over
        cost = float("inf") if wedged else tokens * self.per_token_s + 0.05
        await asyncio.sleep(0)
        if cost > timeout_s:
            self.clock.now += timeout_s
            raise EngineUnreachableError(f"no answer in {timeout_s} s")
        self.clock.now += cost
        return 200, b"{}", "application/json"

    def kill_stalled(self) -> None:
        self.stalls += 1
        self.state = "stalled"


class _NoSlots:
    """An engine's ``/slots`` never asked (the probes' tests)."""

    def current(self) -> tuple[SlotState, ...]:
        return ()


def _liveness(engine: _Engine, clock: _Clock, flights: Any = None, **cfg: Any) -> Liveness:
    metrics = SimpleNamespace(engine_stalls=_Count(), request_stalls=_Count(),
                              cancelled=_Count())  # fmt: skip
    return Liveness(
        engine, flights if flights is not None else Flights(clock), SlotQueue(1, 4),  # type: ignore[arg-type]
        _NoSlots(), metrics, LivenessSettings(**cfg), state_dir=None, clock=clock,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_probes_are_what_the_engine_serves_generations_embeddings_or_reranks() -> None:
    """An engine started with --reranking or --embeddings answers a generation 500: its
    probes are a rerank or an embedding of about as many tokens, within one batch."""
    path, body = probe_request(None, 8)
    assert path == "/completion" and body["prompt"] == " a" * 8 and body["n_predict"] == 1
    assert probe_request(None, 1)[1]["prompt"] == "a"  # the idle canary
    path, body = probe_request(4, 512)
    assert path == "/v1/rerank" and body["query"] == "a"
    assert [d.count(" a") for d in body["documents"]] == [507]  # + query and specials < 512
    assert probe_request(4, 1)[1]["documents"] == [" a"]
    path, body = probe_request(1, 256)
    assert path == "/v1/embeddings" and body["input"].count(" a") == 251


def test_the_step_probe_measures_a_board_slower_than_factor_x_floor() -> None:
    # Under qemu's software emulation one 510-token batch took more than 8 x 15 = 120 s,
    # and the probe's fixed bound declared a stall after every start. 0.4 s a token:
    # 204.8 s for the 512-token batch.
    clock = _Clock()
    engine = _Engine(clock, per_token_s=0.4)
    live = _liveness(engine, clock, floor_s=15.0, factor=8.0)
    asyncio.run(live.check())
    assert engine.stalls == 0 and live.last_stall is None
    assert live.step_s == pytest.approx(512 * 0.4 + 0.05)
    assert live.stall_after_s() == pytest.approx(8 * (512 * 0.4 + 0.05))
    (small, small_bound), (full, full_bound) = engine.sent
    assert small == SMALL_BATCH and small_bound == 15.0  # the small batch: the floor
    # The full one: PROBE_MARGIN x the small one's time scaled to 512 tokens.
    assert full == 512
    assert full_bound == pytest.approx(
        PROBE_MARGIN * (SMALL_BATCH * 0.4 + 0.05) * 512 / SMALL_BATCH
    )
    asyncio.run(live.check())
    assert len(engine.sent) == 2  # once per engine start


def test_a_fast_boards_probes_are_bounded_by_the_floor() -> None:
    # A stopped engine is found within the stall time on a fresh server too: the probes
    # were bounded by factor x floor (120 s) and a request waiting behind them got its
    # 503 after 119.9 s (issue 37).
    clock = _Clock()
    engine = _Engine(clock, per_token_s=0.001)
    live = _liveness(engine, clock, floor_s=15.0, factor=8.0)
    asyncio.run(live.check())
    assert [bound for _, bound in engine.sent] == [15.0, 15.0]
    assert live.stall_after_s() == 15.0


@pytest.mark.parametrize("per_token_s", [0.001, 0.4])
def test_an_engine_wedged_in_the_full_batch_is_a_stall_within_the_probes_bound(
    per_token_s: float,
) -> None:
    clock = _Clock()
    engine = _Engine(clock, per_token_s=per_token_s)
    engine.wedged_over = 512
    live = _liveness(engine, clock, floor_s=15.0, factor=8.0)
    started = clock.now
    asyncio.run(live.check())
    assert engine.stalls == 1 and live.last_stall is not None
    assert "step probe (512 tokens)" in live.last_stall["why"]
    bound = full_probe_bound_s(live.settings, SMALL_BATCH * per_token_s + 0.05, SMALL_BATCH, 512)
    assert clock.now - started == pytest.approx(SMALL_BATCH * per_token_s + 0.05 + bound)


def test_an_engine_wedged_in_the_small_batch_is_a_stall_after_the_floor() -> None:
    clock = _Clock()
    engine = _Engine(clock, per_token_s=0.4)
    engine.wedged_over = 1
    live = _liveness(engine, clock, floor_s=15.0, factor=8.0)
    asyncio.run(live.check())
    assert engine.stalls == 1 and engine.sent == [(SMALL_BATCH, 15.0)]


def test_a_probe_a_request_came_before_runs_at_the_next_idle_moment() -> None:
    clock = _Clock()
    engine = _Engine(clock, per_token_s=0.01)
    flights = Flights(clock)
    live = _liveness(engine, clock, flights, floor_s=1.0, factor=8.0)
    came: list[Any] = []

    def a_request_comes() -> None:  # during the small batch: the full one finds it
        if not came:
            came.append(flights.open("completions", stream=False, slots=1))

    engine.on_request = a_request_comes
    asyncio.run(live.check())
    assert live.step_s is None  # not measured: a request held the engine
    flights.close(came[0])
    asyncio.run(live.check())
    assert live.step_s == pytest.approx(512 * 0.01 + 0.05)


def test_a_stall_the_fronts_own_probe_finds_remembers_no_request() -> None:
    # A request that came while the probe held the engine waited behind the probe: the
    # stall is not its doing.
    clock = _Clock()
    engine = _Engine(clock, per_token_s=0.001)
    engine.wedged_over = 512
    flights = Flights(clock)
    crashes = CrashMemory()
    live = Liveness(
        engine, flights, SlotQueue(2, 4), _NoSlots(), _liveness(engine, clock).metrics,  # type: ignore[arg-type]
        LivenessSettings(floor_s=15.0, factor=8.0), state_dir=None, crashes=crashes,
        clock=clock,
    )  # fmt: skip
    body = {"prompt": "came during the probe", "max_tokens": 4}

    def a_request_comes() -> None:  # during the full batch, the one that wedges
        if engine.sent[-1][0] == 512 and not len(flights):
            flights.open("completions", stream=False, slots=1).body = body

    engine.on_request = a_request_comes
    asyncio.run(live.check())
    assert engine.stalls == 1 and len(crashes) == 0
    crashes.check(body)


class _Slots:
    """The engine's ``/slots`` as the liveness check polls it: ``answers`` False while the
    decode loop is wedged (no answer within the timeout: the fake clock advances by it)."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.answers = True
        self.slots: tuple[SlotState, ...] = ()

    async def refresh(self, timeout_s: float) -> bool:
        await asyncio.sleep(0)
        if not self.answers:
            self.clock.now += timeout_s
        return self.answers

    def current(self) -> tuple[SlotState, ...]:
        return self.slots


@pytest.mark.parametrize("bounded", [True, False], ids=["grammar-bound", "foreign-build"])
def test_a_stall_blames_no_bystander_and_with_the_bound_no_request(bounded: bool) -> None:
    # With grammars bounded in the engine (slmguard's builds) a stall is the engine's:
    # nothing in flight is blamed. On a build without the bound an ambiguous grammar
    # wedges the decode loop: the request with the grammar is refused when sent again,
    # the plain one beside it never (issue 37: a "Hi" sent beside the attack was refused
    # for the rest of the process's life).
    clock = _Clock()
    engine = _Engine(clock, per_token_s=0.001)
    flights = Flights(clock)
    crashes = CrashMemory()
    crashes.grammar_bound = bounded
    slots = _Slots(clock)
    live = Liveness(
        engine, flights, SlotQueue(2, 4), slots, _liveness(engine, clock).metrics,  # type: ignore[arg-type]
        LivenessSettings(floor_s=15.0, factor=8.0, canary_interval_s=0), state_dir=None,
        crashes=crashes, clock=clock,
    )  # fmt: skip
    wedging = {"prompt": "x", "grammar": 'root ::= ("a" | "a" | [a-z])*', "max_tokens": 9}
    hi = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9}
    flight = flights.open("completions", stream=True, slots=1)
    flight.body, flight.client, flight.grammar = wedging, "10.0.0.1", "grammar"
    beside = flights.open("chat", stream=False, slots=1)
    beside.body, beside.client = hi, "10.0.0.2"
    flights.open("/tokenize", stream=False, slots=0)  # a call before a generation: no body
    crashes.check(wedging)  # not refused while it runs
    slots.answers = False
    for _ in range(30):
        if engine.stalls:
            break
        asyncio.run(live.check())
    assert engine.stalls == 1
    assert isinstance(flight.aborted, EngineStalledError)
    assert isinstance(beside.aborted, EngineStalledError)
    crashes.check(dict(hi), "10.0.0.2")
    if bounded:
        crashes.check(dict(wedging), "10.0.0.1")
        assert len(crashes) == 0
        return
    with pytest.raises(RequestError) as refused:
        crashes.check(dict(wedging))
    assert refused.value.code == "request_crashed_engine"
    assert envelope(refused.value).status == 400
    assert len(crashes) == 1


def _slot(i: int, task: int = -1, *, prompt: int = 0, decoded: int = 0) -> SlotState:
    busy = task >= 0
    return SlotState(id=i, n_ctx=2048, is_processing=busy, n_prompt_tokens=prompt + decoded,
                     n_decoded=decoded, id_task=task, n_prompt_processed=prompt)  # fmt: skip


class _Busy:
    """A busy engine whose decode loop answers ``/slots`` every poll: the liveness check
    over real flights (each with a real task to cancel), one second of fake clock a poll."""

    def __init__(self, n_slots: int = 2) -> None:
        self.clock = _Clock()
        self.engine = _Engine(self.clock, per_token_s=0.001)
        self.flights = Flights(self.clock)
        self.slots = _Slots(self.clock)
        self.slots.slots = tuple(_slot(i) for i in range(n_slots))
        self.live = Liveness(
            self.engine, self.flights, SlotQueue(n_slots, 4), self.slots,  # type: ignore[arg-type]
            _liveness(self.engine, self.clock).metrics,
            LivenessSettings(floor_s=15.0, factor=8.0, canary_interval_s=0),  # stall time 15 s
            state_dir=None, clock=self.clock,
        )  # fmt: skip

    def open(self, endpoint: str = "completions", *, slots: int = 1) -> Flight:
        flight = self.flights.open(endpoint, stream=False, slots=slots)
        flight.task = asyncio.ensure_future(asyncio.sleep(3600))
        return flight

    def set(self, *slots: SlotState) -> None:
        self.slots.slots = slots

    async def poll(self) -> None:
        self.clock.now += 1.0
        await self.live.check()
        await asyncio.sleep(0)


def test_a_request_with_no_progress_while_the_engine_serves_others_is_cancelled_alone() -> None:
    async def scenario() -> None:
        busy = _Busy()
        streaming, stuck = busy.open(), busy.open()
        for step in range(1, 40):  # the stream's slot decodes a token a second
            busy.set(_slot(0, 5, prompt=9, decoded=step), _slot(1))
            streaming.heard(busy.clock.now)
            await busy.poll()
            if stuck.aborted is not None:
                break
        assert isinstance(stuck.aborted, GenerationStalledError)
        assert busy.clock.now - stuck.started_s >= 15.0  # not before the stall time
        await asyncio.sleep(0)
        assert stuck.task is not None and stuck.task.cancelled()  # its upstream closed
        assert streaming.aborted is None and not streaming.task.done()  # type: ignore[union-attr]
        assert busy.engine.stalls == 0 and busy.engine.state == "ready"  # not restarted
        assert busy.live.metrics.request_stalls.n == 1 and busy.live.request_stalls == 1  # type: ignore[attr-defined]
        assert envelope(stuck.aborted).status == 503
        assert envelope(stuck.aborted).code == "generation_stalled"
        streaming.task.cancel()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_a_long_prefill_or_a_request_without_a_stream_is_progress_of_its_slot() -> None:
    # llama-server streams nothing while it evaluates a prompt (and a request without a
    # stream never streams): its slot's prompt tokens processed and tokens decoded, as
    # /slots reports them between two decode steps, are its progress.
    async def scenario() -> None:
        busy = _Busy()
        prefill, plain = busy.open(), busy.open()
        for step in range(1, 120):  # two minutes: eight stall times
            busy.set(_slot(0, 5, prompt=32 * (step // 4)),  # one 32-token batch per 4 s
                     _slot(1, 6, prompt=9, decoded=step // 2))  # fmt: skip
            await busy.poll()
        assert prefill.aborted is None and plain.aborted is None
        assert busy.live.request_stalls == 0
        for flight in (prefill, plain):
            flight.task.cancel()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_an_engine_that_answers_but_takes_no_step_is_slow_not_one_request_stuck() -> None:
    # Seen on this machine under load with a 3 s stall time: llama-server answered /slots
    # while neither of its two busy slots took a step for over 3 s.
    async def scenario() -> None:
        busy = _Busy()
        stream, plain = busy.open(), busy.open()
        for step in range(1, 10):
            busy.set(_slot(0, 5, prompt=9, decoded=step), _slot(1, 6, prompt=9, decoded=step))
            stream.heard(busy.clock.now)
            await busy.poll()
        for _ in range(30):  # the same step for 30 s, every poll answered
            await busy.poll()
        assert stream.aborted is None and plain.aborted is None
        assert busy.live.request_stalls == 0 and busy.engine.stalls == 0
        for flight in (stream, plain):
            flight.task.cancel()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_a_stream_a_slow_client_reads_late_does_not_hide_the_slot_it_left() -> None:
    # The engine ended the stream's generation long ago (its slot idles); its events still
    # reach a slow client. It holds no moving slot: the one that moves is the silent
    # request's, which is working.
    async def scenario() -> None:
        busy = _Busy()
        stream, plain = busy.open(), busy.open()
        stream.heard(busy.clock.now)  # the engine's last line, read off the socket
        for step in range(1, 60):
            busy.set(_slot(0, 5, prompt=9, decoded=200), _slot(1, 6, prompt=9, decoded=step))
            busy.flights.progressed(stream, busy.clock.now)  # relayed to the client now
            await busy.poll()
        assert plain.aborted is None and busy.live.request_stalls == 0
        for flight in (stream, plain):
            flight.task.cancel()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_which_of_two_silent_requests_is_stuck_is_not_guessed() -> None:
    # One slot moves, two requests are silent: either may be the stuck one, so neither is
    # cancelled; once the one on the moving slot is done, the other one alone is.
    async def scenario() -> None:
        busy = _Busy()
        working, stuck = busy.open(), busy.open()
        for step in range(1, 40):
            busy.set(_slot(0, 5, prompt=9, decoded=step), _slot(1))
            await busy.poll()
        assert working.aborted is None and stuck.aborted is None
        busy.flights.close(working)
        working.task.cancel()  # type: ignore[union-attr]
        busy.set(_slot(0), _slot(1))  # it ended; the engine idles
        for _ in range(20):
            await busy.poll()
        assert isinstance(stuck.aborted, GenerationStalledError)

    asyncio.run(scenario())


def test_a_tokenize_call_silent_while_the_engine_serves_others_is_cancelled_alone() -> None:
    async def scenario() -> None:
        busy = _Busy()
        call = busy.open("/apply-template", slots=0)
        for _ in range(16):
            await busy.poll()
        assert isinstance(call.aborted, GenerationStalledError)
        assert busy.engine.stalls == 0

    asyncio.run(scenario())


def test_an_answer_that_names_no_slot_judges_no_generation() -> None:
    # An engine whose /slots the front cannot read: a silent generation may be working.
    async def scenario() -> None:
        busy = _Busy()
        busy.set()
        flight, call = busy.open(), busy.open("/tokenize", slots=0)
        for _ in range(40):
            await busy.poll()
        assert flight.aborted is None and isinstance(call.aborted, GenerationStalledError)
        flight.task.cancel()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_no_answer_from_the_loop_is_still_a_stall_of_the_whole_engine() -> None:
    async def scenario() -> None:
        busy = _Busy()
        flight = busy.open()
        busy.slots.answers = False
        for _ in range(20):
            if busy.engine.stalls:
                break
            await busy.poll()
        assert busy.engine.stalls == 1 and isinstance(flight.aborted, EngineStalledError)
        assert busy.live.request_stalls == 0

    asyncio.run(scenario())


# ------------------------------------------------------------------ real engine


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


@pytest.mark.engine
def test_sigstop_mid_stream_is_a_stall_the_engine_is_replaced(
    serve_factory: ServeFactory,
) -> None:
    s = serve_factory(*STALL)
    old = s.engine_pid()
    events: list[str] = []
    with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=REQUEST_TIMEOUT_S) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                stop(old)
                stopped_at = time.monotonic()
    elapsed = time.monotonic() - stopped_at
    try:
        last = json.loads(events[-1])
        assert last["error"]["code"] == "engine_stalled", events[-3:]
        assert elapsed < 4 + scaled(30)  # the stall time, and it did not hang
        health = s.wait_state("stalled", "restarting", "loading", "ready", timeout_s=scaled(30))
        assert health["engine"]["stalls"] == 1
        health = s.wait_state("ready", timeout_s=scaled(120))
        assert health["engine"]["pid"] != old and health["engine"]["restarts"] == 1
        assert not Path(f"/proc/{old}").exists() or "Z" in Path(f"/proc/{old}/stat").read_text()
        ok = httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 2},
                        timeout=REQUEST_TIMEOUT_S)  # fmt: skip
        assert ok.status_code == 200
        assert metric(s, "slmguard_engine_stalls_total") == 1
        # The evidence, written before the kill, for watch's crash bundle.
        (evidence,) = (s.state_dir / "stalls").glob("stall-*.json")
        report = json.loads(evidence.read_text())
        assert report["engine_pid"] == old and report["stuck_request"]["endpoint"] == "completions"
        assert report["threads"] and {t["state"] for t in report["threads"]} == {"T"}
        assert report["engine_log_tail"]
        assert evidence.stat().st_mode & 0o777 == 0o600
        assert "engine stalled" in s.log()
    finally:
        cont(old)


@pytest.mark.engine
def test_no_client_request_stretches_the_stall_time(serve_factory: ServeFactory) -> None:
    """The stall time comes from the front's own step probe, not from the engine's timings
    of client requests (a 4-token request once raised it to 338 s, a grammar-constrained
    one to 1,145 s); a SIGSTOP after them is still found within it."""
    s = serve_factory("--stall-floor-s", "4", "--restart-backoff-initial-s", "0.2")
    deadline = time.monotonic() + scaled(120)
    live: dict[str, Any] = {}
    while time.monotonic() < deadline:
        live = (s.health() or {}).get("liveness") or {}
        if live.get("step_s") is not None:
            break
        time.sleep(0.1)
    assert live.get("step_s") is not None, live  # the probe ran once the engine was idle
    before = live["stall_after_s"]
    assert before == pytest.approx(max(4.0, 8 * live["step_s"]), abs=0.02)
    for body in (
        {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 4},
        {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 6, "grammar": 'root ::= "no" | "yes"'},
    ):
        resp = httpx.post(s.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert resp.status_code == 200, resp.text
    assert (s.health() or {})["liveness"]["stall_after_s"] == before
    pid = s.engine_pid()
    events: list[str] = []
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True},
                          timeout=REQUEST_TIMEOUT_S) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        stop(pid)
        # The stream ended with the stall's error event: found, not waited out.
        assert json.loads(events[-1])["error"]["code"] == "engine_stalled", events[-3:]
        health = s.wait_state("stalled", "restarting", "loading", "ready", timeout_s=scaled(30))
        assert health["engine"]["stalls"] == 1
        report = json.loads(next((s.state_dir / "stalls").glob("stall-*.json")).read_text())
        assert report["stall_after_s"] == pytest.approx(before, abs=0.02)
    finally:
        cont(pid)


@pytest.mark.engine
def test_sigstop_during_a_non_stream_request_gives_503_engine_stalled(
    serve_factory: ServeFactory,
) -> None:
    s = serve_factory(*STALL)
    pid = s.engine_pid()
    result: dict[str, Any] = {}

    def call() -> None:
        result["resp"] = httpx.post(s.url + "/v1/completions", json=LONG,
                                    timeout=REQUEST_TIMEOUT_S)  # fmt: skip

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + scaled(60)
    while not (s.health() or {}).get("in_flight") and time.monotonic() < deadline:
        time.sleep(0.02)
    stop(pid)
    try:
        t.join(scaled(120))
        resp: httpx.Response = result["resp"]
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "engine_stalled"
        assert resp.headers["retry-after"]
        s.wait_state("ready", timeout_s=scaled(120))
    finally:
        cont(pid)


@pytest.mark.engine
def test_an_idle_canary_finds_a_stopped_engine(serve_factory: ServeFactory) -> None:
    s = serve_factory("--canary-interval-s", "1", *STALL)
    pid = s.engine_pid()
    stop(pid)
    try:
        health = s.wait_state("stalled", "restarting", "loading", timeout_s=scaled(60))
        assert health["engine"]["stalls"] == 1
        assert s.wait_state("ready", timeout_s=scaled(120))["engine"]["pid"] != pid
        assert "idle canary" in s.log()
    finally:
        cont(pid)


@pytest.mark.engine
def test_a_stopped_engine_on_a_fresh_server_is_found_within_the_stall_time(
    serve_factory: ServeFactory,
) -> None:
    """Issue 37: the engine stopped before any request on a fresh server; a chat waited
    behind the front's own step probe, bounded by factor x floor (120 s by default), and
    got its 503 after 119.9 s (after one request, in 15 s). The probe's small batch is
    bounded by the floor now, the stall time until measured. Floor 10 s and factor 20
    here: the old bound, 200 s, is past this test's client timeout."""
    s = serve_factory("--stall-floor-s", "10", "--stall-factor", "20",
                      "--restart-backoff-initial-s", "0.2")  # fmt: skip
    pid = s.engine_pid()  # ready: the step probe starts at the next liveness round
    stop(pid)
    try:
        chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2}  # fmt: skip
        resp = httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=scaled(30))
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "engine_stalled"
        assert s.wait_state("ready", timeout_s=scaled(120))["engine"]["pid"] != pid
    finally:
        cont(pid)


@pytest.mark.engine
def test_a_request_without_a_stream_beside_a_stream_is_not_cancelled_for_its_silence(
    serve_factory: ServeFactory,
) -> None:
    """A request without a stream sends nothing until it is done, for longer than the
    stall time here, while a stream runs beside it: its slot's steps as the real engine's
    /slots reports them are its progress. Neither is cancelled; the engine stays."""
    stall_s = 3.0
    s = serve_factory("--stall-timeout-s", str(stall_s), "--n-parallel", "2", "--ctx", "640",
                      "--canary-interval-s", "0")  # fmt: skip
    pid = s.engine_pid()
    result: dict[str, Any] = {}

    # 200 tokens each: over 2 x the stall time on a quiet 2-core machine (about 10 s), and
    # within the test's timeout beside two CPU hogs and a VM (600 took over 600 s there).
    def plain() -> None:
        result["resp"] = httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 200},
                                    timeout=REQUEST_TIMEOUT_S)  # fmt: skip

    t = threading.Thread(target=plain)
    t.start()
    streamed = {**LONG, "max_tokens": 200, "prompt": "In a land far away", "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=streamed,
                      timeout=REQUEST_TIMEOUT_S) as resp:  # fmt: skip
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    t.join(REQUEST_TIMEOUT_S)
    answer: httpx.Response = result["resp"]
    assert answer.status_code == 200, answer.text
    assert events[-1] == "[DONE]" and not [e for e in events if '"error"' in e], events[-3:]
    timings = answer.json()["timings"]
    if timings["prompt_ms"] + timings["predicted_ms"] < 2 * stall_s * 1000:
        pytest.skip(f"the engine answered in {timings['predicted_ms']:.0f} ms here: no silence")
    health = s.health() or {}
    assert health["engine"]["stalls"] == 0 and health["engine"]["pid"] == pid
    assert health["liveness"]["request_stalls"] == 0
    assert metric(s, "slmguard_request_stalls_total") == 0
    # The per-slot facts it judged by, as this engine reports them (the task last run).
    assert [slot for slot in health["slots"] if slot["id_task"] >= 0], health["slots"]


@pytest.mark.engine
def test_a_grammar_that_wedged_the_engine_is_stopped_alone_by_its_bound(
    serve_factory: ServeFactory,
) -> None:
    """A 40-byte JSON-schema pattern within every bound but --max-repetition-product (3
    nested repetitions of 100; that bound is raised here, so the engine sees it) made
    llama-server build its grammar in the decode loop for minutes (over 90 s on this
    machine): every client's decoding stopped, a stall of the whole engine. The engine's
    own bound (--grammar-max-work, slmguard's patch) now stops it alone: 400 naming the
    field, no stall, no restart, the next request served."""
    s = serve_factory("--stall-timeout-s", "4", "--restart-backoff-initial-s", "0.2",
                      "--canary-interval-s", "0", "--max-repetition-product", "1000000",
                      "--max-grammar-stacks", "0")  # fmt: skip
    pid = s.engine_pid()
    pattern = "^(((a|b){0,100}){0,100}){0,100}$"
    wedge = {"model": MODEL_ID, "prompt": "x", "max_tokens": 1,
             "json_schema": {"type": "string", "pattern": pattern}}  # fmt: skip
    resp = httpx.post(s.url + "/v1/completions", json=wedge, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("grammar_too_complex", "json_schema"), err
    ok = httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 2},
                    timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert ok.status_code == 200, ok.text
    health = s.health() or {}
    engine = health["engine"]
    assert (engine["pid"], engine["stalls"], engine["restarts"]) == (pid, 0, 0), engine


@contextlib.contextmanager
def cpu_quota(pid: int, percent_of_one_cpu: int) -> Iterator[None]:
    """Move ``pid`` into a real cpu cgroup with a CFS quota (cgroup v1 or v2)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    name = f"slmguard-throttle-{os.getpid()}"
    if (v1 / "cpu.cfs_quota_us").exists():
        cg = v1 / name
        cg.mkdir()
        (cg / "cpu.cfs_period_us").write_text("100000")
        (cg / "cpu.cfs_quota_us").write_text(str(1000 * percent_of_one_cpu))
        procs, parent = cg / "cgroup.procs", v1 / "cgroup.procs"
    elif (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
        cg = Path("/sys/fs/cgroup") / name
        cg.mkdir()
        (cg / "cpu.max").write_text(f"{1000 * percent_of_one_cpu} 100000")
        procs, parent = cg / "cgroup.procs", Path("/sys/fs/cgroup/cgroup.procs")
    else:
        pytest.skip("no cpu cgroup controller to throttle with")
    try:
        procs.write_text(str(pid))
        yield
    finally:
        with contextlib.suppress(OSError):
            parent.write_text(str(pid))
        with contextlib.suppress(OSError):
            cg.rmdir()


@pytest.mark.engine
def test_a_long_prompt_on_a_throttled_engine_is_not_a_stall(serve_factory: ServeFactory) -> None:
    # Small batches so the decode loop answers between them, as a real slow board does.
    s = serve_factory("--stall-timeout-s", "6", "--n-batch", "32", "--n-ubatch", "32")
    pid = s.engine_pid()
    try:
        with cpu_quota(pid, 10):
            prompt = " ".join(f"word{i}" for i in range(120))  # about 360 tokens
            resp = httpx.post(
                s.url + "/v1/completions",
                json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 2},
                timeout=REQUEST_TIMEOUT_S,
            )
    except PermissionError:
        pytest.skip("cannot create a cpu cgroup here")
    assert resp.status_code == 200, resp.text
    timings = resp.json()["timings"]
    # It really was slow: more than the stall time in all, only not in one step.
    assert timings["prompt_ms"] > 6000, timings
    health = s.health()
    assert health is not None and health["engine"]["stalls"] == 0
    assert health["engine"]["pid"] == pid


@pytest.mark.engine
def test_a_stall_with_the_budget_spent_exits_70_and_stops_the_watchdog(
    serve_factory: ServeFactory, tmp_path: Path
) -> None:
    path = str(tmp_path / "notify.sock")
    seen: list[tuple[float, str]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(path)
        sink.settimeout(0.2)
        s = serve_factory(
            *STALL, "--restart-max", "1", "--restart-window-s", "600",
            env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "600000"},
        )  # fmt: skip

        # Read the notifications all along: an unread datagram socket holds only
        # net.unix.max_dgram_qlen (10) of them, and the front drops what does not fit.
        done = threading.Event()

        def drain() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    seen.append((time.monotonic(), sink.recv(4096).decode()))

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            # Round 1: the engine stops mid-stream, a generation in flight.
            pid = s.engine_pid()
            streamed = {**LONG, "stream": True}
            try:
                with httpx.stream("POST", s.url + "/v1/completions", json=streamed,
                                  timeout=REQUEST_TIMEOUT_S) as resp:  # fmt: skip
                    for line in resp.iter_lines():
                        if line.startswith("data: ") and "error" not in line:
                            stop(pid)
                s.wait_state("ready", timeout_s=scaled(120))
            finally:
                cont(pid)
            # Not blamed: with grammars bounded in the engine a stall is the engine's, and
            # the same request sent again is served (issue 37: a plain request in flight
            # during a stall was refused for the rest of the process's life).
            pid = s.engine_pid()
            again = httpx.post(s.url + "/v1/completions", json=streamed, timeout=REQUEST_TIMEOUT_S)
            assert again.status_code == 200, again.text
            health = s.health() or {}
            assert health["state"] == "ready" and health["engine"]["pid"] == pid
            # Round 2, another request: the budget is spent.
            stop(pid)
            try:
                httpx.post(s.url + "/v1/completions", json=LONG, timeout=REQUEST_TIMEOUT_S)
            finally:
                cont(pid)
            assert s.proc.wait(scaled(60)) == 70
        finally:
            done.set()
            reader.join(scaled(5))
    assert "giving up" in s.log()
    failed_at = next(t for t, m in seen if "STATUS=engine failed" in m)
    assert any(m == "WATCHDOG=1" for t, m in seen if t < failed_at)
    assert not [m for t, m in seen if t > failed_at and m == "WATCHDOG=1"], seen[-10:]


class _CountedSlots(_Slots):
    def __init__(self, clock: _Clock) -> None:
        super().__init__(clock)
        self.asked = 0

    async def refresh(self, timeout_s: float) -> bool:
        self.asked += 1
        return await super().refresh(timeout_s)


def test_streams_that_flow_are_the_progress_and_slots_is_asked_now_and_then() -> None:
    # Every request in flight streamed a line since the last round: the engine moves and
    # none is stuck; /slots is asked every SLOTS_WHILE_STREAMING_S only (a wake-up and a
    # parse fewer a second for the front, on a board whose cores are the engine's).
    async def scenario() -> None:
        busy = _Busy()
        counted = _CountedSlots(busy.clock)
        busy.live.slots = counted  # type: ignore[assignment]
        one, two = busy.open(), busy.open()
        for _ in range(20):
            one.heard(busy.clock.now)
            two.heard(busy.clock.now)
            await busy.poll()
        assert counted.asked == 20 // int(SLOTS_WHILE_STREAMING_S)
        assert busy.live.progress == 20 and busy.engine.stalls == 0
        silent = busy.open()  # a request without a stream: its slot's steps are its progress
        asked = counted.asked
        for _ in range(3):
            one.heard(busy.clock.now)
            two.heard(busy.clock.now)
            await busy.poll()
        assert counted.asked == asked + 3
        for flight in (one, two, silent):
            flight.task.cancel()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_a_relay_waiting_on_its_slow_client_is_not_a_stuck_request() -> None:
    # The relay reads the engine's stream and writes it in one task: while a client that
    # does not read holds its send (flow control), nothing is read off the engine's socket,
    # and the engine may have ended the generation meanwhile (its slot idles). That silence
    # is the client's: the request is not judged, and /slots is asked again.
    async def scenario() -> None:
        busy = _Busy()
        waiting = busy.open()
        waiting.heard(busy.clock.now)
        waiting.writing = True
        busy.set(_slot(0), _slot(1))  # both idle: the generation ended in the engine
        for _ in range(60):  # a minute: four stall times
            await busy.poll()
        assert waiting.aborted is None
        assert busy.live.request_stalls == 0 and busy.engine.stalls == 0
        assert not all_streaming(busy.flights, busy.clock.now - 1.0)
        waiting.writing = False  # the same silence, not waiting on the client: stuck
        for _ in range(3):
            await busy.poll()
        assert isinstance(waiting.aborted, GenerationStalledError)
        waiting.task.cancel()  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_all_streaming_needs_every_flight_to_be_a_stream_heard_lately() -> None:
    flights = Flights(_Clock())
    assert not all_streaming(flights, 0.0)  # nothing in flight proves nothing
    a = flights.open("completions", stream=True, slots=1)
    a.heard(10.0)
    assert all_streaming(flights, 9.0) and not all_streaming(flights, 10.5)
    call = flights.open("/tokenize", stream=False, slots=0)
    assert not all_streaming(flights, 9.0)
    flights.close(call)
    a.writing = True
    assert not all_streaming(flights, 9.0)


def test_stall_evidence_is_numbered_in_the_order_written_and_bounded(tmp_path: Path) -> None:
    """Named by a sequence, not the wall clock (a board without an RTC jumps from 1970 at
    NTP sync: the newest would sort first), and the newest STALLS_KEPT kept (issue 40)."""
    from slmguard import paths

    live = Liveness(
        SimpleNamespace(state="ready", pid=7), Flights(), None, None, None,  # type: ignore[arg-type]
        LivenessSettings(), state_dir=tmp_path, clock=_Clock(),
    )  # fmt: skip
    stalls = tmp_path / "stalls"
    stalls.mkdir()
    (stalls / "stall-1796512721490-6.json").write_text("{}")  # an earlier version's name
    written = [live._write_evidence({"time": 0.0, "engine_pid": 7}) for _ in range(20)]
    names = sorted((p.name for p in stalls.iterdir()), key=paths.stall_file_order)
    assert len(names) == paths.STALLS_KEPT
    assert names[-1] == "stall-000020-7.json" and written[-1] == stalls / names[-1]
    assert "stall-1796512721490-6.json" not in names  # the oldest went first


def test_an_idle_engine_whose_last_slots_answer_was_busy_is_asked_again() -> None:
    # /slots was asked only while requests ran, so its last answer (taken mid-request)
    # showed a busy slot in /health for as long as the server idled (issue 37).
    clock = _Clock()
    engine = _Engine(clock, per_token_s=0.001)
    slots = _CountedSlots(clock)
    slots.slots = (SlotState(0, 512, True, 10, 3, id_task=4),)
    live = Liveness(
        engine, Flights(clock), SlotQueue(1, 4), slots, _liveness(engine, clock).metrics,  # type: ignore[arg-type]
        LivenessSettings(canary_interval_s=0), state_dir=None, clock=clock,
    )  # fmt: skip
    asyncio.run(live.check())
    assert slots.asked == 1
    slots.slots = (SlotState(0, 512, False, 13, 3, id_task=4),)  # the engine's fresh answer
    asyncio.run(live.check())
    assert slots.asked == 1  # idle and shown idle: not asked again
