"""The worker's supervisor: spawn, talk to, and restart the engine process.

Owns the worker process's life (spawn with one end of a socketpair, a reader
task that routes the worker's messages to the waiting requests, restart with
exponential backoff, a bounded restart rate) and the front's own
``oom_score_adj``. It holds no HTTP knowledge: the app turns
:class:`WorkerGone` and :class:`GenerationError` into responses.

States: ``loading`` (first start, or a reload), ``ready``, ``restarting``
(the worker died; requests get 503 until it is back), ``failed`` (too many
restarts within the window: ``on_failed`` is called and the front exits
non-zero so systemd can act), ``parked`` (stopped on purpose by
:meth:`Supervisor.park`, the memory governor's last rung: no restart, no
restart budget spent, until :meth:`Supervisor.resume`), ``stopped``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slmguard.serve import protocol
from slmguard.serve.protocol import EngineConfig, Message

log = logging.getLogger(__name__)


class WorkerGone(Exception):
    """The worker died (or was restarted) while this request depended on it."""


class WorkerNotReady(Exception):
    """No worker is serving right now (loading, restarting, failed)."""

    def __init__(self, state: str) -> None:
        super().__init__(f"engine is {state}")
        self.state = state


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff doubles from ``backoff_initial_s`` to ``backoff_max_s``; more than
    ``max_restarts`` restarts within ``window_s`` seconds means give up."""

    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 60.0

    def delay_s(self, consecutive_failures: int) -> float:
        return float(
            min(self.backoff_max_s, self.backoff_initial_s * (2 ** max(0, consecutive_failures)))
        )


class RestartBudget:
    """Sliding-window count of restarts (pure; time is passed in)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: collections.deque[float] = collections.deque()

    def allow(self, now_s: float) -> bool:
        """Record a restart at ``now_s``; False when it exceeds the budget."""
        while self.times and now_s - self.times[0] > self.policy.window_s:
            self.times.popleft()
        if len(self.times) >= self.policy.max_restarts:
            return False
        self.times.append(now_s)
        return True


def set_own_oom_score_adj(value: int, root: Path = Path("/")) -> bool:
    """Lower (or set) the front's oom_score_adj; never fails, logs when denied."""
    try:
        (root / "proc/self/oom_score_adj").write_text(f"{value}\n")
    except OSError as err:
        log.warning("front keeps its oom_score_adj (setting %d: %s)", value, err.strerror)
        return False
    return True


class Generation:
    """One request's view of the worker's events for its id."""

    def __init__(self, supervisor: Supervisor, rid: int) -> None:
        self.supervisor = supervisor
        self.id = rid
        self.events: asyncio.Queue[Message | None] = asyncio.Queue()
        self.finished = False
        self.abort_reason: str | None = None

    async def next_event(self) -> Message:
        msg = await self.events.get()
        if msg is None:
            self.finished = True
            raise WorkerGone("the engine worker stopped during this request")
        if msg["op"] in ("done", "error"):
            self.finished = True
        return msg

    def close(self) -> None:
        """Stop caring about this generation; cancel it in the worker if still running."""
        if not self.finished:
            self.supervisor.cancel(self.id)
            self.finished = True
        self.supervisor._pending.pop(self.id, None)


class Supervisor:
    def __init__(
        self,
        config: EngineConfig,
        policy: RestartPolicy,
        *,
        fault_log: Path | None = None,
        worker_oom_score_adj: int = 1000,
        on_state: Callable[[str], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        on_failed: Callable[[], None] | None = None,
        on_cancelled: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.fault_log = fault_log
        self.worker_oom_score_adj = worker_oom_score_adj
        self.on_state = on_state
        self.on_restart = on_restart
        self.on_failed = on_failed
        self.on_cancelled = on_cancelled
        self.state = "loading"
        self.worker_pid: int | None = None
        self.n_ctx: int = config.n_ctx
        self.loaded: Message = {}
        self.restarts = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, Generation] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._load_waiter: asyncio.Future[Message] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._ready_event = asyncio.Event()
        self._parked = False
        self._unparked = asyncio.Event()
        # The worker process park() killed: its exit is not a crash, even when
        # resume() has already run by the time the loop sees the exit.
        self._parked_proc: asyncio.subprocess.Process | None = None

    # Lifecycle

    def _set_state(self, state: str) -> None:
        if state != self.state:
            log.info("engine state: %s -> %s", self.state, state)
        self.state = state
        if state == "ready":
            self._ready_event.set()
        else:
            self._ready_event.clear()
        if self.on_state is not None:
            self.on_state(state)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="worker-supervisor")

    async def wait_ready(self, timeout_s: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _spawn(self) -> asyncio.StreamReader:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "slmguard.serve.worker", "--fd", str(child.fileno())]
        cmd += ["--oom-score-adj", str(self.worker_oom_score_adj)]
        if self.fault_log is not None:
            cmd += ["--fault-log", str(self.fault_log)]
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, pass_fds=(child.fileno(),), stdin=asyncio.subprocess.DEVNULL
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.worker_pid = self._proc.pid
        reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        return reader

    async def _run(self) -> None:
        budget = RestartBudget(self.policy)
        consecutive = 0
        while not self._stopping:
            if self._parked:
                self._set_state("parked")
                await self._unparked.wait()
                consecutive = 0
                continue
            started = time.monotonic()
            try:
                reader = await self._spawn()
                self._load_waiter = asyncio.get_running_loop().create_future()
                self._send(self.config.to_message())
                loop_task = asyncio.create_task(self._read_loop(reader))
                waitables: list[asyncio.Future[Any]] = [loop_task, self._load_waiter]
                await asyncio.wait(waitables, return_when=asyncio.FIRST_COMPLETED)
                loaded = self._load_waiter.done() and self._load_waiter.result()["op"] == "loaded"
                if loaded and self._parked_proc is not self._proc:
                    self._on_loaded(self._load_waiter.result())
                elif self._load_waiter.done():
                    if self._parked_proc is not self._proc:
                        log.error(
                            "engine failed to load: %s", self._load_waiter.result().get("message")
                        )
                    self._kill()
                await loop_task  # returns when the worker's socket closes
            finally:
                # On every path (worker exit, load failure, cancellation by stop()):
                # close our end of the socket and wait until it is really closed.
                await self._close_writer()
            # park() may have run during the awaits: did it kill this worker?
            parked = self._parked_proc is not None and self._parked_proc is self._proc
            if not self.stopping and not parked:
                self._set_state("restarting")
            elif parked and self._is_parked():
                self._set_state("parked")
            self._fail_pending()
            rc = await self._proc.wait() if self._proc is not None else None
            self.worker_pid = None
            if self.stopping:
                break
            if parked:
                self._parked_proc = None
                log.warning("engine parked: worker stopped (%s) until memory is available",
                            _describe_exit(rc))  # fmt: skip
                continue  # the loop's top waits for resume() (or it already ran)
            log.error("engine worker exited (%s)", _describe_exit(rc))
            if time.monotonic() - started > self.policy.window_s:
                consecutive = 0
            self.restarts += 1
            if self.on_restart is not None:
                self.on_restart()
            if not budget.allow(time.monotonic()):
                log.error(
                    "engine worker restarted more than %d times in %.0f s: giving up",
                    self.policy.max_restarts,
                    self.policy.window_s,
                )
                self._set_state("failed")
                if self.on_failed is not None:
                    self.on_failed()
                return
            self._set_state("restarting")
            await asyncio.sleep(self.policy.delay_s(consecutive))
            consecutive += 1
        self._set_state("stopped")

    async def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()

    def _on_loaded(self, msg: Message) -> None:
        self.loaded = msg
        self.n_ctx = int(msg["n_ctx"])
        log.info("engine ready: pid %s, n_ctx %s, loaded in %s s", msg["pid"], msg["n_ctx"],
                 msg["load_s"])  # fmt: skip
        self._set_state("ready")

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                msg = await protocol.recv_async(reader)
            except protocol.ProtocolError as err:
                log.error("bad frame from worker: %s", err)
                self._kill()
                return
            if msg is None:
                return
            op = msg["op"]
            if op in ("loaded", "load_failed"):
                waiter = self._load_waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
                elif op == "loaded":
                    self._on_loaded(msg)
                continue
            if op == "error" and msg.get("code") == "cancelled" and self.on_cancelled:
                self.on_cancelled(int(msg.get("n", 0)))
            gen = self._pending.get(int(msg.get("id", -1)))
            if gen is not None:
                gen.events.put_nowait(msg)

    def _fail_pending(self) -> None:
        for gen in list(self._pending.values()):
            gen.events.put_nowait(None)
        self._pending.clear()
        if self._load_waiter is not None and not self._load_waiter.done():
            self._load_waiter.set_result({"op": "load_failed", "message": "worker died"})

    def _kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    def _send(self, msg: Message) -> None:
        if self._writer is None:
            raise WorkerGone("no engine worker")
        self._writer.write(protocol.encode(msg))

    async def park(self, reason: str) -> None:
        """Stop the worker now and keep it stopped until :meth:`resume`.

        Running generations end with a 503 naming ``reason``. The worker is
        killed rather than asked to exit: this runs when memory is about to
        run out, and SIGKILL returns its memory at once.
        """
        if self._parked or self._stopping or self.state in ("failed", "stopped"):
            return  # a failed supervisor stays failed: the front must exit non-zero
        self._parked = True
        self._unparked.clear()
        for gen in self._pending.values():
            gen.abort_reason = reason
        if self._proc is not None and self._proc.returncode is None and self.worker_pid:
            self._parked_proc = self._proc
            self._kill()
        if self._load_waiter is not None and not self._load_waiter.done():
            self._load_waiter.set_result({"op": "load_failed", "message": "parked"})
        if self.worker_pid is None and self.state != "parked":
            self._set_state("parked")  # between restarts: nothing to kill

    async def resume(self, n_ctx: int) -> None:
        """Start the parked worker with ``n_ctx`` (no-op unless parked)."""
        self.config = replace(self.config, n_ctx=n_ctx)
        if not self._parked or self._stopping:
            return
        self._parked = False
        self._set_state("loading")
        self._unparked.set()

    @property
    def parked(self) -> bool:
        return self._parked

    def _is_parked(self) -> bool:
        return self._parked

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._unparked.set()
        if self._writer is not None:
            with contextlib.suppress(WorkerGone, ConnectionError):
                self._send({"op": "shutdown"})
        if self._proc is not None and self._proc.returncode is None:
            try:
                await asyncio.wait_for(self._proc.wait(), timeout_s)
            except TimeoutError:
                self._kill()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout_s)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        await self._close_writer()  # no-op unless the loop never ran its cleanup

    @property
    def stopping(self) -> bool:
        return self._stopping

    # Requests

    def open_generation(self, params: Message) -> Generation:
        """Send a ``generate`` for ``params``; raise WorkerNotReady when not serving."""
        if self.state != "ready" or self._writer is None:
            raise WorkerNotReady(self.state)
        gen = Generation(self, next(self._ids))
        self._pending[gen.id] = gen
        self._send({**params, "op": "generate", "id": gen.id})
        return gen

    def cancel(self, rid: int) -> None:
        """Ask the worker to stop request ``rid`` before its next token (governor seam)."""
        if self._writer is not None:
            with contextlib.suppress(WorkerGone, ConnectionError):
                self._send({"op": "cancel", "id": rid})

    def pending_ids(self) -> list[int]:
        return list(self._pending)

    def abort(self, rid: int, reason: str) -> bool:
        """Stop generation ``rid`` on the server's behalf; its client gets 503 ``reason``."""
        gen = self._pending.get(rid)
        if gen is None:
            return False
        gen.abort_reason = reason
        self.cancel(rid)
        return True

    def drop_prefix_cache(self) -> None:
        """Make the worker forget its cached prompt prefix (after the running request)."""
        if self._writer is not None:
            with contextlib.suppress(WorkerGone, ConnectionError):
                self._send({"op": "reset_cache"})

    async def reload(self, n_ctx: int) -> int:
        """Recreate the engine with a new ``n_ctx`` inside the same worker process.

        The caller must hold the engine slot (no generation running). Returns the
        new n_ctx. If the worker fails to load, it is killed and restarted with
        the previous configuration by the supervisor loop.
        """
        if self.state != "ready" or self._writer is None:
            raise WorkerNotReady(self.state)
        new = replace(self.config, n_ctx=n_ctx)
        self._load_waiter = asyncio.get_running_loop().create_future()
        self._set_state("loading")
        self._send(new.to_message())
        msg = await self._load_waiter
        if msg["op"] != "loaded":
            self._kill()
            raise WorkerGone(f"reload to n_ctx {n_ctx} failed: {msg.get('message')}")
        self.config = new
        self._on_loaded(msg)
        return self.n_ctx


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "unknown status"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def worker_fault_log(state_dir: Path) -> Path:
    return state_dir / "faults" / "worker.log"


def front_fault_log(state_dir: Path) -> Path:
    return state_dir / "faults" / "front.log"
