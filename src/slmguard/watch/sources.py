"""What the watcher reads each poll, gathered into one :class:`Snapshot`.

Owns the order of the reads and the server's ``/health`` and
``/api/v1/governor`` (through :mod:`slmguard.watch.client`). Host files come
through ``slmguard.host``: the memory cgroup (:mod:`~slmguard.host.cgroup`),
PSI (:mod:`~slmguard.host.psi`), meminfo and CMA (:mod:`~slmguard.host.procfs`),
open fds and DMA-BUF handles of the watched processes
(:mod:`~slmguard.host.process`), the system-wide DMA-BUF total
(:mod:`~slmguard.host.dmabuf`, the same number the doctor reports) and kernel
records (:mod:`~slmguard.host.kmsg`).

Every source is optional: a missing file or an unreachable server leaves its
fields ``None`` and adds a line to ``Snapshot.errors``; only the watcher's own
misconfiguration raises.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.errors import HostReadError
from slmguard.host import cgroup as cg
from slmguard.host.dmabuf import DmaBufTotals, read_dmabuf_totals
from slmguard.host.headroom import effective_limit
from slmguard.host.kmsg import OomKill
from slmguard.host.process import FdCounts, read_fd_counts
from slmguard.host.procfs import MemInfo, read_meminfo
from slmguard.host.psi import PROC_PRESSURE_MEMORY, Pressure, read_pressure
from slmguard.watch import client

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpStatus:
    """One GET against the server: status code and JSON body, or why it failed."""

    url: str
    status: int | None
    body: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


@dataclass(frozen=True)
class EngineProgress:
    """Whether the engine has work and a counter that moves while it makes progress.

    slmguard's server says both in /health (``in_flight``, ``engine.progress``);
    a bare llama-server (an engine not started by slmguard) does in ``/slots``
    (``is_processing``) and ``/metrics`` (``llamacpp:n_decode_total``, one per
    decode step, with ``--metrics``). llama-server answers those two from its
    decode loop and ``/health`` from its HTTP threads: when ``/health`` answers
    and ``/slots`` does not, the loop is stuck, reported as busy with the
    counter :data:`NO_ANSWER`, which never moves.
    """

    busy: bool
    counter: int


@dataclass(frozen=True)
class Snapshot:
    """Everything one poll saw. ``None``: that source was not configured or not readable."""

    mono_s: float
    unix_s: float
    cgroup: cg.CgroupMemory | None = None
    pressure: Pressure | None = None
    meminfo: MemInfo | None = None
    processes: tuple[FdCounts, ...] = ()
    system_dmabuf_bytes: int | None = None
    system_dmabuf_count: int | None = None
    health: HttpStatus | None = None
    governor: HttpStatus | None = None
    progress: EngineProgress | None = None
    kills: tuple[OomKill, ...] = ()
    kmsg_lost: int = 0
    service_present: bool | None = None  # None: no --unit to look for
    errors: tuple[str, ...] = ()

    @property
    def fd_count(self) -> int | None:
        return sum(p.fd_count for p in self.processes) if self.processes else None

    @property
    def dmabuf_count(self) -> int | None:
        return sum(p.dmabuf_count for p in self.processes) if self.processes else None

    @property
    def cma_total_bytes(self) -> int | None:
        return self.meminfo.cma_total_bytes if self.meminfo else None

    @property
    def cma_free_bytes(self) -> int | None:
        return self.meminfo.cma_free_bytes if self.meminfo else None

    def working_set(self, fallback_limit_bytes: int | None) -> tuple[int | None, int | None]:
        """(working set, limit) in bytes: the cgroup's, else the host's.

        The cgroup's limit is the one the governor compares with
        (:func:`slmguard.host.headroom.effective_limit` over its memory.high and
        memory.max, or v1's limit and an ancestor's smaller one). Without a
        cgroup: MemTotal - MemAvailable against ``fallback_limit_bytes`` (the
        plan's memory_high) or MemTotal. A cgroup without a limit is held
        against the same fallback.
        """
        c = self.cgroup
        m = self.meminfo
        ram = m.mem_total_bytes if m is not None else None
        if c is not None:
            # An unlimited cgroup is bounded by the plan's line, else by the RAM.
            limit, _ = effective_limit(c.limit_candidates)
            return c.working_set_bytes, limit or fallback_limit_bytes or ram
        if m is not None and m.mem_available_bytes is not None:
            return m.mem_total_bytes - m.mem_available_bytes, (
                fallback_limit_bytes or m.mem_total_bytes
            )
        return None, fallback_limit_bytes


# ---------------------------------------------------------------- readers


def health_field(health: HttpStatus | None, key: str) -> int | None:
    """An integer field of the server's /health JSON, dotted for nested ones
    (``engine.pid``, ``engine.restarts``, ``engine.stalls``)."""
    if health is None:
        return None
    value: Any = health.body
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


NO_ANSWER = -1


def _decode_total(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("llamacpp:n_decode_total"):
            try:
                return int(float(line.split()[-1]))
            except ValueError:
                return None
    return None


def read_engine_progress(
    base: str, health: HttpStatus | None, timeout_s: float
) -> EngineProgress | None:
    """The engine's progress view, from slmguard's /health or a bare llama-server."""
    if health is None or not isinstance(health.body, dict):
        return None
    if isinstance(health.body.get("engine"), dict):
        in_flight = health_field(health, "in_flight")
        counter = health_field(health, "engine.progress")
        if in_flight is None or counter is None:
            return None
        return EngineProgress(in_flight > 0, counter)
    slots = http_json(base + "/slots", timeout_s=timeout_s)
    if slots.status is None and health.ok:
        return EngineProgress(True, NO_ANSWER)  # /health answers, the decode loop does not
    if not slots.ok or not isinstance(slots.body, list):
        return None
    busy = any(isinstance(s, dict) and s.get("is_processing") for s in slots.body)
    try:
        status, raw = client.request(base + "/metrics", timeout_s=timeout_s)
    except (OSError, ValueError):
        return None
    total = _decode_total(raw.decode("utf-8", errors="replace")) if status == 200 else None
    return None if total is None else EngineProgress(busy, total)


def http_json(
    url: str,
    *,
    timeout_s: float,
    method: str = "GET",
    payload: Mapping[str, Any] | None = None,
    token: str | None = None,
) -> HttpStatus:
    """One JSON request; never raises for network or HTTP errors."""
    try:
        status, raw = client.request(
            url, method=method, payload=payload, token=token, timeout_s=timeout_s
        )
    except (OSError, ValueError) as err:
        return HttpStatus(url, None, error=str(err) or type(err).__name__)
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", errors="replace")[:2000]
    return HttpStatus(url, status, body=body)


@dataclass
class Collector:
    """Reads snapshots for one watched service (cgroup, pids, server)."""

    root: Path
    cgroup_dir: Path | None = None
    pids: Sequence[int] = ()
    server_url: str | None = None
    http_timeout_s: float = 2.0
    token: str | None = None  # admin token: the governor route may require it
    errors: list[str] = field(default_factory=list)

    def watched_pids(self) -> list[int]:
        found = list(self.pids)
        if self.cgroup_dir is not None:
            found += [p for p in cg.read_procs(self.cgroup_dir) if p not in found]
        return found

    def _try(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except HostReadError as err:
            self.errors.append(f"{what}: {err.message}")
            return None

    def _system_dmabuf(self) -> DmaBufTotals | None:
        # Most hosts have neither source (no debugfs access, no sysfs stats): that
        # is not worth an error line every poll; the doctor says why.
        try:
            return read_dmabuf_totals(self.root)
        except HostReadError:
            return None

    def read(self, kills: Sequence[OomKill] = (), kmsg_lost: int = 0) -> Snapshot:
        self.errors = []
        memory = None
        pressure = None
        if self.cgroup_dir is not None:
            memory = self._try("cgroup", cg.read_memory, self.cgroup_dir)
            psi_file = self.cgroup_dir / cg.V2_PRESSURE
            if psi_file.exists():
                pressure = self._try("psi", read_pressure, psi_file)
        if pressure is None:
            pressure = self._try("psi", read_pressure, self.root / PROC_PRESSURE_MEMORY)
        meminfo = self._try("meminfo", read_meminfo, self.root)
        health = governor = progress = None
        if self.server_url:
            base = self.server_url.rstrip("/")
            health = http_json(base + "/health", timeout_s=self.http_timeout_s)
            if health.status is not None:
                governor = http_json(
                    base + "/api/v1/governor", timeout_s=self.http_timeout_s, token=self.token
                )
                progress = read_engine_progress(base, health, self.http_timeout_s)
        pids = self.watched_pids()
        engine = health_field(health, "engine.pid")
        if engine is not None and engine not in pids:
            pids.append(engine)  # the engine holds the model and any DMA-BUFs
        processes = []
        for pid in pids:
            counts = self._try(f"pid {pid}", read_fd_counts, self.root, pid)
            if counts is not None:
                processes.append(counts)
        dmabuf = self._system_dmabuf()
        return Snapshot(
            mono_s=time.monotonic(),
            unix_s=time.time(),
            cgroup=memory,
            pressure=pressure,
            meminfo=meminfo,
            processes=tuple(processes),
            system_dmabuf_count=dmabuf.count if dmabuf else None,
            system_dmabuf_bytes=dmabuf.total_bytes if dmabuf else None,
            health=health,
            governor=governor,
            progress=progress,
            kills=tuple(kills),
            kmsg_lost=kmsg_lost,
            errors=tuple(self.errors),
        )
