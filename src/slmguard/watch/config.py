"""The watcher's settings, declared once: type, default, CLI flag and help text.

Each field of :class:`WatchConfig` carries its flag and help in ``metadata``;
``slmguard.commands.watch`` builds the argparse options from them, and
:func:`config_from_plan` takes the memory lines from a plan. Nothing else
declares a watch setting.

Example::

    cfg = WatchConfig(state_dir=Path("/var/lib/slmguard"), cgroup=Path(
        "/sys/fs/cgroup/system.slice/slmguard.service"), server_url="http://127.0.0.1:8080")
    cfg.warn_pct, cfg.keep_recent   # 85.0, 512
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slmguard.errors import ConfigError
from slmguard.planfile import Plan


def _meta(flag: str | None, help_text: str, **extra: Any) -> dict[str, Any]:
    return {"flag": flag, "help": help_text, **extra}


@dataclass(frozen=True)
class WatchConfig:
    state_dir: Path = field(
        default=Path("."),
        metadata=_meta("--state-dir", "state directory (cursor, alerts.jsonl, crashes/, faults/)"),
    )
    cgroup: Path | None = field(
        default=None,
        metadata=_meta(
            "--cgroup", "the service's memory cgroup directory (default: from --unit or --pid)"
        ),
    )
    unit: str | None = field(
        default=None, metadata=_meta("--unit", "systemd unit of the server (cgroup, journal tail)")
    )
    pids: tuple[int, ...] = field(
        default=(), metadata=_meta("--pid", "a process to watch (repeatable)", repeat=True)
    )
    server_url: str | None = field(
        default=None,
        metadata=_meta("--server", "the server's base URL for /health, governor and trim"),
    )
    admin_token_file: Path | None = field(
        default=None,
        metadata=_meta("--admin-token-file", "file holding the admin token for the trim call"),
    )
    interval_s: float = field(
        default=5.0, metadata=_meta("--interval", "longest time between polls, seconds")
    )
    min_interval_s: float = field(
        default=0.5, metadata=_meta("--min-interval", "shortest time between polls, seconds")
    )
    warn_pct: float = field(
        default=85.0,
        metadata=_meta("--warn-pct", "working-set warning line, % of the limit (plan: shed_pct)"),
    )
    critical_pct: float = field(
        default=97.0,
        metadata=_meta(
            "--critical-pct", "working-set critical line, % of the limit (plan: critical_pct)"
        ),
    )
    limit_bytes: int | None = field(
        default=None,
        metadata=_meta("--limit-bytes", "limit when the cgroup has none (plan: memory_high_bytes)"),
    )
    sustain_s: float = field(
        default=30.0,
        metadata=_meta("--sustain", "seconds above the warning line before the trim call"),
    )
    trim_cooldown_s: float = field(
        default=300.0, metadata=_meta("--trim-cooldown", "seconds between trim calls")
    )
    keep_recent: int = field(
        default=512, metadata=_meta("--keep-recent", "keep_recent tokens sent with the trim call")
    )
    leak_window_s: float = field(
        default=600.0,
        metadata=_meta("--leak-window", "seconds over which a rising fd/handle count is a leak"),
    )
    leak_min_increase: int = field(
        default=64,
        metadata=_meta(
            "--leak-min", "rise in fds or DMA-BUF handles over the window that is a leak"
        ),
    )
    psi_warn_pct: float = field(
        default=10.0,
        metadata=_meta("--psi-warn-pct", "memory PSI 'some' avg10 above this is a warning"),
    )
    psi_critical_pct: float = field(
        default=20.0,
        metadata=_meta("--psi-critical-pct", "memory PSI 'full' avg10 above this is critical"),
    )
    exit_settle_s: float = field(
        default=30.0,
        metadata=_meta("--exit-settle", "seconds a process must run before its exit is a crash"),
    )
    webhook_url: str | None = field(
        default=None, metadata=_meta("--webhook", "POST each alert as JSON to this URL")
    )
    alert_command: str | None = field(
        default=None,
        metadata=_meta("--alert-command", "run this command per alert (alert JSON on stdin)"),
    )
    max_bundles: int = field(
        default=10, metadata=_meta("--max-bundles", "crash bundles kept (oldest removed)")
    )
    max_bundle_bytes: int = field(
        default=64 << 20, metadata=_meta("--max-bundle-bytes", "total bytes of crash bundles kept")
    )
    http_timeout_s: float = field(
        default=2.0, metadata=_meta("--http-timeout", "timeout of each HTTP call, seconds")
    )
    root: Path = field(
        default=Path("/"),
        metadata=_meta("--root", "host root (tests: a fixture tree)", hidden=True),
    )

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.min_interval_s <= 0:
            raise ConfigError("watch: --interval and --min-interval must be > 0")
        if not 0 < self.warn_pct <= self.critical_pct <= 100:
            raise ConfigError("watch: need 0 < --warn-pct <= --critical-pct <= 100")
        if self.keep_recent < 0:
            raise ConfigError("watch: --keep-recent must be >= 0")
        if self.max_bundles < 1 or self.max_bundle_bytes < 1:
            raise ConfigError("watch: --max-bundles and --max-bundle-bytes must be >= 1")

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


def config_from_plan(plan: Plan) -> dict[str, Any]:
    """The settings a plan decides: the memory lines and the fallback limit."""
    return {
        "warn_pct": plan.watermarks.shed_pct,
        "critical_pct": plan.watermarks.critical_pct,
        "limit_bytes": plan.limits.memory_high_bytes,
    }


def with_overrides(base: WatchConfig, **values: Any) -> WatchConfig:
    """``base`` with the given fields replaced (None values are ignored)."""
    return replace(base, **{k: v for k, v in values.items() if v is not None})
