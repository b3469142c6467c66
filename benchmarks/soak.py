"""A soak that compresses weeks: hours of mixed traffic against ``slmguard serve`` (issue 40).

``slmguard serve`` and ``slmguard watch`` run as a user runs them (subprocesses, the real
engine and the default model; the server in a real child memory cgroup where the host
allows one), their output read through pipes (what systemd would hand to the journal:
counted as log bytes, not as the processes' disk writes). Clients send, in a fixed
rotation: chat, completions, streams, streams the client drops after two events,
hostile bodies (malformed JSON, wrong types, absurd numbers, deep nesting, bad session
ids), session turns over a few sessions (now and then one deleted), and the admin trim.
Every ``--kill-every`` requests the engine is SIGKILLed; every ``--pressure-every`` a
neighbour in the server's cgroup grows until the governor sheds, holds, and leaves.
``--rate`` paces all clients together; each client retries as the official openai and
anthropic libraries do (see MAX_RETRIES). Answers are counted three ways: each request's
first answer, the retries' answers and what the client finally saw; every failed answer
(5xx, broken connection, error event) outside an injected fault's window is listed.

Recorded every ``--sample-every`` requests (1,000): the front's, the engine's and the
watcher's RssAnon + RssShmem + VmSwap and open fds, the state directory's bytes, the
session database's bytes (with -wal and -shm), the bytes written to storage by each
process (``/proc/<pid>/io`` ``write_bytes``, summed over every engine the soak saw), the
log bytes, and every answer by status and error code. Drift is the least-squares slope
of private bytes over the samples from ``--warmup`` requests on. Then ``--idle-s`` seconds
with no traffic: the bytes written per idle hour. Results: ``--json`` and, unless
``--no-write``, benchmarks/RESULTS.md section ``## soak``. ``--quick`` is the short form
``make test`` runs (no timing asserts).

Usage: ``.venv/bin/python benchmarks/soak.py --duration-s 6300 --idle-s 300 --rate 2``;
the figures before a change: ``--server-src DIR/src`` with ``git archive COMMIT | tar -x
-C DIR``; a long run that later edits cannot change: this commit unpacked so, its
``benchmarks/soak.py`` run with ``--server-src DIR/src --write --results-md`` the tree's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from governor import Hogs, Neighbour, load_average  # noqa: E402
from results_md import RESULTS, write_section  # noqa: E402

import realcgroup  # noqa: E402
from slmguard.host.footprint import read_footprint, read_io  # noqa: E402

SECTION = "## soak"
MIB = 1 << 20
MODEL = "gemma-3-270m-q4_k_m"
SLMGUARD = str(Path(sys.executable).with_name("slmguard"))
ADMIN = "soak-admin-token"
# A client retrying as the official openai (3.57) and anthropic (2.15) Python libraries do
# by default (_constants.py, _base_client.py): up to 2 retries of a 408, 409, 429 or 5xx
# answer or a broken connection, after the answer's Retry-After when it says 0-120 s
# (openai's bound; anthropic honours any positive one), else after min(0.5 * 2**retry, 8)
# s less up to 25 % jitter. A stream is retried only when its answer is not a 200 (an
# error event inside a stream is not retried).
MAX_RETRIES = 2
MAX_RETRY_AFTER_S = 120.0
RETRIED = (408, 409, 429)
FAULT_GRACE_S = 1.0  # a fault's window stays open this long after the server is back
HOSTILE: list[bytes | dict[str, Any]] = [
    b'{"model": "m", "messages": [',  # malformed JSON
    {"model": MODEL, "messages": "hello"},  # a string for a list
    {"model": MODEL, "prompt": "x", "max_tokens": 10**15},  # an absurd number
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "session_id": "../../etc"},
    {"model": MODEL, "prompt": "x", "n": 999},
    {"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(5000)}},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "unknown_field": 1},
]
NESTED = b'{"model": "m", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"


# ---------------------------------------------------------------- processes


@dataclass
class Piped:
    """A child whose output is read (and counted) by a thread: the journal's share."""

    proc: subprocess.Popen[bytes]
    keep: Path | None = None  # a copy of the output, outside the measured state directory
    log_bytes: int = 0
    log_lines: int = 0
    tail: list[str] = field(default_factory=list)
    reader: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.ExitStack() as stack:
            copy = stack.enter_context(self.keep.open("ab")) if self.keep else None
            for raw in self.proc.stdout:
                self.log_bytes += len(raw)
                self.log_lines += 1
                self.tail = [*self.tail[-40:], raw.decode("utf-8", "replace").rstrip()]
                if copy is not None:
                    copy.write(raw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.reader.join(10)  # the pipe ends with the process
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn(
    argv: list[str], cg: realcgroup.RealCgroup | None, keep: Path | None = None,
    src: Path | None = None,
) -> Piped:  # fmt: skip
    """``argv`` as a child (in ``cg``); ``src``: slmguard imported from that tree instead."""
    cmd = cg.command(argv) if cg is not None else argv
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLMGUARD_")}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip
    return Piped(proc, keep)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(url: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    return data


def wait_ready(url: str, server: Piped, bound_s: float = 600.0) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError("server exited:\n" + "\n".join(server.tail))
        h = health(url)
        if h is not None and h.get("state") in ("ready", "degraded"):
            return
        time.sleep(0.5)
    raise RuntimeError("server not ready:\n" + "\n".join(server.tail))


# ---------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Answer:
    """One HTTP answer: its label ("200", "503 engine_restarting", "transport ..."), status
    (0: no answer) and Retry-After header."""

    label: str
    status: int = 0
    retry_after: str | None = None

    @property
    def failed(self) -> bool:
        """A server failure: a 5xx, a broken connection, an error event inside a stream."""
        return self.status >= 500 or self.label.startswith(("transport", "200 stream-error"))

    def retried(self) -> bool:
        """What the openai and anthropic clients retry (not after too long a Retry-After)."""
        with contextlib.suppress(TypeError, ValueError):
            if float(self.retry_after) > MAX_RETRY_AFTER_S:  # type: ignore[arg-type]
                return False
        return self.status in RETRIED or self.status >= 500 or self.label.startswith("transport")


def client_delay(answer: Answer, retry: int) -> float:
    """The pause before retry number ``retry`` (0-based), as the libraries compute it."""
    with contextlib.suppress(TypeError, ValueError):
        after = float(answer.retry_after)  # type: ignore[arg-type]
        if 0 < after <= MAX_RETRY_AFTER_S:
            return after
    return min(0.5 * 2**retry, 8.0) * (1 - 0.25 * random.random())


@dataclass
class Traffic:
    """Client threads sending the rotation (paced to ``rate`` requests per second, all
    together, when it is set) and retrying as the official clients do; answers counted
    by status and error code: the first answer, the retries' answers, the final one."""

    url: str
    clients: int
    rate: float | None = None
    outcomes: Counter[str] = field(default_factory=Counter)  # each request's first answer
    retry_answers: Counter[str] = field(default_factory=Counter)
    final: Counter[str] = field(default_factory=Counter)  # what the caller finally sees
    no_retry_after: Counter[str] = field(default_factory=Counter)  # 429/503 without it
    retry_after: Counter[str] = field(default_factory=Counter)  # "503 code N": N seconds
    failures: list[dict[str, Any]] = field(default_factory=list)  # every failed answer
    sent: int = 0
    next_slot: float = 0.0
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(self.clients):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self.workers.append(t)

    def _next(self) -> int | None:
        """The next request's number, once the pace allows it (None: stopping)."""
        with self.lock:
            now = time.monotonic()
            slot = max(now, self.next_slot)
            if self.rate:
                self.next_slot = slot + 1.0 / self.rate
        if self.stop.wait(slot - now) or self.stop.is_set():
            return None
        with self.lock:
            self.sent += 1
            return self.sent

    def _answer(self, client: httpx.Client, n: int, worker: int, attempt: int) -> Answer:
        t = time.monotonic()
        try:
            answer = one(client, self.url, n, worker)
        except httpx.HTTPError as err:
            answer = Answer(f"transport {type(err).__name__}")
        with self.lock:
            (self.outcomes if attempt == 0 else self.retry_answers)[answer.label] += 1
            if answer.status in (429, 503):
                self.retry_after[f"{answer.label} {answer.retry_after}"] += 1
                if answer.retry_after is None:
                    self.no_retry_after[answer.label] += 1
            if answer.failed and len(self.failures) < 10000:
                self.failures.append({
                    "n": n, "attempt": attempt, "label": answer.label,
                    "start_s": round(t - self.t0, 2),
                    "end_s": round(time.monotonic() - self.t0, 2)})  # fmt: skip
        return answer

    def _run(self, worker: int) -> None:
        with httpx.Client(timeout=600) as client:
            while (n := self._next()) is not None:
                answer = self._answer(client, n, worker, 0)
                for retry in range(MAX_RETRIES):
                    if not answer.retried() or self.stop.wait(client_delay(answer, retry)):
                        break
                    answer = self._answer(client, n, worker, retry + 1)
                with self.lock:
                    self.final[answer.label] += 1

    def finish(self) -> None:
        self.stop.set()
        for t in self.workers:
            t.join(600)


def _answer(resp: httpx.Response) -> Answer:
    try:
        code = resp.json().get("error", {}).get("code")
    except (ValueError, AttributeError):
        code = None
    label = f"{resp.status_code}" + (f" {code}" if code and resp.status_code != 200 else "")
    return Answer(label, resp.status_code, resp.headers.get("retry-after"))


def _stream(client: httpx.Client, url: str, body: dict[str, Any], drop: bool) -> Answer:
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return _answer(resp)
        events = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events += 1
                if '"error"' in line:
                    return Answer(f"200 stream-error {_event_code(line[6:])}", 200)
                if drop and events >= 2:
                    return Answer("disconnect", 200)
        return Answer("200", 200)


def _event_code(data: str) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(data).get("error", {}).get("code"))
    return "unreadable"


def one(client: httpx.Client, url: str, n: int, worker: int) -> Answer:
    """The ``n``-th request of the rotation and its answer ("200", "503 engine_restarting"...)."""
    kind = n % 20
    say = [{"role": "user", "content": f"Say {n % 13} words."}]
    if kind in (0, 1, 2, 3, 4):
        resp = client.post(url + "/v1/chat/completions",
                           json={"model": MODEL, "messages": say, "max_tokens": 4})  # fmt: skip
    elif kind in (5, 6, 7, 8):
        count = {"model": MODEL, "prompt": f"Count {n}:", "max_tokens": 4}
        resp = client.post(url + "/v1/completions", json=count)
    elif kind in (9, 10, 11):
        return _stream(client, url, {"model": MODEL, "messages": say, "max_tokens": 8,
                                     "stream": True}, drop=kind == 11)  # fmt: skip
    elif kind in (12, 13):
        hostile = HOSTILE[n % len(HOSTILE)] if kind == 12 else NESTED
        data = hostile if isinstance(hostile, bytes) else json.dumps(hostile).encode()
        resp = client.post(url + "/v1/completions", content=data,
                           headers={"Content-Type": "application/json"})  # fmt: skip
    elif kind in (14, 15, 16, 17):
        sid = f"soak-{worker}-{(n // 200) % 4}"
        if n % 400 == 14:
            resp = client.delete(url + f"/v1/sessions/{sid}")
        else:
            resp = client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": say, "max_tokens": 4, "session_id": sid})  # fmt: skip
    elif kind == 18 and n % 100 == 18:
        resp = client.post(url + "/api/v1/context/trim", json={"keep_recent": 256},
                           headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
    else:
        resp = client.get(url + "/v1/models")
    return _answer(resp)


# ---------------------------------------------------------------- measuring


def fds(pid: int | None) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd")) if pid else None
    except OSError:
        return None


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


@dataclass
class Writes:
    """write_bytes per process, summed over every pid a role had (engines restart)."""

    done: Counter[str] = field(default_factory=Counter)
    last: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (pid, bytes)

    def see(self, role: str, pid: int | None) -> None:
        io = read_io(pid=pid) if pid else None
        prev = self.last.get(role)
        if prev is not None and prev[0] != pid:
            self.done[role] += prev[1]  # that process has gone: its count is final
            del self.last[role]
        if io is not None and pid is not None:
            self.last[role] = (pid, io.stored_bytes)

    def total(self, role: str) -> int:
        return self.done[role] + (self.last[role][1] if role in self.last else 0)


def sample(ctx: Soak) -> dict[str, Any]:
    h = health(ctx.url) or {}
    engine = (h.get("engine") or {}).get("pid")
    front, watcher = ctx.server.proc.pid, ctx.watcher.proc.pid if ctx.watcher else None
    for role, pid in (("front", front), ("engine", engine), ("watcher", watcher)):
        ctx.writes.see(role, pid)
    out: dict[str, Any] = {"requests": ctx.traffic.sent, "t_s": round(time.monotonic() - ctx.t0),
                           "engine_pid": engine}  # fmt: skip
    for role, pid in (("front", front), ("engine", engine), ("watcher", watcher)):
        fp = read_footprint(pid=pid) if pid else None
        out[f"{role}_private_bytes"] = fp.private_bytes if fp else None
        out[f"{role}_fds"] = fds(pid)
        out[f"{role}_written_bytes"] = ctx.writes.total(role)
    db = ctx.state / "sessions.sqlite3"
    files = (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"))
    out["sqlite_bytes"] = sum(p.stat().st_size for p in files if p.exists())
    out["state_bytes"] = dir_bytes(ctx.state)
    out["log_bytes"] = ctx.server.log_bytes + (ctx.watcher.log_bytes if ctx.watcher else 0)
    out["engine_restarts"] = (h.get("engine") or {}).get("restarts")
    out["governor_level"] = ((h.get("extra") or {}).get("governor") or {}).get("level")
    with ctx.traffic.lock:
        out["outcomes"] = dict(ctx.traffic.outcomes)
    return out


# ---------------------------------------------------------------- the run


@dataclass
class Soak:
    url: str
    state: Path
    server: Piped
    watcher: Piped | None
    traffic: Traffic
    cg: realcgroup.RealCgroup | None
    t0: float = field(default_factory=time.monotonic)
    writes: Writes = field(default_factory=Writes)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: Counter[str] = field(default_factory=Counter)
    faults: list[dict[str, Any]] = field(default_factory=list)  # injected, with their windows

    def now_s(self) -> float:
        return round(time.monotonic() - self.t0, 2)


def back(ctx: Soak, old_pid: int | None, bound_s: float = 600.0) -> bool:
    """Wait until the server is ready again with a running engine (another one than
    ``old_pid`` when given) and the governor's level is normal."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        h = health(ctx.url) or {}
        eng = h.get("engine") or {}
        level = ((h.get("extra") or {}).get("governor") or {}).get("level")
        if (
            h.get("state") == "ready"
            and eng.get("state") == "ready"
            and eng.get("pid") not in (None, old_pid)
            and level in ("normal", None)
        ):
            return True
        time.sleep(0.25)
    return False


def close_window(ctx: Soak, fault: dict[str, Any], old_pid: int | None) -> None:
    """A thread: the fault's window ends once the server is back (plus a grace)."""

    def wait() -> None:
        fault["recovered"] = back(ctx, old_pid)
        fault["end_s"] = round(ctx.now_s() + FAULT_GRACE_S, 2)

    threading.Thread(target=wait, daemon=True).start()


def kill_engine(ctx: Soak) -> None:
    pid = ((health(ctx.url) or {}).get("engine") or {}).get("pid")
    if isinstance(pid, int):
        fault: dict[str, Any] = {"kind": "engine kill", "start_s": ctx.now_s(), "end_s": None}
        ctx.faults.append(fault)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        ctx.events["engine kills"] += 1
        close_window(ctx, fault, pid)


def pressure_cycle(ctx: Soak) -> None:
    """A neighbour in the server's cgroup grows until the governor sheds, then leaves."""
    if ctx.cg is None:
        return
    gov = (health(ctx.url) or {}).get("extra", {}).get("governor", {})
    usage = int((ctx.cg.path / "memory.usage_in_bytes").read_text()) if ctx.cg.version == 1 \
        else int((ctx.cg.path / "memory.current").read_text())  # fmt: skip
    want = int(0.88 * ctx.cg.limit_bytes) - usage
    if want < MIB or gov.get("level") not in ("normal", None):
        return
    fault: dict[str, Any] = {"kind": "pressure cycle", "start_s": ctx.now_s(), "end_s": None}
    ctx.faults.append(fault)
    neighbour = Neighbour(ctx.cg)
    try:
        neighbour.grow(want // MIB)
        time.sleep(5)
    finally:
        neighbour.stop()
    ctx.events["pressure cycles"] += 1
    fault["recovered"] = back(ctx, None)
    fault["end_s"] = round(ctx.now_s() + FAULT_GRACE_S, 2)


def run_traffic(ctx: Soak, args: argparse.Namespace) -> None:
    deadline = ctx.t0 + args.duration_s
    next_sample, next_kill, next_pressure = 0, args.kill_every, args.pressure_every
    ctx.traffic.start()
    while time.monotonic() < deadline and ctx.server.proc.poll() is None:
        time.sleep(0.5)
        sent = ctx.traffic.sent
        if sent >= next_sample:
            ctx.samples.append(sample(ctx))
            print(json.dumps(ctx.samples[-1]), flush=True)
            next_sample += args.sample_every
        if args.kill_every and sent >= next_kill:
            kill_engine(ctx)
            next_kill += args.kill_every
        if args.pressure_every and sent >= next_pressure:
            pressure_cycle(ctx)
            next_pressure += args.pressure_every
    ctx.traffic.finish()
    ctx.samples.append(sample(ctx))


def measure_idle(ctx: Soak, idle_s: float) -> dict[str, Any]:
    """No traffic for ``idle_s``: what each process writes, per hour."""
    before = sample(ctx)
    time.sleep(idle_s)
    after = sample(ctx)
    per_hour = 3600.0 / idle_s
    return {
        "idle_s": idle_s,
        **{
            f"{role}_written_bytes_per_hour": round(
                (after[f"{role}_written_bytes"] - before[f"{role}_written_bytes"]) * per_hour
            )
            for role in ("front", "engine", "watcher")
        },
        "log_bytes_per_hour": round((after["log_bytes"] - before["log_bytes"]) * per_hour),
    }


@contextlib.contextmanager
def service(args: argparse.Namespace, state: Path) -> Iterator[Soak]:
    """The server (in a cgroup when one can be made) and the watcher, stopped after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state.mkdir(parents=True, exist_ok=True)
    token = state.parent / "admin-token"
    token.write_text(ADMIN + "\n")
    token.chmod(0o600)
    with contextlib.ExitStack() as stack:
        cg = None
        if not args.no_cgroup and realcgroup.unavailable_reason() is None:
            cg = stack.enter_context(
                realcgroup.memory_cgroup(args.limit_mib * MIB, "slmguard-soak")
            )
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
        serve_log = args.logs / "serve.log" if args.logs else None
        server = spawn([SLMGUARD, "serve", "--port", str(port), "--state-dir", str(state),
                        "--ctx", "512", "--n-parallel", "2", "--queue-size", "16",
                        "--admin-token-file", str(token)], cg, serve_log,
                       args.server_src)  # fmt: skip
        stack.callback(server.stop)
        wait_ready(url, server)
        watcher = None
        if not args.no_watch:
            watcher = spawn([SLMGUARD, "watch", "--server", url, "--pid", str(server.proc.pid),
                             "--state-dir", str(state / "watch"), "--interval", "5",
                             "--admin-token-file", str(token)], None,
                            args.logs / "watch.log" if args.logs else None,
                            args.server_src)  # fmt: skip
            stack.callback(watcher.stop)
        traffic = Traffic(url, args.clients, args.rate)
        yield Soak(url, state, server, watcher, traffic, cg, t0=traffic.t0)


def pooled_slope(groups: list[list[tuple[float, float]]]) -> float | None:
    """The least-squares slope of y on x within each group (one line per group, the same
    slope): a restarted engine starts a new group."""
    num = den = 0.0
    for pts in groups:
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        num += sum((x - mx) * (y - my) for x, y in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
    return num / den if den > 0 else None


def drift(samples: list[dict[str, Any]], role: str, warmup: int) -> dict[str, Any]:
    """``role``'s private bytes per 10,000 requests: the least-squares slope over each
    process's samples from ``warmup`` requests after it was first seen on (a restarted
    engine warms up again), one slope for all of them."""
    groups: dict[Any, list[tuple[float, float]]] = {}
    first: dict[Any, int] = {}
    for x in samples:
        value = x.get(f"{role}_private_bytes")
        if value is None:
            continue
        key = x.get("engine_pid") if role == "engine" else role
        first.setdefault(key, x["requests"])
        if x["requests"] >= first[key] + warmup:
            groups.setdefault(key, []).append((x["requests"], value))
    used = sorted(r for pts in groups.values() for r, _ in pts)
    slope = pooled_slope(list(groups.values()))
    return {
        "per_10000_bytes": None if slope is None else round(slope * 10000),
        "samples": len(used),
        "from_request": used[0] if used else None,
        "to_request": used[-1] if used else None,
        "processes": len(groups),
    }


def unexplained(
    failures: list[dict[str, Any]], faults: list[dict[str, Any]], end_s: float
) -> list[dict[str, Any]]:
    """Every failed answer (5xx, broken connection, error event) that did not overlap an
    injected fault's window (an engine kill until the engine is back, a pressure cycle
    until the governor is normal again; a window still open ends at ``end_s``)."""
    windows = [(f["start_s"], end_s if f["end_s"] is None else f["end_s"]) for f in faults]
    return [f for f in failures
            if not any(f["start_s"] <= b and f["end_s"] >= a for a, b in windows)]  # fmt: skip


def failed_count(outcomes: dict[str, int]) -> int:
    """The failed answers among ``outcomes`` (labels as :class:`Answer` makes them)."""
    total = 0
    for label, n in outcomes.items():
        status = int(label.split()[0]) if label[:1].isdigit() else 0
        total += n if Answer(label, status).failed else 0
    return total


def summary(ctx: Soak, idle: dict[str, Any] | None, warmup: int) -> dict[str, Any]:
    first, last = ctx.samples[0], ctx.samples[-1]
    last["outcomes"] = dict(ctx.traffic.outcomes)  # the answers of the last requests too
    n = max(1, last["requests"] - first["requests"])

    def per_1000(key: str) -> float | None:
        a, b = first.get(key), last.get(key)
        return None if a is None or b is None else round((b - a) * 1000 / n)

    front = per_1000("front_private_bytes")
    return {
        "requests": last["requests"],
        "duration_s": last["t_s"],
        "outcomes": last["outcomes"],
        "retry_answers": dict(ctx.traffic.retry_answers),
        "final_outcomes": dict(ctx.traffic.final),
        "failed_first": failed_count(ctx.traffic.outcomes),
        "failed_final": failed_count(ctx.traffic.final),
        "unexplained_failures": unexplained(ctx.traffic.failures, ctx.faults, ctx.now_s()),
        "no_retry_after": dict(ctx.traffic.no_retry_after),
        "retry_after": dict(ctx.traffic.retry_after),
        "events": dict(ctx.events),
        "faults": ctx.faults,
        "rate": ctx.traffic.rate,
        "drift_from_first_sample_per_10000_bytes": None if front is None else 10 * front,
        "drift": {r: drift(ctx.samples, r, warmup) for r in ("front", "engine", "watcher")},
        "front_fds_first_last": (first["front_fds"], last["front_fds"]),
        "written_per_1000_bytes": {
            r: per_1000(f"{r}_written_bytes") for r in ("front", "engine", "watcher")
        },
        "log_per_1000_bytes": per_1000("log_bytes"),
        "sqlite_bytes_last": last["sqlite_bytes"],
        "state_bytes_last": last["state_bytes"],
        "idle": idle,
        "cgroup": ctx.cg is not None,
        "server_exit": ctx.server.proc.poll(),  # None: it served to the end
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--idle-s", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rate", type=float, default=None,
                    help="requests per second, all clients together (default: as fast as "
                    "the server answers)")  # fmt: skip
    ap.add_argument("--sample-every", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=1000,
                    help="drift slopes use each process's samples from this many requests after it "
                    "was first seen")  # fmt: skip
    ap.add_argument("--kill-every", type=int, default=2500)
    ap.add_argument("--pressure-every", type=int, default=3000)
    ap.add_argument("--limit-mib", type=int, default=768, help="the server's cgroup limit")
    ap.add_argument("--logs", type=Path, help="keep the server's and watcher's output here")
    ap.add_argument("--server-src", type=Path,
                    help="run serve and watch from this src/ (an older commit unpacked by "
                    "`git archive`: the before figures); not written to RESULTS.md")  # fmt: skip
    ap.add_argument("--hogs", type=int, default=0)
    ap.add_argument("--no-cgroup", action="store_true")
    ap.add_argument("--no-watch", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the short form make test runs")
    ap.add_argument("--json", type=Path, help="write the samples and the summary here")
    ap.add_argument("--state-root", type=Path, help="where the state directory goes")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--write", action="store_true",
                    help="write RESULTS.md even with --server-src (a frozen copy of this "
                    "commit, so that later edits cannot change a long run)")  # fmt: skip
    ap.add_argument("--results-md", type=Path, default=RESULTS,
                    help="the RESULTS.md the section goes to (default: the one beside this "
                    "script)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.duration_s, args.idle_s, args.sample_every = 60.0, 10.0, 50
        args.kill_every, args.pressure_every, args.no_write = 120, 0, True
        args.warmup = 100
    if args.server_src is not None and not args.write:
        args.no_write = True  # the section is the current tree's; the caller quotes these
    started = load_average()
    with (
        tempfile.TemporaryDirectory(prefix="slmguard-soak-", dir=args.state_root) as tmp,
        Hogs(args.hogs),
        service(args, Path(tmp) / "state") as ctx,
    ):
        run_traffic(ctx, args)
        idle = measure_idle(ctx, args.idle_s) if args.idle_s > 0 else None
        result = {"samples": ctx.samples, "summary": summary(ctx, idle, args.warmup)}
    result["load"] = {"start": started, "end": load_average()}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if not args.no_write:
        write_section(SECTION, render(result, args), args.results_md)
    return 0


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    s, samples = result["summary"], result["samples"]
    where = f"in a real memory cgroup of {args.limit_mib} MiB" if s["cgroup"] else "no cgroup"
    pace = f"paced to {args.rate:g} requests/s" if args.rate else "unpaced"
    src = f" serve and watch from `--server-src {args.server_src}`;" if args.server_src else ""
    lines = [
        SECTION, "",
        f"`benchmarks/soak.py --duration-s {args.duration_s:.0f} --idle-s {args.idle_s:.0f}"
        f"{f' --rate {args.rate:g}' if args.rate else ''} --sample-every {args.sample_every}` "
        f"(issue 40):{src} "
        f"`slmguard serve` (`--ctx 512 --n-parallel 2`, {where})"
        f" and `slmguard watch`, {args.clients} clients {pace} (the rotation of 20: 5 chats "
        f"and 4 completions of max_tokens 4, 3 streams of max_tokens 8 (one dropped after "
        f"two events), 2 hostile bodies, 4 session turns, 2 model lists (a trim every 100th)),"
        f" retrying as the openai and anthropic clients do (up to {MAX_RETRIES} retries of a "
        f"408/409/429/5xx or broken connection, after Retry-After), the engine SIGKILLed every "
        f"{args.kill_every} requests, a neighbour pressing the cgroup to shed every "
        f"{args.pressure_every}; {args.hogs} CPU hogs. Load average {result['load']['start']} "
        f"to {result['load']['end']}.", "",
        f"{s['requests']} requests in {s['duration_s']} s; events {s['events']}.", "",
        f"- first answers `{json.dumps(s['outcomes'], sort_keys=True)}`",
        f"- answers to the retries `{json.dumps(s['retry_answers'], sort_keys=True)}`",
        f"- what the client finally saw `{json.dumps(s['final_outcomes'], sort_keys=True)}`",
        f"- failed (5xx, broken connection, error event): {s['failed_first']} first answers, "
        f"**{s['failed_final']} after the retries**; not during an injected fault's window: "
        f"**{len(s['unexplained_failures'])}** {s['unexplained_failures'][:20]}",
        f"- 429/503 without Retry-After: {s['no_retry_after'] or 0}; Retry-After sent "
        f"`{json.dumps(s['retry_after'], sort_keys=True)}`",
        f"- injected faults (window: until the engine and governor are back, +"
        f"{FAULT_GRACE_S:g} s): {[(f['kind'], f['start_s'], f['end_s']) for f in s['faults']]}",
    ]  # fmt: skip
    for role, d in s["drift"].items():
        lines.append(
            f"- {role} drift {d['per_10000_bytes']} bytes per 10,000 requests (least squares "
            f"over {d['samples']} samples, requests {d['from_request']}-{d['to_request']}, "
            f"{d['processes']} process(es), each from {args.warmup} requests after it was "
            "first seen)"
        )
    lines += [
        f"- front: from the first sample (warm-up included) "
        f"{s['drift_from_first_sample_per_10000_bytes']} bytes per 10,000 requests; fds "
        f"{s['front_fds_first_last'][0]} -> {s['front_fds_first_last'][1]}",
        f"- written to storage per 1,000 requests: {s['written_per_1000_bytes']}; log "
        f"(journal) {s['log_per_1000_bytes']} bytes",
        f"- idle: {s['idle']}",
        f"- state directory {s['state_bytes_last']} bytes at the end, "
        f"SQLite {s['sqlite_bytes_last']}",
        "",
        "| requests | s | front MiB | front fds | engine MiB | engine fds | watch MiB | "
        "state KiB | SQLite KiB | written KiB (front/engine/watch) | log KiB | restarts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip

    def mib(v: Any) -> str:
        return "-" if v is None else f"{v / MIB:.1f}"

    for x in samples:
        lines.append(
            f"| {x['requests']} | {x['t_s']} | {mib(x['front_private_bytes'])} | "
            f"{x['front_fds']} | {mib(x['engine_private_bytes'])} | {x['engine_fds']} | "
            f"{mib(x['watcher_private_bytes'])} | {x['state_bytes'] // 1024} | "
            f"{x['sqlite_bytes'] // 1024} | {x['front_written_bytes'] // 1024}/"
            f"{x['engine_written_bytes'] // 1024}/{x['watcher_written_bytes'] // 1024} | "
            f"{x['log_bytes'] // 1024} | {x['engine_restarts']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
