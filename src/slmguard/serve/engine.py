"""The engine child: one ``llama-server`` process, started, watched, restarted, parked.

Owns the child's whole life (:class:`EngineProcess`: start, ready, restart with
backoff and a budget, reconfigure, park and resume, the replacement a recycle asks
for (``recycling`` set meanwhile, the front's calls held), its logs, how long its
loads take and when it is expected back: :meth:`EngineProcess.readiness`) and its states:
``loading``, ``ready``, ``restarting``, ``stalled`` (killed by the liveness
check, restart pending), ``parked``, ``failed``, ``stopped``. It knows nothing
of HTTP requests (the relay's), takes its command line from
:mod:`slmguard.serve.llamaserver` and its HTTP client from
:mod:`slmguard.serve.upstream`, and decides neither when the engine is stuck
(the liveness check's) nor when it shrinks or parks (the governor's).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from slmguard.atomicio import write_atomic
from slmguard.errors import EngineError, EngineLoadError, EngineUnreachableError
from slmguard.host.files import ROOT
from slmguard.host.process import has_ended
from slmguard.serve.llamaserver import EngineConfig, engine_argv
from slmguard.serve.readiness import Readiness
from slmguard.serve.upstream import EngineClient

log = logging.getLogger(__name__)
engine_log = logging.getLogger("slmguard.engine")

#: Beyond the supervisor's load timeout: its kill of a load that ran out and the state
#: change reach a caller's wait (:meth:`EngineProcess.load_bound_s`).
READY_GRACE_S = 10.0

#: How long a child the kernel shows ended may go unreported by the event loop (or its
#: output unended) before the supervisor takes it as exited (:meth:`EngineProcess._exit_of`).
LOST_EXIT_S = 10.0

#: What llama.cpp logs when the system refuses it memory while it loads (ggml's aligned
#: malloc, the model's mmap, a C++ allocation, a thread's stack: pthread_create's EAGAIN,
#: thrown as std::system_error), under an address-space or commit limit. ggml_init's
#: assert on its refused buffer is written at once; the "insufficient memory" line before
#: it goes through llama.cpp's log thread and is lost when the abort comes first.
MEMORY_REFUSED = ("insufficient memory", "Cannot allocate memory", "std::bad_alloc",
                  "failed to allocate", "Resource temporarily unavailable",
                  "GGML_ASSERT(ctx->mem_buffer != NULL)")  # fmt: skip

_PR_SET_PDEATHSIG = 1
SOCKET_NAME = "engine.sock"
KEY_NAME = "engine.key"


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


class LogRate:
    """At most ``per_s`` lines a second with bursts of ``burst`` (a token bucket)."""

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.per_s = per_s
        self.burst = float(burst)
        self.tokens = float(burst)
        self.clock = clock
        self.last = clock()
        self.dropped = 0

    def allow(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.per_s)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.dropped += 1
        return False


# The engine's output is chatter to the front's log: llama.cpp's warnings ("W", such as
# a model default it overrides) are INFO here and its info lines DEBUG; its errors stay
# errors. What matters to an operator is said by the front itself.
_LEVELS = {"E": logging.ERROR, "W": logging.INFO, "I": logging.DEBUG, "D": logging.DEBUG}


def engine_log_level(line: str) -> int:
    """The logging level of one llama.cpp log line (``--log-prefix``: ``0.00.001.818 I ...``);
    a line without the prefix (the engine's own prints, a C++ abort message) is INFO."""
    parts = line.split(" ", 2)
    if len(parts) >= 2 and len(parts[1]) == 1:
        return _LEVELS.get(parts[1], logging.INFO)
    return logging.INFO


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "unknown status"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _child_setup(oom_score_adj: int) -> Callable[[], None]:
    """What runs in the child between fork and exec (nothing that allocates or locks)."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    value = f"{oom_score_adj}\n".encode()

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        try:
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            try:
                os.write(fd, value)
            finally:
                os.close(fd)
        except OSError:
            pass  # the child runs anyway; the front logs its oom_score_adj after start

    return setup


def _close_transport(proc: asyncio.subprocess.Process) -> None:
    """Close what the event loop keeps of a child given up on (its pipes, its process
    handle): left open, they keep uvloop's close from ever returning."""
    transport: asyncio.SubprocessTransport | None = getattr(proc, "_transport", None)
    if transport is not None:
        with contextlib.suppress(ProcessLookupError):
            transport.close()


class EngineProcess:
    """Supervisor of the llama-server child. Create and start it in the server's event loop.

    - **start**: a fresh random API key in a 0600 file and a unix socket, both in a
      private runtime directory; the command line from
      :func:`slmguard.serve.llamaserver.engine_argv`, the front's environment with what
      :func:`~slmguard.serve.llamaserver.engine_env` adds (a Vulkan engine's shader
      cache); its own process group (so a kill reaches every thread and any helper it
      forks); before ``exec`` the child raises its own ``oom_score_adj`` (1000 by
      default: the kernel's first victim, the front survives) and asks to be SIGKILLed
      when the front dies (``PR_SET_PDEATHSIG``).
    - **ready**: ``GET /health`` on the socket answers 200 (llama-server says 503
      while it loads). A child that exits with a status before it was ever ready
      cannot load this model with these settings: that is
      :class:`~slmguard.errors.EngineLoadError` (exit 65) at once, with the
      engine's last log lines, not a restart loop.
    - **restart**: any other exit (a signal such as the OOM killer's SIGKILL, a
      crash, a stall kill) restarts it with exponential backoff; more than
      ``max_restarts`` within ``window_s`` and the state becomes ``failed``
      (the front exits 70 so systemd's own policy takes over).
    - **reconfigure**: the governor's shrink and grow: the child is replaced by one
      with new settings (fewer slots, a smaller context), which is the only way
      llama.cpp returns KV memory. Not a crash: no backoff, no budget spent.
    - **park / resume**: stop the child on purpose and keep it stopped (no restart,
      no budget spent) until resumed, the governor's last rung.
    - **logs**: the child's stdout and stderr go to the front's logging
      (logger ``slmguard.engine``, levels from llama.cpp's log prefix),
      rate-limited, and the last lines are kept for error messages and crash
      bundles.

    The callbacks are the server's: ``on_state(state)`` after every state change,
    ``on_restart()`` for each death followed by a restart, ``on_failed()`` once
    the restart budget is spent, the model cannot be loaded or the supervisor raised,
    ``on_exit(pid, rc)`` whenever a child ends (asyncio's status: a signal as its
    negative). ``log_name`` (a server of several models: the model's name) names its
    loggers' children.
    """

    def __init__(
        self,
        binary: Path,
        config: EngineConfig,
        policy: RestartPolicy,
        *,
        alias: str,
        runtime_dir: Path,
        version: str = "",
        oom_score_adj: int = 1000,
        load_timeout_s: float = 300.0,
        log_lines_per_s: float = 20.0,
        tail_lines: int = 200,
        on_state: Callable[[str], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        on_failed: Callable[[], None] | None = None,
        on_exit: Callable[[int, int | None], None] | None = None,
        env: Mapping[str, str] | None = None,
        log_name: str | None = None,
    ) -> None:
        # One engine of several logs under loggers named for its model (``log_name``).
        self.log = log if log_name is None else log.getChild(log_name)
        self.engine_log = engine_log if log_name is None else engine_log.getChild(log_name)
        self.binary = binary
        self.env = dict(env or {})  # added to the front's environment (engine_env)
        self.version = version  # the binary's `--version` line
        self.config = config
        self.policy = policy
        self.alias = alias
        self.runtime_dir = runtime_dir
        self.oom_score_adj = oom_score_adj
        self.load_timeout_s = load_timeout_s
        self.state = "loading"
        self.pid: int | None = None
        self.restarts = 0
        self.starts = 0
        self.stalls = 0
        self.spawn_failures = 0  # starts the system refused (fork, exec, the key file)
        self.lost_exits = 0  # children that ended without the event loop reporting it
        self.memory_refusals = 0  # loads the system refused memory, after one had served
        self._refusal: str | None = None  # the current child's line saying memory was refused
        self.load_error: EngineLoadError | None = None
        self.ready_since_s: float | None = None
        # From the child's start to its first 200 on /health, the last time it came up.
        self.last_load_s: float | None = None
        self._load_started_s: float | None = None  # monotonic; None unless loading
        self._restart_at_s: float | None = None  # the backoff's end; None unless backing off
        self._spawned_s: float | None = None
        self._consecutive = 0  # deaths in a row: the next backoff's exponent
        # Set while :mod:`slmguard.serve.recycle` drains and restarts it: the relay queues
        # new generations instead of refusing them while it is not ready.
        self.recycling = False
        self._calls_open = asyncio.Event()  # cleared while a recycle restarts the child
        self._calls_open.set()
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.client = EngineClient(runtime_dir / SOCKET_NAME)
        self.on_state = on_state
        self.on_restart = on_restart
        self.on_exit = on_exit
        self.on_failed = on_failed
        self._rate = LogRate(log_lines_per_s, burst=200)
        self._proc: asyncio.subprocess.Process | None = None
        self._expected_exit: set[int] = set()  # pids killed on purpose (reconfigure, park)
        self._on_purpose: collections.deque[int] = collections.deque(maxlen=64)  # and before
        self._task: asyncio.Task[None] | None = None
        self._log_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._parked = False
        self._unparked = asyncio.Event()
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()

    # ------------------------------------------------------------ state

    @property
    def n_ctx(self) -> int:
        return self.config.n_ctx

    @property
    def parked(self) -> bool:
        return self._parked

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        self.log.info("engine state: %s -> %s", self.state, state)
        self.state = state
        self.ready_since_s = time.monotonic() if state == "ready" else None
        if self.on_state is not None:
            self.on_state(state)
        asyncio.get_running_loop().create_task(self._notify_changed())

    async def _notify_changed(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def next_backoff_s(self, now_s: float) -> float:
        """The backoff a death noticed at ``now_s`` would wait (a child that ran longer
        than the restart window starts the doubling again)."""
        spawned = self._spawned_s
        fresh = spawned is None or now_s - spawned > self.policy.window_s
        return self.policy.delay_s(0 if fresh else self._consecutive)

    def readiness(self, now_s: float | None = None) -> Readiness:
        """What this supervisor knows now of when its engine serves again."""
        now = time.monotonic() if now_s is None else now_s
        restart_at, started = self._restart_at_s, self._load_started_s
        return Readiness(
            self.state,
            backoff_left_s=None if restart_at is None else max(0.0, restart_at - now),
            next_backoff_s=self.next_backoff_s(now),
            loading_for_s=None if started is None else max(0.0, now - started),
            last_load_s=self.last_load_s,
        )

    def hold_calls(self, held: bool) -> None:
        """Hold (True) or let through (False) the front's calls to the engine outside a
        generation (tokenize, apply-template): a recycle holds them while it restarts."""
        if held:
            self._calls_open.clear()
        else:
            self._calls_open.set()

    async def calls_open(self) -> None:
        """Return at once, or once a recycle's restart lets the front's calls through."""
        if not self._calls_open.is_set():
            await self._calls_open.wait()

    def load_bound_s(self) -> float:
        """How long a caller waits for a load this supervisor allows (it ends one itself
        past ``load_timeout_s``)."""
        return self.load_timeout_s + READY_GRACE_S

    async def wait_ready(self, timeout_s: float | None = None) -> bool:
        """True once the engine serves; False on timeout or when it can no longer get there
        (failed, stopped, or parked: a parked engine stays down until resumed)."""

        async def ready_or_final() -> None:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self.state in ("ready", "failed", "stopped", "parked")
                )

        try:
            await asyncio.wait_for(ready_or_final(), timeout_s)
        except asyncio.exceptions.TimeoutError:
            return False
        return self.state == "ready"

    # ------------------------------------------------------------ the child

    async def start(self, *, parked: bool = False) -> None:
        """Start the supervisor; ``parked``: with no child until :meth:`resume` (an
        on-demand model, loaded when a request needs it)."""
        if parked:
            self._parked = True
            self._unparked.clear()
        self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.runtime_dir, 0o700)
        (self.runtime_dir / "slots").mkdir(mode=0o700, exist_ok=True)
        self._supervise()

    def _supervise(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-supervisor")
        self._task.add_done_callback(self._supervisor_ended)

    def _supervisor_ended(self, task: asyncio.Task[None]) -> None:
        """A supervisor that raised is a failed engine, never a silent one: nothing would
        start the engine again while its state still said loading (the server's
        ``on_failed`` exits for systemd, or loads an on-demand model on its next request)."""
        err = None if task.cancelled() else task.exception()
        if err is None:
            return
        self.log.error("the engine's supervisor stopped: %r", err, exc_info=err)
        self.pid = None
        self._kill()  # a child it left behind
        if not self._stopping and self.state != "failed":
            self._fail()

    async def _spawn(self) -> asyncio.subprocess.Process:
        key = secrets.token_urlsafe(32)
        write_atomic(self.runtime_dir / KEY_NAME, (key + "\n").encode(), mode=0o600)
        sock = self.runtime_dir / SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        argv = engine_argv(
            self.binary,
            self.config,
            socket_path=sock,
            api_key_file=self.runtime_dir / KEY_NAME,
            alias=self.alias,
            slot_dir=self.runtime_dir / "slots",
        )
        await self.client.reset(key)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_child_setup(self.oom_score_adj),
            env={**os.environ, **self.env} if self.env else None,
            limit=1 << 20,
        )
        self._proc = proc
        self.pid = proc.pid
        self.starts += 1
        self._refusal = None
        self._log_task = asyncio.create_task(self._read_log(proc), name="engine-log")
        self.log.info(
            "engine started: pid %d, n_ctx %d, %d slot(s), %d threads",
            proc.pid, self.config.n_ctx, self.config.n_parallel, self.config.n_threads,
        )  # fmt: skip
        return proc

    async def _read_log(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            try:
                raw = await proc.stdout.readline()
            except ValueError:  # a line beyond the reader's limit: take what is there
                raw = await proc.stdout.read(1 << 16)
            if not raw:
                break
            line = raw.decode("utf-8", errors="replace").rstrip()
            if not line:
                continue
            self.tail.append(line)
            if self._refusal is None and any(sign in line for sign in MEMORY_REFUSED):
                self._refusal = line[-160:]  # kept: an abort's backtrace may follow it
            if self._rate.allow():
                if self._rate.dropped:
                    self.engine_log.warning(
                        "%d engine log lines dropped (rate limit)", self._rate.dropped
                    )
                    self._rate.dropped = 0
                self.engine_log.log(engine_log_level(line), "%s", line)

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> bool:
        """Poll the child's /health until 200 (True), or until it exits (False)."""
        deadline = time.monotonic() + self.load_timeout_s
        delay = 0.02
        exited = asyncio.ensure_future(proc.wait())
        try:
            while time.monotonic() < deadline:
                if exited.done() or has_ended(ROOT, proc.pid):
                    return False
                try:
                    status, _ = await self.client.get_json("/health", timeout_s=5.0, auth=False)
                    if status == 200:
                        return True
                except EngineUnreachableError:
                    pass
                await asyncio.wait({exited}, timeout=delay)
                delay = min(0.2, delay * 1.5)
            self.log.error(
                "engine did not become ready within %.0f s: killing it", self.load_timeout_s
            )
            self._kill(proc)
            return False
        finally:
            if not exited.done():
                exited.cancel()

    async def _exit_of(self, proc: asyncio.subprocess.Process) -> int | None:
        """``proc``'s exit status, once the event loop reports it; None when the kernel has
        shown the child ended (gone, or a zombie) for :data:`LOST_EXIT_S` and the report
        still has not come (logged): a supervisor waiting for it would never start the
        engine again (uvloop's libuv drops an exit whose status another waiter collected)."""
        waiting = asyncio.ensure_future(proc.wait())
        ended_at: float | None = None
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=1.0)
                if done:
                    return waiting.result()
                if not has_ended(ROOT, proc.pid):
                    ended_at = None
                    continue
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at >= LOST_EXIT_S:
                    break
        finally:
            if not waiting.done():
                waiting.cancel()
        self.lost_exits += 1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(proc.pid, os.WNOHANG)  # a zombie nobody else will collect
        self.log.warning(
            "engine pid %d ended but its exit was not reported in %.0f s: taken as exited",
            proc.pid, LOST_EXIT_S,
        )  # fmt: skip
        _close_transport(proc)
        return None

    async def _output_ended(self, proc: asyncio.subprocess.Process) -> None:
        """Wait for the child's output to end (its last lines logged), at most
        :data:`LOST_EXIT_S`: a pipe another process still holds never ends."""
        task = self._log_task
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=LOST_EXIT_S)
        if not done:
            task.cancel()
            self.log.warning(
                "the output of engine pid %d did not end with it in %.0f s: no longer read",
                proc.pid, LOST_EXIT_S,
            )  # fmt: skip
            _close_transport(proc)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _kill_if_parked(self, proc: asyncio.subprocess.Process) -> None:
        """park() ran while ``proc`` was being spawned (it found no child to stop): stop it."""
        if self._parked:
            self._on_purpose.append(proc.pid)
            self._expected_exit.add(proc.pid)
            self._kill(proc)

    def _kill(self, proc: asyncio.subprocess.Process | None = None) -> None:
        proc = proc or self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    def signal_child(self, sig: int) -> bool:
        """Send ``sig`` to the child's process group (tests, stall handling); False if none."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
            return True
        return False

    async def _run(self) -> None:
        budget = RestartBudget(self.policy)
        self._consecutive = 0
        ever_ready = False
        while not self._stopping:
            if self._parked:
                self._set_state("parked")
                await self._unparked.wait()
                self._consecutive = 0
                continue
            started = self._spawned_s = self._load_started_s = time.monotonic()
            if self.state not in ("loading",):
                self._set_state("loading")
            try:
                proc = await self._spawn()
            except OSError as err:
                # fork refused (ENOMEM under strict overcommit), the key file not written
                # (a full disk), the binary gone: a start that failed, retried as after a
                # crash; the supervisor must outlive it or nothing starts the engine again.
                self._load_started_s = None
                self.spawn_failures += 1
                self.log.error("could not start the engine: %s", err)
                if not await self._back_off(budget, started):
                    return
                continue
            self._kill_if_parked(proc)
            ready = await self._wait_ready(proc)
            self._load_started_s = None
            if ready and proc.returncode is None and proc.pid not in self._expected_exit:
                ever_ready = True
                self.last_load_s = time.monotonic() - started
                self._set_state("ready")
            rc = await self._exit_of(proc)
            if self.on_exit is not None:
                self.on_exit(proc.pid, rc)
            await self._output_ended(proc)
            self.pid = None
            expected = proc.pid in self._expected_exit
            self._expected_exit.discard(proc.pid)
            if self.stopping:  # stop() may have run during the awaits above
                break
            if expected:
                # reconfigure() or park() replaced or stopped it: not a crash.
                self.log.info("engine pid %d stopped on purpose (%s)", proc.pid, describe_exit(rc))
                self._consecutive = 0
                continue
            if not ready and not ever_ready and rc is not None and rc > 0:
                self._load_failed(rc)
                return
            refused = self._refusal if not ready and ever_ready else None
            if refused is not None:
                # This model loaded here before: memory is short now (a neighbour, a leak,
                # the commit limit), not the model or its settings. Retried with the
                # backoff, without spending the budget, until the memory is back (or the
                # governor parks it); failing would restart the whole service instead.
                self.memory_refusals += 1
                self.log.warning(
                    "engine exited while loading (%s): the system refused it memory (%s); "
                    "started again after its backoff",
                    describe_exit(rc), refused,
                )  # fmt: skip
                if not await self._back_off(budget, started, counted=False):
                    return
                continue
            self.log.error("engine exited (%s)", describe_exit(rc))
            if not await self._back_off(budget, started):
                return
        self._set_state("stopped")

    async def _back_off(
        self, budget: RestartBudget, started: float, *, counted: bool = True
    ) -> bool:
        """Count a restart and wait its backoff; False (failed) once the budget is spent
        (``counted`` False: a restart the budget does not limit)."""
        if time.monotonic() - started > self.policy.window_s:
            self._consecutive = 0
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart()
        if counted and not budget.allow(time.monotonic()):
            self.log.error(
                "engine restarted more than %d times in %.0f s: giving up",
                self.policy.max_restarts, self.policy.window_s,
            )  # fmt: skip
            self._fail()
            return False
        delay = self.policy.delay_s(self._consecutive)
        self._restart_at_s = time.monotonic() + delay
        if self.state != "stalled":
            self._set_state("restarting")
        await self._sleep(delay)
        self._restart_at_s = None
        self._consecutive += 1
        return True

    async def _sleep(self, seconds: float) -> None:
        """Back off, but wake early for stop() or park()."""
        self._wake.clear()
        with contextlib.suppress(asyncio.exceptions.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _load_failed(self, rc: int) -> None:
        lines = [ln for ln in self.tail if " E " in ln[:16] or "error" in ln.lower()]
        detail = (lines or list(self.tail) or ["no output"])[-1]
        self.load_error = EngineLoadError(
            self.config.model_path,
            f"llama-server could not load it ({describe_exit(rc)}): {detail[-300:]}",
            log_tail=tuple(self.tail)[-20:],
        )
        self.log.error("%s", self.load_error.message)
        self._fail()

    def _fail(self) -> None:
        self._set_state("failed")
        if self.on_failed is not None:
            self.on_failed()

    # ------------------------------------------------------------ governor and liveness verbs

    async def reconfigure(self, config: EngineConfig, timeout_s: float | None = None) -> None:
        """Replace the child by one started with ``config``; return once it serves.

        On failure (it does not come up), the previous settings are put back,
        the supervisor starts the engine with them again, and EngineError is
        raised. Requests running now end with an error (their caller aborts
        them first, with a reason, when it wants a clear 503).
        """
        if self.state in ("failed", "stopped") or self._stopping:
            raise EngineError(f"cannot reconfigure the engine: it is {self.state}")
        previous = self.config
        self.config = config
        if self._parked:
            return  # resume() starts it with the new settings
        self._replace_child()
        timeout = self.load_bound_s() if timeout_s is None else timeout_s
        if await self.wait_ready(timeout):
            return
        if self._parked:
            # The governor parked it while it loaded: it stays down, resume() starts
            # it with its own settings.
            raise EngineError(f"the engine was parked while starting with n_ctx {config.n_ctx}")
        if self.state in ("failed", "stopped"):
            raise EngineError(f"the engine {self.state} while starting with n_ctx {config.n_ctx}")
        self.config = previous
        self._replace_child()
        raise EngineError(
            f"the engine did not come up with n_ctx {config.n_ctx} and {config.n_parallel} "
            "slot(s); back to the previous settings"
        )

    def exited_on_purpose(self, pid: int | None) -> bool:
        """Whether child ``pid`` was (or is being) stopped by the server itself: a park or a
        reconfigure, not a crash or a stall."""
        return pid is not None and (pid in self._expected_exit or pid in self._on_purpose)

    def _replace_child(self) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            self._on_purpose.append(proc.pid)
            self._expected_exit.add(proc.pid)
            self._set_state("loading")
            self._kill(proc)

    async def park(self, reason: str) -> None:
        """Stop the child now and keep it stopped until :meth:`resume` (no restart counted)."""
        if self._parked or self._stopping or self.state in ("failed", "stopped"):
            return  # a failed supervisor stays failed: the front must exit non-zero
        self.log.warning("parking the engine: %s", reason)
        self._parked = True
        self._unparked.clear()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            self._on_purpose.append(proc.pid)
            self._expected_exit.add(proc.pid)
            self._kill(proc)
        self._set_state("parked")
        self._wake.set()

    async def resume(self, config: EngineConfig | None = None) -> None:
        """Start the parked engine (with ``config`` when given); no-op unless parked."""
        if config is not None:
            self.config = config
        if not self._parked or self._stopping:
            return
        self._parked = False
        self._set_state("loading")
        self._unparked.set()

    async def revive(self) -> None:
        """Start the supervisor of an engine that failed again, parked (an on-demand
        model whose engine gave up is loaded again by its next request: :meth:`resume`);
        no-op unless failed."""
        if self.state != "failed" or self._stopping:
            return
        self.load_error = None
        self._parked = True
        self._unparked.clear()
        self._supervise()

    def kill_stalled(self) -> None:
        """The liveness check found no progress: SIGKILL the whole group, restart as a crash."""
        if self._proc is None or self._proc.returncode is not None or self._parked:
            return
        self.stalls += 1
        self._set_state("stalled")
        self._kill(self._proc)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._unparked.set()
        self._wake.set()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.exceptions.TimeoutError:
                self._kill(proc)
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout_s)
            except asyncio.exceptions.TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            except Exception:  # the supervisor raised: _supervisor_ended logged it
                pass
        await self.client.aclose()
        if self.state != "failed":
            self._set_state("stopped")


def config_for_cells(planned: EngineConfig, n_ctx: int) -> EngineConfig:
    """The settings for ``n_ctx`` KV cells in all: fewer slots first, then a smaller context.

    Without a unified KV cache each slot owns ``n_ctx / n_parallel`` cells, so a
    smaller total first drops slots (each keeps the planned context length), and
    only at one slot does the context itself shrink. Growing back reverses it, up
    to the ``planned`` slot count. With a unified cache the slots share the
    cells: only the total changes.
    """
    if planned.kv_unified or planned.n_parallel <= 1:
        return replace(planned, n_ctx=n_ctx)
    per_slot = max(1, planned.n_ctx_slot)
    slots = max(1, min(planned.n_parallel, n_ctx // per_slot))
    cells = per_slot * slots if n_ctx >= per_slot else n_ctx
    return replace(planned, n_ctx=cells, n_parallel=slots)
