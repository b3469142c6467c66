"""The watcher's persisted state: where it stopped reading, what it last counted.

Owns ``<state_dir>/watch-state.json`` (the path is ``WatchConfig.state_file``):
the /dev/kmsg sequence cursor with the boot id it belongs to (sequence numbers
restart at every boot), the last ``oom_kill`` count seen per cgroup directory,
and the time of the last trim call (the cooldown survives restarts): CLOCK_BOOTTIME
within the boot the cursor names (wall-clock jumps do not move it), the wall time
only across a reboot. Written
atomically (temporary file in the same directory, fsync, rename, fsync of the
directory), so a power cut leaves either the old or the new state, never a
torn file.

A state file that cannot be parsed is moved aside (``.corrupt``) and the
watcher starts as on first run; that may report a kill again, which is better
than missing one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slmguard import atomicio
from slmguard.errors import HostReadError

log = logging.getLogger(__name__)

VERSION = 1


@dataclass(frozen=True)
class WatchState:
    boot_id: str | None = None
    kmsg_seq: int | None = None  # last /dev/kmsg record handled in this boot
    oom_kill_counts: Mapping[str, int] = field(default_factory=dict)  # cgroup dir -> count
    last_trim_unix_s: float | None = None
    # CLOCK_BOOTTIME at the last trim, in the boot ``boot_id`` names: the cooldown's clock
    # (the wall clock jumps at NTP sync on a board without an RTC; this one does not).
    last_trim_boot_s: float | None = None
    kills_reported: int = 0

    def cursor_for(self, boot_id: str | None) -> int | None:
        """The kmsg cursor when it belongs to this boot, else None (start over)."""
        return self.kmsg_seq if boot_id == self.boot_id else None

    def with_cursor(self, boot_id: str | None, seq: int | None) -> WatchState:
        return replace(self, boot_id=boot_id, kmsg_seq=seq)


def state_to_dict(state: WatchState) -> dict[str, Any]:
    return {
        "version": VERSION,
        "boot_id": state.boot_id,
        "kmsg_seq": state.kmsg_seq,
        "oom_kill_counts": dict(state.oom_kill_counts),
        "last_trim_unix_s": state.last_trim_unix_s,
        "last_trim_boot_s": state.last_trim_boot_s,
        "kills_reported": state.kills_reported,
    }


def state_from_dict(data: Any) -> WatchState:
    """Build a state from parsed JSON; raises ValueError on the wrong shape."""
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError("not a version-1 watch state")
    seq = data.get("kmsg_seq")
    boot = data.get("boot_id")
    counts = data.get("oom_kill_counts") or {}
    trim = data.get("last_trim_unix_s")
    trim_boot = data.get("last_trim_boot_s")  # absent in files of earlier versions
    kills = data.get("kills_reported", 0)
    if seq is not None and not isinstance(seq, int):
        raise ValueError("kmsg_seq is not an integer")
    if boot is not None and not isinstance(boot, str):
        raise ValueError("boot_id is not a string")
    if not isinstance(counts, dict) or not all(isinstance(v, int) for v in counts.values()):
        raise ValueError("oom_kill_counts is not a mapping of integers")
    if trim is not None and not isinstance(trim, int | float):
        raise ValueError("last_trim_unix_s is not a number")
    if trim_boot is not None and not isinstance(trim_boot, int | float):
        raise ValueError("last_trim_boot_s is not a number")
    if not isinstance(kills, int):
        raise ValueError("kills_reported is not an integer")
    return WatchState(
        boot_id=boot,
        kmsg_seq=seq,
        oom_kill_counts={str(k): v for k, v in counts.items()},
        last_trim_unix_s=None if trim is None else float(trim),
        last_trim_boot_s=None if trim_boot is None else float(trim_boot),
        kills_reported=kills,
    )


def load_state(path: Path) -> WatchState:
    """The saved state, or a fresh one when there is none (or it was corrupt)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return WatchState()
    except OSError as err:
        raise HostReadError(path, err.strerror or str(err)) from err
    try:
        return state_from_dict(json.loads(text))
    except ValueError as err:  # json.JSONDecodeError is a ValueError
        aside = path.with_name(path.name + ".corrupt")
        log.warning("watch state %s unreadable (%s); moved to %s, starting over", path, err, aside)
        os.replace(path, aside)
        return WatchState()


def save_state(path: Path, state: WatchState) -> None:
    data = json.dumps(state_to_dict(state), indent=1, sort_keys=True) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomicio.write_atomic(path, data.encode("utf-8"), mode=0o600)
