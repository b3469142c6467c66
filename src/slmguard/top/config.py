"""The settings of ``slmguard top``, declared once: type, default, help text and flag.

Each field of :class:`TopConfig` is declared with :func:`slmguard.options.option`;
``slmguard.commands.top`` derives the flags and the ``SLMGUARD_TOP_*``
environment variables from them. Tokens are named by file (never passed on
the command line, where ``ps`` shows them): the admin token from
``--admin-token-file``, else the systemd credential
``$CREDENTIALS_DIRECTORY/admin-token`` (what the rendered units hand the
server and the watcher); the API key from ``--api-key-file``, else
``SLMGUARD_API_KEY`` (the server's own variable).

Example::

    cfg = TopConfig(server_url="http://127.0.0.1:8080", unit="slmguard.service")
    cfg.interval_s, cfg.keep_recent   # 1.0, 512
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import ConfigError, HostReadError
from slmguard.options import option

ENV_PREFIX = "SLMGUARD_TOP_"
ADMIN_CREDENTIAL = "admin-token"  # the name deploy.units gives the credential
DEFAULT_SERVER = "http://127.0.0.1:8080"
DEFAULT_UNIT = "slmguard.service"
MAX_TOKEN_BYTES = 4096


@dataclass(frozen=True)
class TopConfig:
    """Everything ``slmguard top`` can be told. Units are in the field names."""

    server_url: str = option(DEFAULT_SERVER, "the server's base URL", flag="--server")
    admin_token_file: Path | None = option(
        None,
        "file holding the admin token (governor status, the t trim key; default: "
        "$CREDENTIALS_DIRECTORY/admin-token when present)",
    )
    api_key_file: Path | None = option(
        None, "file holding the API key for /metrics (default: $SLMGUARD_API_KEY)"
    )
    local: bool | None = option(
        None,
        "read this board's cgroup, PSI, CPU and thermal files (default: when --server is "
        "a loopback address)",
    )
    plan: Path | None = option(None, "plan file: planned parts, limits and n_ctx to compare")
    unit: str | None = option(
        DEFAULT_UNIT, "systemd unit of the server (its cgroup is read when top runs on the board)"
    )
    cgroup: Path | None = option(None, "the service's memory cgroup directory (default: --unit's)")
    state_dir: Path | None = option(
        None, "watch's state directory (alerts.jsonl, crashes/)", shown_default="see README"
    )
    interval_s: float = option(1.0, "seconds between refreshes", flag="--interval")
    keep_recent: int = option(512, "keep_recent tokens the t key sends to the trim API")
    http_timeout_s: float = option(2.0, "timeout of each HTTP call, seconds", flag="--http-timeout")
    events: int = option(200, "events kept in the timeline")
    root: Path = option(Path("/"), "host root (tests: a fixture tree)", hidden=True)

    def __post_init__(self) -> None:
        if not 0.05 <= self.interval_s <= 3600:
            raise ConfigError("top: --interval must be between 0.05 and 3600 seconds")
        if not 0.05 <= self.http_timeout_s <= 120:
            raise ConfigError("top: --http-timeout must be between 0.05 and 120 seconds")
        if not 0 <= self.keep_recent <= 1 << 20:
            raise ConfigError("top: --keep-recent must be between 0 and 1048576")
        if not 1 <= self.events <= 100_000:
            raise ConfigError("top: --events must be between 1 and 100000")
        if not self.server_url.startswith(("http://", "https://")):
            raise ConfigError(f"top: --server {self.server_url!r}: use http:// or https://")


def read_token(path: Path) -> str | None:
    """The first line of a token file; None when it is empty. HostReadError when unreadable."""
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_TOKEN_BYTES)
    except OSError as err:
        raise HostReadError(path, f"token file: {err.strerror or err}") from err
    lines = data.decode("utf-8", errors="replace").splitlines()
    token = lines[0].strip() if lines else ""
    return token or None


def admin_token_path(config: TopConfig, env: Mapping[str, str]) -> Path | None:
    """--admin-token-file, else the systemd credential when it exists."""
    if config.admin_token_file is not None:
        return config.admin_token_file
    creds = env.get("CREDENTIALS_DIRECTORY")
    if creds:
        candidate = Path(creds) / ADMIN_CREDENTIAL
        if candidate.exists():
            return candidate
    return None


def api_key(config: TopConfig, env: Mapping[str, str]) -> str | None:
    if config.api_key_file is not None:
        return read_token(config.api_key_file)
    return env.get("SLMGUARD_API_KEY") or None
