"""Governor runtime: sample -> decide -> act on a live-edited cgroup tree, with an injected clock.

The engine here is a recording stand-in for the server's engine control (these
tests are about the governor's loop, not the engine); the real engine is
driven in ``test_governor_http.py`` and the benchmark.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from hosttree import build_tree
from slmguard.errors import EngineError, SlmguardError, envelope
from slmguard.governor.leaks import EngineView, RecycleOutcome
from slmguard.governor.policy import DegradeSettings, Level, MemoryModel, Thresholds
from slmguard.governor.request import SizedRequest
from slmguard.governor.runtime import Governor, GovernorConfig
from slmguard.governor.signal import MemorySignal
from slmguard.serve.sessions import SessionStore
from waiting import scaled

MIB = 1 << 20
LIMIT = 1000 * MIB
CG = "sys/fs/cgroup/svc"


def host(tmp_path: Path) -> Path:
    return build_tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/svc\n",
            "proc/self/mountinfo": "25 1 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
            "proc/meminfo": "MemTotal: 8000000 kB\nMemAvailable: 7000000 kB\n",
            "sys/fs/cgroup/cgroup.controllers": "cpu memory pids\n",
            f"{CG}/memory.current": "0\n",
            f"{CG}/memory.high": "max\n",
            f"{CG}/memory.max": f"{LIMIT}\n",
            f"{CG}/memory.stat": "anon 0\ninactive_file 0\n",
            f"{CG}/memory.events": "oom_kill 0\n",
        },
    )


def set_pct(root: Path, pct: float) -> None:
    (root / CG / "memory.current").write_text(f"{int(LIMIT * pct / 100)}\n")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingEngine:
    """Records what the governor asks of the engine; can be told to fail resizes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail_resize = False
        self.generations: list[int] = []

    async def resize_context(self, n_ctx: int) -> None:
        self.calls.append(("resize", n_ctx))
        if self.fail_resize:
            raise EngineError("reload failed")

    async def abort_newest(self, reason: str) -> bool:
        self.calls.append(("abort", reason))
        if not self.generations:
            return False
        self.generations.pop()
        return True

    async def drop_prefix_cache(self) -> None:
        self.calls.append(("drop_prefix", None))

    async def park(self, reason: str) -> None:
        self.calls.append(("park", reason))
        if self.fail_park:
            raise EngineError("cannot stop the engine")
        if self.on_park is not None:
            self.on_park()

    async def resume(self, n_ctx: int) -> None:
        self.calls.append(("resume", n_ctx))
        if self.fail_resume:
            raise EngineError("engine did not come back from parking")

    fail_resume = False
    fail_park = False

    on_park: Callable[[], None] | None = None

    def engine_pid(self) -> int | None:
        return None

    def planned_slots(self) -> int:
        return 1

    def limit_slots(self, slots: int | None) -> None:
        self.calls.append(("limit_slots", slots))

    view: EngineView | None = None  # the leak check's view of the engine (None: not serving)
    recycled_pid: int | None = None  # the pid a recycle brings up

    def engine_view(self) -> EngineView | None:
        return self.view

    async def recycle(self, reason: str, drain_timeout_s: float) -> RecycleOutcome:
        self.calls.append(("recycle", reason))
        before = self.view.pid if self.view is not None else None
        if self.view is not None and self.recycled_pid is not None:
            self.view = replace(self.view, pid=self.recycled_pid)
        return RecycleOutcome(before, self.recycled_pid, 0.5, 1.5, waiting=1)


CONFIG = GovernorConfig(
    thresholds=Thresholds(recover_hold_s=10.0, psi_shed_pct=None),
    degrade=DegradeSettings(n_ctx_floor=512, shrink_cooldown_s=5.0, keep_recent_tokens=4),
    model=MemoryModel(kv_bytes_per_token=18_432),
    min_interval_s=0.01,
    max_interval_s=0.5,
)


def make(
    tmp_path: Path, *, config: GovernorConfig = CONFIG, with_store: bool = False
) -> tuple[Governor, Path, Clock, RecordingEngine]:
    root = host(tmp_path / "host")
    clock = Clock()
    engine = RecordingEngine()
    store = SessionStore.open(tmp_path / "sessions.sqlite3") if with_store else None
    signal = MemorySignal(root, clock=clock)
    gov = Governor(signal, config, 2048, engine=engine, sessions=store, root=root, clock=clock)
    return gov, root, clock, engine


@dataclass(frozen=True)
class Answer:
    """What the front answers for a policy's verdict: the status, code and Retry-After."""

    status: int
    code: str | None = None
    retry_after_s: int | None = None


def asked(refusal: SlmguardError | None, *, none: int = 200) -> Answer:
    """A verdict as the client sees it; None is ``none`` (200 admitted, or the front's
    own 400 for a context verdict)."""
    if refusal is None:
        return Answer(none)
    code = getattr(refusal, "code", None)
    return Answer(envelope(refusal).status, code, getattr(refusal, "retry_after_s", None))


def req(prompt_tokens: int | None, max_tokens: int) -> SizedRequest:
    return SizedRequest("chat", prompt_tokens or 0, max_tokens)


async def drain(gov: Governor) -> None:
    """Carry out what the last ticks decided: the queued actions and any park under way."""
    while not gov._actions.empty():
        await gov.execute(gov._actions.get_nowait())
    await asyncio.gather(*gov._urgent)


def hold_resizes(engine: RecordingEngine) -> asyncio.Event:
    """Make each context resize wait, after the engine's work, until the event is set:
    a reload that takes seconds on a busy board."""
    release = asyncio.Event()
    real_resize = engine.resize_context

    async def slow_resize(n_ctx: int) -> None:
        await real_resize(n_ctx)
        await release.wait()

    engine.resize_context = slow_resize  # type: ignore[method-assign]
    return release


async def start_a_resize(gov: Governor, root: Path) -> asyncio.Task[None]:
    """Push memory to 93%, tick, and start carrying out the resize that tick decided."""
    set_pct(root, 93)
    gov.tick()
    actions = [gov._actions.get_nowait() for _ in range(gov._actions.qsize())]
    resize = next(a for a in actions if type(a).__name__ == "ResizeContext")
    task = asyncio.create_task(gov.execute(resize))
    await asyncio.sleep(0)
    return task


def test_shed_rejects_new_requests_with_retry_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gov, root, _clock, engine = make(tmp_path)
    set_pct(root, 50)
    gov.tick()
    assert asked(gov.admit(req(None, 16))).status == 200
    set_pct(root, 86)
    caplog.set_level(logging.INFO, logger="slmguard.governor")
    gov.tick()
    verdict = asked(gov.admit(req(None, 16)))
    assert (verdict.status, verdict.code, verdict.retry_after_s) == (503, "memory_shedding", 10)
    assert gov.counters.snapshot()["rejections"] == {"memory_shedding": 1}
    assert gov.counters.snapshot()["transitions"] == {"normal->shed": 1}
    lines = [r for r in caplog.records if r.getMessage().startswith("governor.transition")]
    assert len(lines) == 1
    assert '"from_level": "normal"' in lines[0].getMessage()
    assert '"to_level": "shed"' in lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING
    assert engine.calls == []  # shedding does not touch the engine
    # The sampler tightens: 86% is 60 MiB below the next watermark (92%).
    assert gov.interval_s < 0.05


def test_degrade_trims_shrinks_then_recovers_step_by_step(tmp_path: Path) -> None:
    gov, root, clock, engine = make(tmp_path, with_store=True)
    assert gov.sessions is not None
    gov.sessions.append(
        "s",
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 4,
        tokens=[2] * 8,
    )

    async def scenario() -> None:
        set_pct(root, 93)
        gov.tick()
        await drain(gov)
        assert gov.state.level is Level.DEGRADE
        assert gov.max_tokens_cap() == CONFIG.degrade.max_tokens_cap
        assert ("resize", 1024) in engine.calls
        assert ("drop_prefix", None) in engine.calls  # part of the session trim
        assert gov.last_resize is not None and gov.last_resize.ok
        assert gov.last_resize.predicted_delta_bytes == 1024 * 18_432
        # keep_recent 4 tokens: the last user/assistant pair stays.
        assert gov.sessions is not None and len(gov.sessions.history("s")) == 2
        # Memory falls; recovery is one level per 10 s hold, then the context grows back.
        set_pct(root, 40)
        for _ in range(5):
            clock.now += 10.0
            gov.tick()
            await drain(gov)
        assert gov.state.level is Level.NORMAL
        assert engine.calls[-1] == ("resize", 2048)
        assert gov.state.n_ctx == 2048 and gov.max_tokens_cap() is None

    asyncio.run(scenario())
    c = gov.counters.snapshot()
    assert c["transitions"] == {"degrade->shed": 1, "normal->degrade": 1, "shed->normal": 1}
    assert c["degradations"] == {
        "context_grow": 1,
        "context_shrink": 1,
        "max_tokens_cap": 1,
        "trim_sessions": 1,
    }


def test_failed_resize_keeps_the_old_context_and_is_counted(tmp_path: Path) -> None:
    gov, root, _clock, engine = make(tmp_path)
    engine.fail_resize = True
    set_pct(root, 93)

    async def scenario() -> None:
        gov.tick()
        await drain(gov)

    asyncio.run(scenario())
    assert gov.state.n_ctx == 2048
    assert gov.counters.snapshot()["failures"] == {"ResizeContext": 1}
    assert gov.last_resize is not None and not gov.last_resize.ok


def test_critical_aborts_the_newest_generation(tmp_path: Path) -> None:
    # KV cells worth 20% of the limit per halving: a shrink helps, so no park.
    big_kv = replace(CONFIG, model=MemoryModel(kv_bytes_per_token=200_000))
    gov, root, _clock, engine = make(tmp_path, config=big_kv)
    engine.generations = [1, 2]
    set_pct(root, 98)

    async def scenario() -> None:
        gov.tick()
        await drain(gov)

    asyncio.run(scenario())
    aborts = [c for c in engine.calls if c[0] == "abort"]
    assert len(aborts) == 1 and "memory governor" in str(aborts[0][1])
    assert engine.generations == [1]
    assert gov.counters.snapshot()["degradations"]["abort"] == 1


def test_critical_at_the_floor_parks_then_resumes_when_the_engine_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = host(tmp_path / "host")
    clock = Clock()
    engine = RecordingEngine()
    # Stopping the engine gives back 28% of the limit (no engine pid here: the
    # governor counts what the working set dropped by).
    engine.on_park = lambda: set_pct(root, 70)
    gov = Governor(MemorySignal(root, clock=clock), CONFIG, 512, engine=engine, root=root,
                   clock=clock)  # fmt: skip
    set_pct(root, 98)

    async def scenario() -> None:
        gov.tick()  # full context 512 = the floor: nothing left to shrink
        await drain(gov)
        assert gov.state.parked and gov.state.parked_bytes == int(LIMIT * 0.28)
        assert asked(gov.admit(req(10, 10))).code == "engine_parked"
        for t, pct in ((1, 60), (11, 60), (12, 45)):
            clock.now = 1000 + t
            set_pct(root, pct)
            gov.tick()
            await drain(gov)
            # Below recover (80%) since t=1, but 60% + the parked 28% would cross
            # it: only at 45% does the engine fit again.
            assert gov.state.parked is (t < 12), t

    with caplog.at_level(logging.INFO, logger="slmguard.governor"):
        asyncio.run(scenario())
    park, resume = [c for c in engine.calls if c[0] in ("park", "resume")]
    assert "context at its floor" in str(park[1]) and resume == ("resume", 512)
    assert not gov.state.parked
    counts = gov.counters.snapshot()
    assert counts["degradations"]["park"] == 1 and counts["degradations"]["resume"] == 1
    assert counts["rejections"]["engine_parked"] == 1
    assert "abort" not in counts["degradations"]
    assert "governor.park" in caplog.text and "governor.resume" in caplog.text
    assert gov.status()["parked"] is False


def test_a_failed_park_leaves_the_governor_unparked_and_is_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = host(tmp_path / "host")
    clock = Clock()
    engine = RecordingEngine()
    engine.fail_park = True
    gov = Governor(MemorySignal(root, clock=clock), CONFIG, 512, engine=engine, root=root,
                   clock=clock)  # fmt: skip
    set_pct(root, 98)

    async def scenario() -> None:
        gov.tick()
        await drain(gov)

    with caplog.at_level(logging.ERROR, logger="slmguard.governor"):
        asyncio.run(scenario())
    assert not gov.state.parked  # the server still serves: do not answer engine_parked
    assert asked(gov.admit(req(10, 10))).code == "memory_shedding"
    assert gov.counters.snapshot()["failures"]["ParkEngine"] == 1
    assert "cannot stop the engine" in caplog.text


def test_a_failed_resume_parks_again_and_waits_another_hold(tmp_path: Path) -> None:
    root = host(tmp_path / "host")
    clock = Clock()
    engine = RecordingEngine()
    engine.fail_resume = True
    gov = Governor(MemorySignal(root, clock=clock), CONFIG, 512, engine=engine, root=root,
                   clock=clock)  # fmt: skip
    set_pct(root, 98)

    async def scenario() -> None:
        gov.tick()
        await drain(gov)  # parked
        for t in (1, 11, 12, 21, 22):
            clock.now = 1000 + t
            set_pct(root, 5)
            gov.tick()
            await drain(gov)

    asyncio.run(scenario())
    kinds = [c[0] for c in engine.calls if c[0] in ("park", "resume")]
    # Resume at t=11 fails: parked again at once; the next try waits a full hold (t=22).
    assert kinds == ["park", "resume", "park", "resume", "park"]
    assert gov.state.parked
    assert gov.counters.snapshot()["failures"]["ResumeEngine"] == 2


def test_disabled_governor_reports_but_never_acts(tmp_path: Path) -> None:
    config = GovernorConfig(thresholds=CONFIG.thresholds, degrade=CONFIG.degrade, enabled=False)
    gov, root, _clock, engine = make(tmp_path, config=config)
    set_pct(root, 99)

    async def scenario() -> None:
        gov.tick()
        await drain(gov)

    asyncio.run(scenario())
    assert gov.state.level is Level.CRITICAL  # what it would do
    assert asked(gov.admit(req(None, 5))).status == 200
    assert gov.max_tokens_cap() is None
    assert engine.calls == []
    assert gov.status()["enabled"] is False


def test_context_verdict_under_a_degraded_context(tmp_path: Path) -> None:
    gov, root, _clock, _engine = make(tmp_path)
    assert asked(gov.context_verdict(req(3000, 10)), none=400).status == 400
    assert (
        asked(gov.context_verdict(req(1500, 10)), none=400).status == 400
    )  # full context: a real 400
    set_pct(root, 93)

    async def scenario() -> None:
        gov.tick()
        await drain(gov)

    asyncio.run(scenario())
    assert gov.state.n_ctx == 1024
    verdict = asked(gov.context_verdict(req(1500, 10)), none=400)
    assert (verdict.status, verdict.code) == (503, "context_degraded")
    assert asked(gov.context_verdict(req(3000, 10)), none=400).status == 400


def test_run_loop_samples_until_stopped(tmp_path: Path) -> None:
    root = host(tmp_path / "host")
    set_pct(root, 86)
    gov = Governor(MemorySignal(root), CONFIG, 2048, engine=RecordingEngine(), root=root)

    async def scenario() -> None:
        gov.start()
        for _ in range(200):
            if gov.state.level is Level.SHED:
                break
            await asyncio.sleep(0.01)
        await gov.aclose()

    asyncio.run(scenario())
    assert gov.state.level is Level.SHED
    status = gov.status()
    assert status["level"] == "shed"
    # The change is listed for slmguard top: levels, reason, pressure, wall-clock time.
    (change,) = status["transitions"]
    assert (change["from_level"], change["to_level"]) == ("normal", "shed")
    assert change["pressure_pct"] == pytest.approx(86, abs=1)
    assert change["reason"] and abs(change["at_unix_s"] - time.time()) < 3600


def test_run_loop_survives_unreadable_signal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = host(tmp_path / "host")
    (root / CG / "memory.current").write_text("garbage\n")
    gov = Governor(MemorySignal(root), CONFIG, 2048, root=root)

    async def scenario() -> None:
        gov.start()
        await asyncio.sleep(0.05)
        await gov.aclose()

    caplog.set_level(logging.ERROR, logger="slmguard.governor")
    asyncio.run(scenario())
    assert any("governor.signal_error" in r.getMessage() for r in caplog.records)


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {scaled(timeout_s)} s"
        await asyncio.sleep(0.01)


def test_an_unreadable_signal_is_said_once_with_what_the_governor_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A signal that stays unreadable was an ERROR every sample (every second on a host
    whose cgroup vanished); now one ERROR saying what the governor does meanwhile, the
    repeats at DEBUG, one INFO when it reads again, and an ERROR again if it breaks again."""
    root = host(tmp_path / "host")
    current = root / CG / "memory.current"
    current.write_text("garbage\n")
    fast = replace(CONFIG, min_interval_s=0.001, max_interval_s=0.001)
    gov = Governor(MemorySignal(root), fast, 2048, root=root)

    def said(event: str, level: int | None = None) -> list[logging.LogRecord]:
        return [
            r for r in caplog.records
            if r.getMessage().startswith(event) and level in (None, r.levelno)
        ]  # fmt: skip

    async def scenario() -> None:
        gov.start()
        await _until(lambda: len(said("governor.signal_error")) >= 5, "five failed samples")
        current.write_text("0\n")
        await _until(lambda: bool(said("governor.signal_recovered")), "the recovery")
        current.write_text("garbage\n")
        await _until(lambda: len(said("governor.signal_error", logging.ERROR)) == 2, "new error")
        await gov.aclose()

    caplog.set_level(logging.DEBUG, logger="slmguard.governor")
    asyncio.run(scenario())
    first = said("governor.signal_error", logging.ERROR)[0].getMessage()
    assert "stays at normal" in first and "said once" in first
    assert len(said("governor.signal_recovered", logging.INFO)) == 1
    errors = said("governor.signal_error")
    assert len(errors) - len(said("governor.signal_error", logging.DEBUG)) == 2


def test_a_cgroup_not_visible_here_is_said_once_and_the_processes_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A chroot sees the host's /proc, which names a cgroup whose directory is not there
    (no /sys/fs/cgroup inside): the signal counts the service's processes, said once at
    construction, and every sample reads (it raised HostReadError every second)."""
    root = build_tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/process_api/abc\n0::/\n",
            "proc/self/mountinfo": "22 1 179:2 / / rw - ext4 /dev/root rw\n",
            "proc/meminfo": "MemTotal: 8000000 kB\nMemAvailable: 7000000 kB\n",
            "proc/10/status": "Name:\tslmguard\nRssAnon:\t20480 kB\nRssShmem:\t0 kB\n",
        },
    )
    with caplog.at_level(logging.DEBUG, logger="slmguard.governor"):
        signal = MemorySignal(root, pids=lambda: [10])
        snaps = [signal.sample() for _ in range(3)]
    assert signal.cgroup_dir is None
    assert {s.source for s in snaps} == {"processes"}
    assert snaps[0].working_set_bytes == 20480 * 1024
    (line,) = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert line.levelno == logging.WARNING
    assert "process_api/abc is not visible here (a chroot" in line.getMessage()
    assert "counts the server's and the engine's own memory" in line.getMessage()


def test_no_decisions_while_a_resize_is_in_flight(tmp_path: Path) -> None:
    """The dip while the old context is freed and the new one not yet built is no recovery."""
    gov, root, clock, engine = make(tmp_path)
    release = hold_resizes(engine)

    async def scenario() -> None:
        task = await start_a_resize(gov, root)
        set_pct(root, 10)  # memory freed mid-reload
        for _ in range(3):
            clock.now += 10.0
            gov.tick()
        assert gov.state.level is Level.DEGRADE  # frozen while resizing
        assert gov.snapshot is not None and gov.snapshot.used_pct == pytest.approx(10, abs=0.1)
        release.set()
        await task
        assert gov.state.last_resize_s == clock.now  # cooldowns count from completion
        clock.now += 10.0
        gov.tick()  # decisions resume: the hold below recover_pct starts now
        assert gov.state.level is Level.DEGRADE
        clock.now += 10.0
        gov.tick()
        assert gov.state.level is Level.SHED  # one step per hold

    asyncio.run(scenario())


def test_critical_during_a_reload_parks_at_once(tmp_path: Path) -> None:
    """A reload takes seconds on a busy board; memory reaching critical meanwhile parks
    the engine then, not after the reload the actor is waiting on."""
    gov, root, clock, engine = make(tmp_path)
    release = hold_resizes(engine)

    async def scenario() -> None:
        task = await start_a_resize(gov, root)
        set_pct(root, 98)  # the neighbour kept growing while the engine reloads
        clock.now += 0.5
        gov.tick()
        for _ in range(3):
            await asyncio.sleep(0)
        assert ("park",) in [c[:1] for c in engine.calls], engine.calls
        assert gov.state.parked and gov.state.n_ctx == 512
        assert gov.counters.snapshot()["degradations"]["park"] == 1
        release.set()
        await task
        assert gov.state.parked and gov.state.n_ctx == 512  # the reload did not undo it

    asyncio.run(scenario())


def test_admission_samples_afresh_when_the_last_sample_is_stale(tmp_path: Path) -> None:
    gov, root, clock, _engine = make(tmp_path)
    set_pct(root, 50)
    gov.tick()
    set_pct(root, 86)  # crossed between two loop samples
    clock.now += 0.005  # younger than admission_max_age_s: the last sample stands
    assert asked(gov.admit(req(None, 8))).status == 200
    clock.now += 0.01
    verdict = asked(gov.admit(req(None, 8)))  # stale: sampled again, sheds at once
    assert (verdict.status, verdict.code) == (503, "memory_shedding")
    assert gov.state.level is Level.SHED


def test_the_context_verdict_counts_the_tokens_of_one_slot(tmp_path: Path) -> None:
    """Four slots of 512 tokens: halving 2048 cells drops two slots, each keeps its 512,
    so a 600-token request is the front's plain 400 for good, not a 503 to retry. Only
    below one slot's planned context does the reduced context say "retry"."""
    from dataclasses import replace

    from slmguard.serve.engine import config_for_cells
    from slmguard.serve.llamaserver import EngineConfig

    planned = EngineConfig(model_path="/m", n_ctx=2048, n_batch=512, n_ubatch=512,
                           n_threads=1, n_parallel=4)  # fmt: skip
    root = host(tmp_path / "host")
    gov = Governor(
        MemorySignal(root), CONFIG, 2048, root=root,
        slot_tokens=lambda cells: config_for_cells(planned, cells).n_ctx_slot,
    )  # fmt: skip
    gov.state = replace(gov.state, n_ctx=1024)  # two slots left
    assert asked(gov.context_verdict(req(600, 10)), none=400).status == 400
    gov.state = replace(gov.state, n_ctx=256)  # one slot of 256 tokens
    verdict = asked(gov.context_verdict(req(300, 10)), none=400)
    assert (verdict.status, verdict.code) == (503, "context_degraded")
    assert asked(gov.context_verdict(req(600, 10)), none=400).status == 400


def test_the_memory_model_of_an_encoder_served_without_a_plan(rerank_model: Path) -> None:
    """Served without a plan, the governor takes the KV cost from the GGUF header; for an
    encoder (llama.cpp runs BERT without a KV cache) there is none, and none is made up
    from the heads: the ladder then never shrinks it. A decoder still gets its cost."""
    from slmguard.plan.modelfacts import read_model_facts

    bert = read_model_facts(rerank_model)
    cfg = GovernorConfig.for_model(None, bert, kv_type="f16")
    assert cfg.model == MemoryModel(kv_bytes_per_token=0, use_bytes=0, no_kv_cache=True)
    decoder = replace(bert, arch="llama", causal_attn=True, pooling_type=None)
    # 2 layers x 4 heads x (16 + 16) x 2 bytes
    assert GovernorConfig.for_model(None, decoder, kv_type="f16").model == MemoryModel(512)
