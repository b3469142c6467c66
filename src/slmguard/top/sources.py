"""One refresh of ``slmguard top``: ask the server, read the board, keep the deltas.

Owns :class:`Collector`, the only stateful part of top: it remembers the
previous refresh so that CPU load (two ``/proc/stat`` reads), memory.events
deltas, token rates, x86 throttle counts and the events timeline can be
computed. Each :meth:`Collector.poll` returns a frozen
:class:`~slmguard.top.snapshot.TopSnapshot`.

Where top runs on the board (by default: when ``--server`` is a loopback
address) it reads, through :mod:`slmguard.host` only: the service's memory
cgroup (``--cgroup``, else the cgroup systemd gives ``--unit``, looked up
again each refresh, else the cgroup of the engine pid that /health names),
PSI (the cgroup's ``memory.pressure``, else ``/proc/pressure/memory``),
meminfo, zram, per-core CPU time, cpufreq, thermal zones, cooling devices,
NPU/GPU load, and the board's tuning judged by :mod:`slmguard.tuning` for the cores the
engine may run on (every ``TUNING_EVERY_S``). Elsewhere the board panes say "not on the board".
Every read failure becomes a line in ``errors``; nothing here raises for the
host or the server.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slmguard.errors import HostReadError
from slmguard.host import accel, thermal, zram
from slmguard.host import cgroup as cg
from slmguard.host.boardstate import read_board_state
from slmguard.host.cpu import (
    CpuFacts,
    CpuTimes,
    busy_pct,
    read_cpu_facts,
    read_cpufreq,
    read_proc_stat,
)
from slmguard.host.process import read_status
from slmguard.host.procfs import MemInfo, read_meminfo
from slmguard.host.psi import PROC_PRESSURE_MEMORY, Pressure, read_pressure
from slmguard.netaddr import is_loopback
from slmguard.plan.schema import Plan
from slmguard.top.client import Fetch, ServerClient
from slmguard.top.events import AlertLogTail, BundleWatch, derive, read_watch_state
from slmguard.top.server import server_view
from slmguard.top.snapshot import (
    AccelView,
    BoardView,
    CoreView,
    Event,
    MemoryView,
    PlannedPart,
    PlanView,
    ServerView,
    TopSnapshot,
    TransitionView,
    TuningView,
    WatchView,
    ZoneView,
    ZramView,
)
from slmguard.tuning import assess, target_for

CPU_FACTS_EVERY_S = 60.0
#: How often the board's tuning is read and judged again (governors and clocks rarely move).
TUNING_EVERY_S = 10.0
OBSERVED_TRANSITIONS = 16


def is_loopback_url(url: str) -> bool:
    return is_loopback(urlsplit(url).hostname or "")


def plan_view(plan: Plan, path: Path) -> PlanView:
    kv = plan.part("kv_cache")
    per_cell = kv.bytes // plan.engine.n_ctx if kv is not None and plan.engine.n_ctx else None
    return PlanView(
        path=str(path),
        model=plan.model.name,
        board=plan.board.name,
        n_ctx_cells=plan.engine.n_ctx,
        n_parallel=plan.engine.n_parallel,
        memory_high_bytes=plan.limits.memory_high_bytes,
        memory_max_bytes=plan.limits.memory_max_bytes,
        shed_pct=plan.watermarks.shed_pct,
        degrade_pct=plan.watermarks.degrade_pct,
        critical_pct=plan.watermarks.critical_pct,
        kv_bytes_per_cell=per_cell,
        parts=tuple(PlannedPart(p.name, p.bytes, p.kind, p.when) for p in plan.budget),
    )


def _stat_pair(stat: Mapping[str, int], version: int) -> tuple[int | None, int | None]:
    """(anon, file) bytes of memory.stat: v2 anon/file, v1 total_rss/total_cache."""
    if version == 2:
        return stat.get("anon"), stat.get("file")
    return stat.get("total_rss", stat.get("rss")), stat.get("total_cache", stat.get("cache"))


class Collector:
    """Refreshes of one server (and the board under it). See the module docstring."""

    def __init__(
        self,
        client: ServerClient,
        *,
        root: Path = Path("/"),
        local: bool | None = None,
        cgroup_dir: Path | None = None,
        unit: str | None = None,
        state_dir: Path | None = None,
        plan: PlanView | None = None,
        tuning_plan: Plan | None = None,
        max_events: int = 200,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.root = root
        self.local = is_loopback_url(client.url) if local is None else local
        self.fixed_cgroup = cgroup_dir
        self.unit = unit
        self.state_dir = state_dir
        self.plan = plan
        self.tuning_plan = tuning_plan  # the plan the board's tuning is judged for
        self._tuning: tuple[TuningView, ...] = ()
        self._tuning_at: float | None = None
        self.clock = clock
        self.monotonic = monotonic
        self.events: collections.deque[Event] = collections.deque(maxlen=max_events)
        self.observed: collections.deque[TransitionView] = collections.deque(
            maxlen=OBSERVED_TRANSITIONS
        )
        self.prev: TopSnapshot | None = None
        self._prev_mono: float | None = None
        self._prev_stat: dict[int | None, CpuTimes] = {}
        self._prev_mem_events: dict[str, int] | None = None
        self._prev_cgroup: Path | None = None
        self._prev_throttle: dict[int, int | None] = {}
        self._facts: CpuFacts | None = None
        self._facts_at: float | None = None
        self._alerts = AlertLogTail(state_dir / "alerts.jsonl") if state_dir else None
        self._bundles = BundleWatch(state_dir / "crashes") if state_dir else None

    # ------------------------------------------------------------ the server

    def _server(self, dt_s: float | None) -> ServerView:
        health = self.client.health()
        metrics: Fetch | None = None
        governor: Fetch | None = None
        if health.answered:
            metrics = self.client.metrics()
            governor = self.client.governor()
        prev = self.prev.server if self.prev else None
        return server_view(self.client.url, health, metrics, governor, prev, dt_s)

    def _with_observed(self, server: ServerView, now: float) -> ServerView:
        """Remember level changes seen between refreshes; show them when the server keeps none."""
        prev = self.prev.server.governor if self.prev else None
        g = server.governor
        if prev is not None and prev.level and g.level and prev.level != g.level:
            self.observed.append(
                TransitionView(
                    prev.level,
                    g.level,
                    server.engine.degraded_reasons.get("memory"),
                    g.pressure_pct,
                    now,
                    seen_by="top",
                )
            )
        if g.recent or not self.observed:
            return server
        return replace(server, governor=replace(g, recent=tuple(self.observed)))

    # ------------------------------------------------------------ the board

    def _cgroup_dir(self, engine_pid: int | None, errors: list[str]) -> Path | None:
        if self.fixed_cgroup is not None:
            return self.fixed_cgroup
        from slmguard.host.cgroup import unit_cgroup_dir

        if self.unit:
            found = unit_cgroup_dir(self.root, self.unit)
            if found is not None:
                return found
        if engine_pid is not None:
            try:
                return cg.memory_cgroup_dir(self.root, engine_pid)
            except HostReadError as err:
                errors.append(f"cgroup of pid {engine_pid}: {err.message}")
        return None

    def _events_delta(
        self, directory: Path | None, mem: cg.CgroupMemory | None
    ) -> tuple[dict[str, int], dict[str, int]]:
        """memory.events, and what rose since the last refresh in the same cgroup."""
        events = dict(mem.events) if mem else {}
        delta: dict[str, int] = {}
        if directory != self._prev_cgroup:
            self._prev_mem_events = None  # a new cgroup (a restart): no delta across it
        if self._prev_mem_events is not None:
            delta = {k: v - self._prev_mem_events.get(k, v) for k, v in events.items()}
            delta = {k: v for k, v in delta.items() if v > 0}
        self._prev_mem_events = events if mem else None
        self._prev_cgroup = directory
        return events, delta

    def _pressure(
        self, directory: Path | None, errors: list[str]
    ) -> tuple[Pressure | None, str | None]:
        """Memory PSI and where it came from: the cgroup's, else the host's."""
        pressure, psi_source = None, None
        if directory is not None and (directory / cg.V2_PRESSURE).exists():
            try:
                pressure, psi_source = read_pressure(directory / cg.V2_PRESSURE), "cgroup"
            except HostReadError as err:
                errors.append(f"psi: {err.message}")
        if pressure is None:
            try:
                pressure = read_pressure(self.root / PROC_PRESSURE_MEMORY)
                psi_source = "host"
            except HostReadError as err:
                errors.append(f"psi: {err.message}")
        return pressure, psi_source

    def _memory(self, engine_pid: int | None) -> MemoryView:
        errors: list[str] = []
        directory = self._cgroup_dir(engine_pid, errors)
        mem = None
        if directory is not None:
            try:
                mem = cg.read_memory(directory)
            except HostReadError as err:
                errors.append(f"cgroup: {err.message}")
        events, delta = self._events_delta(directory, mem)
        pressure, psi_source = self._pressure(directory, errors)
        meminfo: MemInfo | None = None
        try:
            meminfo = read_meminfo(self.root)
        except HostReadError as err:
            errors.append(f"meminfo: {err.message}")
        devices: tuple[zram.ZramDevice, ...] = ()
        try:
            devices = zram.read_zram_devices(self.root)
        except HostReadError as err:
            errors.append(f"zram: {err.message}")
        anon, file = _stat_pair(mem.stat, mem.version) if mem is not None else (None, None)
        swap_total = meminfo.swap_total_bytes if meminfo else None
        swap_used = None
        if meminfo and swap_total is not None and meminfo.swap_free_bytes is not None:
            swap_used = swap_total - meminfo.swap_free_bytes
        return MemoryView(
            cgroup_path=self._shown(directory),
            cgroup_version=mem.version if mem else None,
            usage_bytes=mem.usage_bytes if mem else None,
            working_set_bytes=mem.working_set_bytes if mem else None,
            anon_bytes=anon,
            file_bytes=file,
            high_bytes=mem.high_bytes if mem else None,
            max_bytes=mem.max_bytes if mem else None,
            events=events,
            events_delta=delta,
            mem_total_bytes=meminfo.mem_total_bytes if meminfo else None,
            mem_available_bytes=meminfo.mem_available_bytes if meminfo else None,
            psi_source=psi_source,
            psi_some_avg10_pct=pressure.some_avg10_pct if pressure else None,
            psi_full_avg10_pct=pressure.full_avg10_pct if pressure else None,
            swap_total_bytes=swap_total,
            swap_used_bytes=swap_used,
            zram=tuple(
                ZramView(d.name, d.disksize_bytes, d.mem_used_bytes) for d in devices if d.active
            ),
            cma_total_bytes=meminfo.cma_total_bytes if meminfo else None,
            cma_free_bytes=meminfo.cma_free_bytes if meminfo else None,
            errors=tuple(errors),
        )

    def _shown(self, path: Path | None) -> str | None:
        """A path as it is on the board: below a test root, without the root."""
        if path is None:
            return None
        if self.root != Path("/") and path.is_relative_to(self.root):
            return "/" + path.relative_to(self.root).as_posix()
        return str(path)

    def _cpu_facts(self, errors: list[str]) -> CpuFacts | None:
        now = self.monotonic()
        if self._facts_at is None or now - self._facts_at >= CPU_FACTS_EVERY_S:
            self._facts_at = now
            try:
                self._facts = read_cpu_facts(self.root)
            except HostReadError as err:
                errors.append(f"cpu: {err.message}")
                self._facts = None
        return self._facts

    def _board(self) -> BoardView:
        errors: list[str] = []
        facts = self._cpu_facts(errors)
        try:
            stat = read_proc_stat(self.root)
        except HostReadError as err:
            errors.append(f"cpu load: {err.message}")
            stat = {}
        online = facts.online if facts else tuple(sorted(k for k in stat if k is not None))
        big = set(facts.big_cores) if facts else set()
        mixed = bool(big) and len(big) < len(online)
        freqs = read_cpufreq(self.root, online)
        cooling = thermal.read_cooling_devices(self.root)
        throttled = thermal.throttled_cpus(freqs, cooling) | thermal.throttle_rises(
            self._prev_throttle, freqs
        )
        self._prev_throttle = {f.cpu: f.throttle_count for f in freqs}
        by_cpu = {f.cpu: f for f in freqs}
        cores = []
        for cpu in online:
            f = by_cpu.get(cpu)
            cores.append(
                CoreView(
                    cpu=cpu,
                    busy_pct=busy_pct(self._prev_stat.get(cpu), stat.get(cpu)),
                    big=(cpu in big) if mixed else None,
                    capacity=facts.capacity.get(cpu) if facts else None,
                    cur_khz=f.cur_khz if f else None,
                    scaling_max_khz=f.scaling_max_khz if f else None,
                    hw_max_khz=f.hw_max_khz if f else None,
                    throttled=cpu in throttled,
                    capped=f.capped if f else False,
                    freq_error=f.error if f else None,
                )
            )
        self._prev_stat = stat
        zones = tuple(
            ZoneView(z.name, z.type, z.temp_c, z.passive_c, z.critical_c, z.hot, z.error)
            for z in thermal.read_thermal_zones(self.root)
        )
        accels = tuple(
            AccelView(a.name, a.kind, a.load_pct, a.cur_freq_hz, a.max_freq_hz, a.error)
            for a in accel.read_accel_loads(self.root)
        )
        return BoardView(tuple(cores), zones, accels, tuple(errors), self._tuning)

    def _judge_tuning(self, engine_pid: int | None) -> None:
        """The board's tuning notes (:mod:`slmguard.tuning`), for the cores the engine may
        run on; read again every :data:`TUNING_EVERY_S` (clocks and governors rarely move)."""
        now = self.monotonic()
        if self._tuning_at is not None and now - self._tuning_at < TUNING_EVERY_S:
            return
        self._tuning_at = now
        state = read_board_state(self.root)
        status = read_status(self.root, engine_pid) if engine_pid is not None else None
        pinned = status.cpus_allowed if status is not None and status.cpus_allowed else None
        target = target_for(state, self.tuning_plan, pinned, "the engine's affinity")
        self._tuning = tuple(
            TuningView(n.id, n.severity, n.summary, n.fix) for n in assess(state, target)
        )

    # ------------------------------------------------------------ one refresh

    def _watch(self) -> WatchView | None:
        if self.state_dir is None:
            return None
        new: list[Event] = []
        if self._alerts is not None:
            new += self._alerts.read()
        if self._bundles is not None:
            new += self._bundles.read()
        self.events.extend(sorted(new, key=lambda e: e.unix_s))
        return WatchView(
            state_dir=self._shown(self.state_dir) or "",
            kills_reported=read_watch_state(self.state_dir),
            alert_log=self._alerts is not None and self._alerts.path.exists(),
            bundles=self._bundles.count if self._bundles else 0,
        )

    def poll(self) -> TopSnapshot:
        mono = self.monotonic()
        now = self.clock()
        dt = None if self._prev_mono is None else mono - self._prev_mono
        server = self._with_observed(self._server(dt), now)
        memory = board = None
        if self.local:
            memory = self._memory(server.engine.pid)
            self._judge_tuning(server.engine.pid)
            board = self._board()
        watch = self._watch()
        self.events.extend(derive(self.prev.server if self.prev else None, server, memory, now))
        errors: list[str] = []
        if memory is not None:
            errors += memory.errors
        if board is not None:
            errors += board.errors
        snap = TopSnapshot(
            taken_unix_s=now,
            server=server,
            interval_s=dt,
            memory=memory,
            board=board,
            plan=self.plan,
            watch=watch,
            events=tuple(self.events),
            errors=tuple(errors),
        )
        self.prev = snap
        self._prev_mono = mono
        return snap

    def note(self, severity: str, kind: str, message: str) -> None:
        """A line of top's own in the timeline (a key that could not act, say)."""
        self.events.append(Event(self.clock(), severity, kind, message, "top"))

    def trim(self, keep_recent: int) -> Fetch:
        """The ``t`` key: POST /api/v1/context/trim, and a line in the timeline."""
        result = self.client.trim(keep_recent)
        if result.ok:
            body: Any = result.body if isinstance(result.body, dict) else {}
            text = (
                f"trimmed contexts to {keep_recent} tokens: "
                f"{body.get('sessions_trimmed', '?')} session(s), "
                f"{body.get('tokens_removed', '?')} tokens removed"
            )
            self.events.append(Event(self.clock(), "info", "trim", text, "top"))
        else:
            self.events.append(
                Event(self.clock(), "warning", "trim", f"trim failed: {result.problem()}", "top")
            )
        return result


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    from slmguard import paths

    return paths.state_dir(os.environ if env is None else env)
