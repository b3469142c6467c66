"""The watcher: poll, decide, act; as a loop or once.

Owns the order of one poll and the loop around it:

1. read new /dev/kmsg records after the cursor and assemble OOM reports;
2. read the snapshot (cgroup, PSI, fds, DMA-BUF, CMA, server);
3. :func:`slmguard.watch.rules.evaluate`;
4. act: alerts, the trim call, a crash bundle;
5. save the state (cursor, counters) atomically when it changed: always after
   a kill, a trim or a new oom_kill count, otherwise (the cursor moved over
   harmless records) at most every 15 minutes, for the SD card's sake
   (re-reading harmless records after a crash costs nothing; a lost kill
   cursor would repeat an alert).

The loop sleeps on ``poll(2)`` over the /dev/kmsg descriptor (readable when a
new record arrives, so a kill is seen at once) and a self-pipe that SIGTERM
and SIGINT write to (so stopping is immediate, and the handlers are restored
on the way out). Records that are not OOM reports do not trigger a full poll.
The time between full polls adapts like earlyoom's, with the governor's
formula (:mod:`slmguard.host.headroom`): the configured interval when memory
is far from the limit, shorter as the working set nears it or grows fast
(:func:`next_interval_s`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from slmguard.errors import HostReadError
from slmguard.host import cgroup as cg
from slmguard.host.headroom import poll_interval_s, used_pct
from slmguard.host.kmsg import KmsgReader, OomAssembler, OomKill, read_boot_id
from slmguard.host.procfs import read_uptime_s
from slmguard.watch import rules
from slmguard.watch.alerts import AlertSink
from slmguard.watch.bundle import BundleInputs, prune_bundles, write_bundle
from slmguard.watch.config import WatchConfig
from slmguard.watch.sources import (
    Collector,
    HttpStatus,
    Snapshot,
    http_json,
)
from slmguard.watch.state import load_state, save_state

log = logging.getLogger(__name__)

STATE_SAVE_EVERY_S = 900.0  # a cursor that only moved over harmless records: the SD card
SAVE_RETRY_S = 60.0  # a save the full disk refused is tried again this much later


def boot_clock() -> float:
    """CLOCK_BOOTTIME: seconds since boot, suspend included, never set by anyone."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class PollResult:
    snapshot: Snapshot
    decision: rules.Decision
    bundle: Path | None = None
    trim: HttpStatus | None = None


def next_interval_s(
    working_set_bytes: int | None,
    limit_bytes: int | None,
    growth_bytes_per_s: float,
    *,
    base_s: float,
    min_s: float,
    warn_pct: float,
) -> float:
    """Seconds to the next poll: shorter when the limit is near or approaching fast.

    :func:`slmguard.host.headroom.poll_interval_s` (the governor's formula) with
    the growth measured between polls as the fill rate, the limit as the line
    and four looks before it is reached, clamped to [min_s, base_s]. Above the
    warning line at most a quarter of the base interval even when flat: the
    next request can add its KV cache at once.
    """
    if working_set_bytes is None or not limit_bytes:
        return base_s
    interval = poll_interval_s(
        working_set_bytes,
        limit_bytes,
        fill_rate_bytes_per_s=growth_bytes_per_s,
        min_s=min_s,
        max_s=base_s,
        looks_per_crossing=4.0,
    )
    pct = used_pct(working_set_bytes, limit_bytes)
    if pct is not None and pct >= warn_pct:
        interval = max(min_s, min(interval, base_s / 4))
    return interval


class Watcher:
    """One watched service. ``poll()`` once, or ``run()`` until stopped."""

    def __init__(
        self,
        config: WatchConfig,
        *,
        sink: AlertSink | None = None,
        wall: Callable[[], float] = time.time,
        boottime: Callable[[], float] = boot_clock,
    ) -> None:
        """``wall`` and ``boottime`` are the clocks (tests inject a jumping wall clock)."""
        self.config = config
        self.wall = wall
        self.boottime = boottime
        self.root = config.root
        self.sink = sink or AlertSink(
            config.alert_log,
            webhook_url=config.webhook_url,
            command=config.alert_command,
            timeout_s=max(config.http_timeout_s, 2.0),
        )
        self.cgroup_dir = config.cgroup
        self.service_cgroup = cg.kernel_path(config.cgroup) if config.cgroup else None
        self.collector = Collector(
            root=self.root,
            cgroup_dir=config.cgroup,
            pids=config.pids,
            server_url=config.server_url,
            http_timeout_s=config.http_timeout_s,
            token=self._admin_token(),
        )
        self.thresholds = rules.Thresholds(
            warn_pct=config.warn_pct,
            critical_pct=config.critical_pct,
            sustain_s=config.sustain_s,
            trim_cooldown_s=config.trim_cooldown_s,
            keep_recent=config.keep_recent,
            leak_window_s=config.leak_window_s,
            leak_min_increase=config.leak_min_increase,
            psi_warn_pct=config.psi_warn_pct,
            psi_critical_pct=config.psi_critical_pct,
            fallback_limit_bytes=config.limit_bytes,
            exit_settle_s=config.exit_settle_s,
            stall_s=config.stall_s,
        )
        self.boot_id = read_boot_id(self.root)
        self.state = load_state(config.state_file)
        if self.state.boot_id != self.boot_id:  # rebooted: the boot clock restarted
            self.state = replace(self.state, last_trim_boot_s=None)
        self._saved_state = self.state
        self._saved_at = time.monotonic()
        self.assembler = OomAssembler()
        self.reader: KmsgReader | None = KmsgReader(
            self.root, cursor=self.state.cursor_for(self.boot_id)
        )
        self.kmsg_error: str | None = None
        self._pending_kills: list[OomKill] = []
        self._pending_lost = 0
        self.rule_state = self._initial_rule_state()
        self._prev_for_rate: tuple[float, int | None] | None = None
        self.stop_event = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def _initial_rule_state(self) -> rules.RuleState:
        baseline = None
        if self.cgroup_dir is not None:
            baseline = self.state.oom_kill_counts.get(str(self.cgroup_dir))
        last_trim = None
        if self.state.last_trim_boot_s is not None:  # this boot: a clock that never jumps
            ago: float | None = self.boottime() - self.state.last_trim_boot_s
        elif self.state.last_trim_unix_s is not None:  # before a reboot: the wall clock
            ago = self.wall() - self.state.last_trim_unix_s
        else:
            ago = None
        if ago is not None and 0 <= ago < self.config.trim_cooldown_s:
            last_trim = time.monotonic() - ago
        return rules.RuleState(oom_kill_count=baseline, last_trim_s=last_trim)

    # ------------------------------------------------------------ kernel log

    def drain_kmsg(self) -> int:
        """Read new kernel records; returns how many kills were found."""
        if self.reader is None:
            return 0
        try:
            batch = self.reader.read()
        except HostReadError as err:
            if self.kmsg_error is None:
                log.warning("kernel log unavailable: %s", err.message)
            self.kmsg_error = err.message
            self.reader.close()
            self.reader = None
            return 0
        found = 0
        for record in batch.records:
            kills = self.assembler.feed(record)
            found += len(kills)
            self._pending_kills.extend(kills)
        self._pending_lost += batch.lost
        # Record timestamps count from boot: compare them with the root's own
        # uptime (a fixture tree without /proc/uptime never expires a report).
        uptime_s = read_uptime_s(self.root)
        if uptime_s is not None:
            self.assembler.expire(int(uptime_s * 1e6))
        return found

    # ------------------------------------------------------------ one poll

    def _resolve_unit(self) -> bool | None:
        """Follow the unit's cgroup across restarts; whether the unit is running."""
        unit = self.config.unit
        if unit is None:
            return None
        if self.cgroup_dir is not None and cg.is_cgroup_dir(self.cgroup_dir):
            return True
        found = cg.unit_cgroup_dir(self.root, unit)
        if found is not None and found != self.cgroup_dir:
            log.info("unit %s runs in %s", unit, found)
        if found is not None:
            self.cgroup_dir = found
            self.collector.cgroup_dir = found
            self.service_cgroup = cg.kernel_path(found)
        return found is not None

    def poll(self) -> PollResult:
        present = self._resolve_unit()
        self.drain_kmsg()
        kills, lost = tuple(self._pending_kills), self._pending_lost
        snap = self.collector.read(kills=kills, kmsg_lost=lost)
        if present is not None:
            snap = replace(snap, service_present=present)
        if self.kmsg_error:
            snap = replace(snap, errors=(*snap.errors, f"kmsg: {self.kmsg_error}"))
        decision, self.rule_state = rules.evaluate(
            snap, self.rule_state, self.thresholds, self.service_cgroup
        )
        for alert in decision.alerts:
            self.sink.emit(alert, snap.unix_s)
        trim = None
        if decision.trim_keep_recent is not None:
            trim = self.call_trim(decision.trim_keep_recent)
        bundle = None
        if decision.bundle_reason is not None:
            try:
                bundle = self.collect(decision.bundle_reason, kills=kills, snapshot=snap)
            except HostReadError as err:  # a full disk must not stop the watchdog
                self.sink.emit(
                    rules.Alert("warning", "bundle-failed", err.message, {"path": str(err.path)})
                )
        self._pending_kills.clear()
        self._pending_lost = 0
        self._remember(snap, decision, trimmed=trim is not None, kills=len(kills))
        return PollResult(snap, decision, bundle, trim)

    def _admin_token(self) -> str | None:
        path = self.config.admin_token_file
        if path is None:
            return None
        try:
            return path.read_text(encoding="utf-8").strip() or None
        except OSError as err:
            raise HostReadError(path, f"admin token file: {err.strerror or err}") from err

    def call_trim(self, keep_recent: int) -> HttpStatus | None:
        if not self.config.server_url:
            log.warning("trim wanted (working set high) but no --server is configured")
            return None
        try:
            token = self._admin_token()  # re-read: the token may have been rotated
        except HostReadError as err:
            log.warning("%s; using the token read at start", err.message)
            token = self.collector.token
        url = self.config.server_url.rstrip("/") + "/api/v1/context/trim"
        result = http_json(
            url,
            timeout_s=max(self.config.http_timeout_s, 10.0),
            method="POST",
            payload={"keep_recent": keep_recent},
            token=token,
        )
        severity = "info" if result.ok else "warning"
        outcome = f"HTTP {result.status}" if result.status is not None else result.error
        self.sink.emit(
            rules.Alert(
                severity,
                "trim",
                f"called the trim API with keep_recent={keep_recent}: {outcome}",
                {"keep_recent": keep_recent, "status": result.status, "body": result.body},
            )
        )
        return result

    def collect(
        self, reason: str, *, kills: tuple[OomKill, ...] = (), snapshot: Snapshot | None = None
    ) -> Path:
        """Write a crash bundle now (``watch --collect`` and the rules both use this)."""
        governor = health = None
        if snapshot is not None:
            governor = snapshot.governor.body if snapshot.governor else None
            health = snapshot.health.body if snapshot.health else None
        elif self.config.server_url:
            base = self.config.server_url.rstrip("/")
            timeout = self.config.http_timeout_s
            h = http_json(base + "/health", timeout_s=timeout)
            health = h.body if h.status is not None else {"error": h.error}
            if h.status is not None:
                governor = http_json(
                    base + "/api/v1/governor", timeout_s=timeout, token=self.collector.token
                ).body
        path = write_bundle(
            self.config.crash_dir,
            BundleInputs(
                reason=reason,
                kills=kills,
                cgroup_dir=self.cgroup_dir,
                faults_dir=self.config.faults_dir,
                stalls_dir=self.config.stalls_dir,
                governor=governor,
                health=health,
                unit=self.config.unit,
            ),
        )
        prune_bundles(self.config.crash_dir, self.config.max_bundles, self.config.max_bundle_bytes)
        return path

    def collect_recent(self, reason: str, *, within_s: float = 900.0, most: int = 5) -> Path:
        """A bundle on demand with the service's OOM reports of the last ``within_s``.

        Reads the whole kernel ring buffer with a separate reader and leaves the
        watcher's cursor alone, so a running daemon still reports those kills.
        """
        kills: list[OomKill] = []
        try:
            with KmsgReader(self.root) as reader:
                assembler = OomAssembler()
                for record in reader.read().records:
                    kills.extend(assembler.feed(record))
        except HostReadError as err:
            log.warning("kernel log unavailable for the bundle: %s", err.message)
        uptime_s = read_uptime_s(self.root)
        if uptime_s is None:
            uptime_s = time.clock_gettime(time.CLOCK_MONOTONIC)
        now_usec = uptime_s * 1e6
        recent = [
            k
            for k in kills
            # a record "from the future" is from a capture, not this boot's clock
            if -5e6 <= now_usec - k.ts_usec <= within_s * 1e6
            and (self.service_cgroup is None or k.in_cgroup(self.service_cgroup))
        ]
        return self.collect(reason, kills=tuple(recent[-most:]))

    def _remember(
        self, snap: Snapshot, decision: rules.Decision, *, trimmed: bool, kills: int
    ) -> None:
        cursor = self.reader.cursor if self.reader else self.state.kmsg_seq
        cursor = self.assembler.safe_cursor(cursor)
        counts = dict(self.state.oom_kill_counts)
        if self.cgroup_dir is not None and self.rule_state.oom_kill_count is not None:
            counts[str(self.cgroup_dir)] = self.rule_state.oom_kill_count
        self.state = replace(
            self.state.with_cursor(self.boot_id, cursor),
            oom_kill_counts=counts,
            last_trim_unix_s=snap.unix_s if trimmed else self.state.last_trim_unix_s,
            last_trim_boot_s=self.boottime() if trimmed else self.state.last_trim_boot_s,
            kills_reported=self.state.kills_reported + kills,
        )
        due = time.monotonic() - self._saved_at >= STATE_SAVE_EVERY_S
        important = kills or trimmed or counts != self._saved_state.oom_kill_counts
        if self.state != self._saved_state and (important or due):
            self.save()

    def save(self) -> None:
        """Save the state; a full filesystem is logged and the save tried again at the
        next poll (the old file stays whole: the write is atomic)."""
        try:
            save_state(self.config.state_file, self.state)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.error("watch state not saved (%s): kept in memory, tried again in %.0f s",
                      err.strerror, SAVE_RETRY_S)  # fmt: skip
            self._saved_at = time.monotonic() - STATE_SAVE_EVERY_S + SAVE_RETRY_S  # not every poll
            return
        self._saved_state = self.state
        self._saved_at = time.monotonic()

    # ------------------------------------------------------------ the loop

    def stop(self) -> None:
        self.stop_event.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _interval(self, result: PollResult) -> float:
        growth = 0.0
        prev = self._prev_for_rate
        ws = result.decision.working_set_bytes
        if prev is not None and ws is not None and prev[1] is not None:
            dt = result.snapshot.mono_s - prev[0]
            if dt > 0:
                growth = (ws - prev[1]) / dt
        self._prev_for_rate = (result.snapshot.mono_s, ws)
        return next_interval_s(
            ws,
            result.decision.limit_bytes,
            growth,
            base_s=self.config.interval_s,
            min_s=min(self.config.min_interval_s, self.config.interval_s),
            warn_pct=self.config.warn_pct,
        )

    def run(self, on_poll: Any = None) -> None:
        """Poll until :meth:`stop` (or SIGTERM/SIGINT when run in the main thread)."""
        restore: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():

            def handler(signum: int, frame: FrameType | None) -> None:
                log.info("signal %d: stopping", signum)
                self.stop()

            for sig in (signal.SIGTERM, signal.SIGINT):
                restore[sig] = signal.signal(sig, handler)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        kmsg_fd = None
        if self.reader is not None:
            try:
                if self.reader.is_device:  # a regular file would always be readable
                    kmsg_fd = self.reader.fileno()
                    poller.register(kmsg_fd, select.POLLIN)
            except HostReadError as err:
                self.kmsg_error = err.message
                log.warning("kernel log unavailable: %s", err.message)
                self.reader = None
        try:
            deadline = 0.0
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now >= deadline or self._pending_kills:
                    result = self.poll()
                    if on_poll is not None:
                        on_poll(result)
                    deadline = time.monotonic() + self._interval(result)
                    continue
                events = poller.poll(max(1, int((deadline - now) * 1000)))
                for fd, _ in events:
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 64)
                    elif fd == kmsg_fd:
                        self.drain_kmsg()
                        if self.reader is None and kmsg_fd is not None:
                            poller.unregister(kmsg_fd)
                            kmsg_fd = None
        finally:
            for sig, old in restore.items():
                signal.signal(sig, old)
            self.save()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
