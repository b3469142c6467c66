"""Where slmguard keeps its files: state, model cache, crash bundles.

Root (a service) uses ``/var/lib/slmguard``; a user uses the XDG directories.
``SLMGUARD_STATE_DIR`` and ``SLMGUARD_MODEL_DIR`` override both. Nothing here
creates directories: callers create what they write.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SYSTEM_STATE_DIR = Path("/var/lib/slmguard")


def _is_root() -> bool:
    return os.geteuid() == 0


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory for durable state (sessions, cursors, crash bundles)."""
    env = os.environ if env is None else env
    if env.get("SLMGUARD_STATE_DIR"):
        return Path(env["SLMGUARD_STATE_DIR"])
    if _is_root():
        return SYSTEM_STATE_DIR
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "slmguard"


def model_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory the default model is assembled into."""
    env = os.environ if env is None else env
    if env.get("SLMGUARD_MODEL_DIR"):
        return Path(env["SLMGUARD_MODEL_DIR"])
    if _is_root():
        return SYSTEM_STATE_DIR / "models"
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slmguard" / "models"


def crash_dir(env: Mapping[str, str] | None = None) -> Path:
    return state_dir(env) / "crashes"


#: The newest stall evidence files kept in ``<state_dir>/stalls/`` (older ones removed).
STALLS_KEPT = 16


def stall_file_name(sequence: int, pid: int | None) -> str:
    """``stall-<sequence>-<pid>.json``: numbered in the order written (never the wall
    clock, which jumps on a board without an RTC), zero-padded so names sort."""
    return f"stall-{sequence:06d}-{pid if pid is not None else 0}.json"


def stall_file_order(name: str) -> tuple[int, int, str]:
    """The sort key of a stall evidence file name: the order written. Names of earlier
    versions (``stall-<unix ms>-<pid>.json``) come first, among themselves by name."""
    middle = name.removeprefix("stall-").partition("-")[0]
    if middle.isdigit() and len(middle) <= 9:
        return (1, int(middle), name)
    return (0, 0, name)
