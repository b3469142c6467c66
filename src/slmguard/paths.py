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
