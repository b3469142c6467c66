"""The watcher's settings, declared once: type, default, help text and flag.

Each field of :class:`WatchConfig` is declared with
:func:`slmguard.options.option`; ``slmguard.commands.watch`` derives the
flags and the ``SLMGUARD_WATCH_*`` environment variables from them, and
:func:`config_from_plan` takes the memory lines from a plan. Nothing else
declares a watch setting.

Example::

    cfg = WatchConfig(state_dir=Path("/var/lib/slmguard"), cgroup=Path(
        "/sys/fs/cgroup/system.slice/slmguard.service"), server_url="http://127.0.0.1:8080")
    cfg.warn_pct, cfg.keep_recent   # 85.0, 512
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slmguard.errors import ConfigError, UsageError
from slmguard.options import option
from slmguard.plan.schema import Plan

ENV_PREFIX = "SLMGUARD_WATCH_"


@dataclass(frozen=True)
class WatchConfig:
    """Everything ``slmguard watch`` can be told. Units are in the field names."""

    state_dir: Path = option(
        Path("."),
        "state directory (cursor, alerts.jsonl, crashes/, faults/)",
        shown_default="see README",
    )
    cgroup: Path | None = option(
        None,
        "the service's memory cgroup directory (default: from --unit or --pid)",
    )
    unit: str | None = option(None, "systemd unit of the server (cgroup, journal tail)")
    pids: tuple[int, ...] = option((), "a running process to watch (repeatable)", flag="--pid")
    server_url: str | None = option(
        None, "the server's base URL for /health, governor and trim", flag="--server"
    )
    admin_token_file: Path | None = option(None, "file holding the admin token for the trim call")
    interval_s: float = option(5.0, "longest time between polls, seconds", flag="--interval")
    min_interval_s: float = option(
        0.5, "shortest time between polls, seconds", flag="--min-interval"
    )
    warn_pct: float = option(85.0, "working-set warning line, % of the limit (plan: shed_pct)")
    critical_pct: float = option(
        97.0,
        "working-set critical line, % of the limit (plan: critical_pct)",
    )
    limit_bytes: int | None = option(
        None, "limit when the cgroup has none (plan: memory_high_bytes)"
    )
    sustain_s: float = option(
        30.0, "seconds above the warning line before the trim call", flag="--sustain"
    )
    trim_cooldown_s: float = option(300.0, "seconds between trim calls", flag="--trim-cooldown")
    keep_recent: int = option(512, "keep_recent tokens sent with the trim call")
    leak_window_s: float = option(
        600.0, "seconds over which a rising fd/handle count is a leak", flag="--leak-window"
    )
    leak_min_increase: int = option(
        64, "rise in fds or DMA-BUF handles over the window that is a leak", flag="--leak-min"
    )
    psi_warn_pct: float = option(10.0, "memory PSI 'some' avg10 above this is a warning")
    psi_critical_pct: float = option(20.0, "memory PSI 'full' avg10 above this is critical")
    exit_settle_s: float = option(
        30.0, "seconds a process must run before its exit is a crash", flag="--exit-settle"
    )
    stall_s: float = option(
        60.0,
        "seconds an engine with work may make no progress before it is reported stalled "
        "(seen from outside; slmguard's server also replaces its own)",
        flag="--stall",
    )
    webhook_url: str | None = option(
        None, "POST each alert as JSON to this http:// or https:// URL", flag="--webhook"
    )
    alert_command: str | None = option(None, "run this command per alert (alert JSON on stdin)")
    max_bundles: int = option(10, "crash bundles kept (oldest removed)")
    max_bundle_bytes: int = option(64 << 20, "total bytes of crash bundles kept")
    http_timeout_s: float = option(2.0, "timeout of each HTTP call, seconds", flag="--http-timeout")
    root: Path = option(Path("/"), "host root (tests: a fixture tree)", hidden=True)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.min_interval_s <= 0:
            raise ConfigError("watch: --interval and --min-interval must be > 0")
        if not 0 < self.warn_pct <= self.critical_pct <= 100:
            raise ConfigError("watch: need 0 < --warn-pct <= --critical-pct <= 100")
        if self.stall_s <= 0:
            raise ConfigError("watch: --stall must be > 0")
        if self.keep_recent < 0:
            raise ConfigError("watch: --keep-recent must be >= 0")
        if self.max_bundles < 1 or self.max_bundle_bytes < 1:
            raise ConfigError("watch: --max-bundles and --max-bundle-bytes must be >= 1")
        for flag, url in (("--webhook", self.webhook_url), ("--server", self.server_url)):
            if url is not None:
                check_http_url(flag, url)
        check_pids(self.pids, self.root)

    @property
    def state_file(self) -> Path:
        return self.state_dir / "watch-state.json"

    @property
    def alert_log(self) -> Path:
        return self.state_dir / "alerts.jsonl"

    @property
    def crash_dir(self) -> Path:
        return self.state_dir / "crashes"

    @property
    def faults_dir(self) -> Path:
        return self.state_dir / "faults"

    @property
    def stalls_dir(self) -> Path:
        """The server's stall evidence (``slmguard.serve.liveness`` writes it)."""
        return self.state_dir / "stalls"


def check_http_url(flag: str, url: str) -> None:
    """ConfigError (78) unless ``url`` is a plain ``http://`` or ``https://`` URL with a host.

    The watcher's client speaks HTTP only; ``file://`` or ``ftp://`` would fail
    at every alert (and a control character would end up in the request line).
    """
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(f"watch: {flag} {url!r}: a URL has no whitespace or control characters")
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as err:
        raise ConfigError(f"watch: {flag} {url!r}: {err}") from err
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"watch: {flag} {url!r}: need an http:// or https:// URL with a host",
            hint="e.g. --webhook http://10.0.0.5:9000/alerts",
        )


def check_pids(pids: tuple[int, ...], root: Path) -> None:
    """UsageError (64) for a ``--pid`` that is not a running process under ``root``."""
    for pid in pids:
        if pid <= 0:
            raise UsageError(f"watch: --pid {pid}: not a process id")
        if not (root / "proc" / str(pid)).is_dir():
            raise UsageError(
                f"watch: --pid {pid}: no such process",
                hint="give the pid of a running process (or --unit UNIT, which is looked up "
                "again at each poll)",
            )


def config_from_plan(plan: Plan) -> dict[str, Any]:
    """The settings a plan decides: the memory lines and the fallback limit."""
    return {
        "warn_pct": plan.watermarks.shed_pct,
        "critical_pct": plan.watermarks.critical_pct,
        "limit_bytes": plan.limits.memory_high_bytes,
    }
