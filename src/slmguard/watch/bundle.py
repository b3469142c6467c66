"""Crash bundles: the evidence left behind when the service is killed or dies.

Owns ``<state_dir>/crashes/<UTC time>/`` and its retention. A bundle holds:

    summary.json        why, when, the kills (pid, comm, RSS, cgroup), what was collected
    oom-report.txt      the kernel's OOM report lines, one report after another
    memory.stat         the watched cgroup's memory.stat at collection time
    memory.events       v2 memory.events, or v1 memory.oom_control + memory.failcnt
    governor.json       GET /api/v1/governor (the last transitions), when reachable
    health.json         GET /health, when reachable
    faults/<name>.log   the tail of the server's faulthandler traces (<state_dir>/faults/)
    stalls/<name>.json  the server's evidence of its latest stalls (<state_dir>/stalls/:
                        the engine's threads, wait channels, kernel stack, last log lines)
    journal.txt         the tail of journalctl (-u <unit> when known), when journalctl exists

It is written into a hidden temporary directory and renamed into place, so a
reader never sees half a bundle. ``crashes/`` and every bundle are 0700, every
file in them 0600, whatever the umask: they hold the server's fault traces and
the journal tail. After each write the oldest bundles (in the order they were
written: ``summary.json``'s ``sequence``, never the wall clock) are removed until at
most ``max_count`` remain and their total size is at most ``max_bytes`` (the newest
one is always kept, trimmed files included).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slmguard.errors import HostReadError
from slmguard.host.kmsg import OomKill
from slmguard.paths import stall_file_order

log = logging.getLogger(__name__)

FAULT_TAIL_BYTES = 256 << 10
#: Crash bundles are private: the crashes/ directory and each bundle 0700, files 0600.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
JOURNAL_LINES = 300
STALL_REPORTS = 3  # the newest stall evidence files a bundle carries


@dataclass(frozen=True)
class BundleInputs:
    """What to put in a bundle; each part is optional."""

    reason: str
    kills: Sequence[OomKill] = ()
    cgroup_dir: Path | None = None
    faults_dir: Path | None = None
    stalls_dir: Path | None = None
    governor: Any = None
    health: Any = None
    unit: str | None = None
    extra: dict[str, Any] | None = None


def _tail(path: Path, limit: int) -> bytes:
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - limit))
        return fh.read()


def journal_tail(unit: str | None, lines: int = JOURNAL_LINES) -> str | None:
    """The journal's last lines (of ``unit``), or None when there is no journalctl."""
    exe = shutil.which("journalctl")
    if exe is None:
        return None
    argv = [exe, "--no-pager", "-o", "short-iso", "-n", str(lines)]
    if unit:
        argv += ["-u", unit]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"journalctl failed: {err}\n"
    text = done.stdout
    if done.returncode != 0 or not text.strip():
        text += f"(journalctl exited {done.returncode}: {done.stderr.strip()})\n"
    return text


def _copy_cgroup_files(cgroup_dir: Path, out: Path, collected: list[str]) -> None:
    for name, dest in (
        ("memory.stat", "memory.stat"),
        ("memory.events", "memory.events"),
        ("memory.events.local", "memory.events.local"),
        ("memory.oom_control", "memory.events"),
        ("memory.failcnt", "memory.failcnt"),
        ("memory.current", "memory.current"),
        ("memory.usage_in_bytes", "memory.usage_in_bytes"),
        ("memory.max", "memory.max"),
        ("memory.high", "memory.high"),
        ("memory.limit_in_bytes", "memory.limit_in_bytes"),
        ("memory.pressure", "memory.pressure"),
    ):
        try:
            text = (cgroup_dir / name).read_text(errors="replace")
        except OSError:
            continue
        target = out / dest
        # v1 has no memory.events: oom_control (+ failcnt) stands in for it.
        mode = "a" if target.exists() else "w"
        with target.open(mode, encoding="utf-8") as fh:
            fh.write(text)
        collected.append(dest)


def _make_private(bundle: Path) -> None:
    """Files 0600 and directories 0700, whatever the umask: bundles hold prompts' traces.

    Run before the rename, inside a directory that is 0700 from its creation.
    """
    for dirpath, dirnames, filenames in os.walk(bundle):
        os.chmod(dirpath, PRIVATE_DIR_MODE)
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), PRIVATE_DIR_MODE)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), PRIVATE_FILE_MODE)  # no links are made here


def _unique_dir(crash_root: Path, unix_s: float) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(unix_s))
    candidate = crash_root / stamp
    n = 2
    while candidate.exists():
        candidate = crash_root / f"{stamp}-{n}"
        n += 1
    return candidate


def _write_oom_report(out: Path, kills: Sequence[OomKill], collected: list[str]) -> None:
    """The kernel's OOM report lines, one kill after another."""
    report = []
    for k in kills:
        report.append(f"# kmsg seq {k.first_seq}..{k.seq}: {k.comm} (pid {k.pid})")
        report.extend(k.lines)
        report.append("")
    (out / "oom-report.txt").write_text("\n".join(report), encoding="utf-8")
    collected.append("oom-report.txt")


def _write_server_views(out: Path, inputs: BundleInputs, collected: list[str]) -> None:
    """governor.json and health.json, the server's own view, when it answered."""
    for name, value in (("governor.json", inputs.governor), ("health.json", inputs.health)):
        if value is not None:
            (out / name).write_text(json.dumps(value, indent=1, default=str) + "\n")
            collected.append(name)


def _copy_tails(out: Path, sub: str, files: list[Path], collected: list[str]) -> None:
    for path in files:
        (out / sub).mkdir(exist_ok=True)
        (out / sub / path.name).write_bytes(_tail(path, FAULT_TAIL_BYTES))
        collected.append(f"{sub}/{path.name}")


def _copy_server_evidence(out: Path, inputs: BundleInputs, collected: list[str]) -> None:
    """The tails of the server's fault traces and of its newest stall evidence."""
    if inputs.faults_dir is not None and inputs.faults_dir.is_dir():
        _copy_tails(out, "faults", sorted(inputs.faults_dir.glob("*.log")), collected)
    if inputs.stalls_dir is not None and inputs.stalls_dir.is_dir():
        found = inputs.stalls_dir.glob("stall-*.json")
        stalls = sorted(found, key=lambda p: stall_file_order(p.name))[-STALL_REPORTS:]
        _copy_tails(out, "stalls", stalls, collected)


def _write_summary(
    out: Path, inputs: BundleInputs, now: float, collected: list[str], sequence: int
) -> None:
    summary = {
        "sequence": sequence,  # the order bundles were written in, whatever the clock said
        "reason": inputs.reason,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "kills": [{k: v for k, v in asdict(x).items() if k != "lines"} for x in inputs.kills],
        "cgroup": str(inputs.cgroup_dir) if inputs.cgroup_dir else None,
        "unit": inputs.unit,
        "files": sorted(set(collected)),
        **(inputs.extra or {}),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")


def write_bundle(
    crash_root: Path,
    inputs: BundleInputs,
    *,
    unix_s: float | None = None,
    journal: Callable[[str | None], str | None] = journal_tail,
) -> Path:
    """Write one bundle and return its directory. Raises HostReadError if it cannot."""
    now = time.time() if unix_s is None else unix_s
    tmp: Path | None = None
    try:
        crash_root.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        crash_root.chmod(PRIVATE_DIR_MODE)  # whatever the umask, and a directory made before
        final = _unique_dir(crash_root, now)
        tmp = crash_root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir(mode=PRIVATE_DIR_MODE)
        tmp.chmod(PRIVATE_DIR_MODE)
        collected: list[str] = []
        if inputs.kills:
            _write_oom_report(tmp, inputs.kills, collected)
        if inputs.cgroup_dir is not None:
            _copy_cgroup_files(inputs.cgroup_dir, tmp, collected)
        _write_server_views(tmp, inputs, collected)
        _copy_server_evidence(tmp, inputs, collected)
        text = journal(inputs.unit)
        if text is not None:
            (tmp / "journal.txt").write_text(text, encoding="utf-8")
            collected.append("journal.txt")
        _write_summary(tmp, inputs, now, collected, _next_sequence(crash_root))
        _make_private(tmp)
        tmp.rename(final)
    except OSError as err:
        if tmp is not None:  # half a bundle (a full disk): not left to fill it further
            shutil.rmtree(tmp, ignore_errors=True)
        raise HostReadError(crash_root, f"cannot write crash bundle: {err}") from err
    log.warning("crash bundle written: %s (%s)", final, inputs.reason)
    return final


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _sequence(bundle: Path) -> int:
    """The bundle's place in the order of writing (summary.json's ``sequence``; 0 for a
    bundle of an earlier version, or one whose summary is unreadable)."""
    try:
        with (bundle / "summary.json").open("rb") as fh:
            data = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return 0
    value = data.get("sequence") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _next_sequence(crash_root: Path) -> int:
    return max((_sequence(b) for b in _bundle_dirs(crash_root)), default=0) + 1


def _bundle_dirs(crash_root: Path) -> list[Path]:
    if not crash_root.is_dir():
        return []
    return [p for p in crash_root.iterdir() if p.is_dir() and not p.name.startswith(".")]


def list_bundles(crash_root: Path) -> list[Path]:
    """Bundle directories, oldest first: in the order they were written (``sequence``),
    not by their names' UTC time, which jumps with the wall clock (a board without an RTC
    boots in 1970 and jumps forward at NTP sync)."""
    return sorted(_bundle_dirs(crash_root), key=lambda b: (_sequence(b), b.name))


def _writer_gone(tmp: Path) -> bool:
    """A ``.tmp-<name>-<pid>`` directory whose writer is no longer running."""
    pid = tmp.name.rpartition("-")[2]
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive (another user's): not ours to judge
    return False


def prune_bundles(crash_root: Path, max_count: int, max_bytes: int) -> list[Path]:
    """Remove the oldest bundles beyond the limits; returns what was removed.

    The newest bundle is never removed, even alone over ``max_bytes``.
    """
    bundles = list_bundles(crash_root)
    sizes = {b: _size(b) for b in bundles}
    removed: list[Path] = []
    while len(bundles) > 1 and (
        len(bundles) > max_count or sum(sizes[b] for b in bundles) > max_bytes
    ):
        oldest = bundles.pop(0)
        shutil.rmtree(oldest, ignore_errors=True)
        removed.append(oldest)
    # Leftover temporary directories of writers that died while writing (by their pid,
    # not their age: the wall clock may have jumped).
    for tmp in crash_root.glob(".tmp-*") if crash_root.is_dir() else ():
        if _writer_gone(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return removed
