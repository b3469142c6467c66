"""Server settings: each declared once, with its type, default and help text.

Owns :class:`ServeSettings` and the derivation of its command-line flags
(``--n-ctx``) and environment variables (``SLMGUARD_N_CTX``) from the field
list, so no option is written three times. Precedence, highest first: flag,
environment variable, plan file (engine fields only, ``plan.engine``),
field default. Pure apart from reading the API-key files named by the settings.

Example::

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = resolve(parser.parse_args(["--port", "9000"]), env={}, plan=None)
    settings.port  # 9000
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard.errors import ConfigError
from slmguard.planfile import Plan

ENV_PREFIX = "SLMGUARD_"
KV_TYPES = ("f16", "q8_0", "q4_0")


def _meta(help: str, *, plan: bool = False, secret: bool = False) -> dict[str, Any]:
    return {"help": help, "plan": plan, "secret": secret}


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``slmguard serve`` can be told. Units are in the field names."""

    model: Path | None = field(
        default=None, metadata=_meta("GGUF model file (default: the embedded Gemma 3 270M)")
    )
    plan: Path | None = field(
        default=None, metadata=_meta("plan file from `slmguard plan --json` (engine settings)")
    )
    host: str = field(
        default="127.0.0.1", metadata=_meta("address to listen on; non-loopback needs an API key")
    )
    port: int = field(default=8080, metadata=_meta("TCP port to listen on"))
    api_key: str | None = field(
        default=None, metadata=_meta("API key clients must send as a Bearer token", secret=True)
    )
    api_key_file: Path | None = field(
        default=None, metadata=_meta("file holding the API key (first line)")
    )
    admin_token_file: Path | None = field(
        default=None,
        metadata=_meta(
            "file holding the token for the /api/v1 admin routes (default: none; "
            "trim answers 403 without it)"
        ),
    )
    state_dir: Path | None = field(
        default=None, metadata=_meta("state directory (fault logs; default: see README)")
    )
    model_name: str | None = field(
        default=None, metadata=_meta("model id clients use (default: the file's stem)")
    )
    n_ctx: int = field(default=2048, metadata=_meta("context size in tokens", plan=True))
    n_batch: int = field(
        default=512, metadata=_meta("logical batch size for prompt processing", plan=True)
    )
    n_ubatch: int = field(
        default=512, metadata=_meta("physical batch size for prompt processing", plan=True)
    )
    n_threads: int | None = field(
        default=None,
        metadata=_meta("engine threads (default: CPUs in this process's affinity mask)", plan=True),
    )
    kv_type: str = field(
        default="f16", metadata=_meta("KV cache type: f16, q8_0 or q4_0", plan=True)
    )
    use_mlock: bool = field(
        default=False, metadata=_meta("lock the model in RAM (mlock)", plan=True)
    )
    use_mmap: bool = field(
        default=True, metadata=_meta("map the model file instead of reading it", plan=True)
    )
    queue_size: int = field(
        default=8, metadata=_meta("requests that may wait for the engine; more get 429")
    )
    max_body_bytes: int = field(
        default=1 << 20, metadata=_meta("largest request body accepted; more gets 413")
    )
    max_tokens_cap: int | None = field(
        default=None, metadata=_meta("upper bound on max_tokens for every request")
    )
    retry_after_s: int = field(
        default=2, metadata=_meta("Retry-After seconds sent with 429 and 503")
    )
    worker_oom_score_adj: int = field(
        default=1000, metadata=_meta("oom_score_adj the engine worker sets for itself")
    )
    front_oom_score_adj: int = field(
        default=-500,
        metadata=_meta(
            "oom_score_adj the front tries to set (needs CAP_SYS_RESOURCE; logged if denied)"
        ),
    )
    restart_backoff_initial_s: float = field(
        default=0.5, metadata=_meta("first delay before restarting a dead worker")
    )
    restart_backoff_max_s: float = field(
        default=30.0, metadata=_meta("longest delay between worker restarts")
    )
    restart_max: int = field(
        default=5, metadata=_meta("worker restarts allowed within --restart-window-s")
    )
    restart_window_s: float = field(
        default=60.0, metadata=_meta("window for --restart-max; beyond it the server exits")
    )
    governor: bool = field(
        default=True,
        metadata=_meta("memory governor: shed, cap and shrink the context under pressure"),
    )
    memory_budget_bytes: int | None = field(
        default=None,
        metadata=_meta("memory budget for the governor (default: plan and cgroup limits)"),
    )
    shutdown_grace_s: float = field(
        default=10.0, metadata=_meta("how long a stop waits for in-flight requests")
    )

    def redacted(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = "***" if f.metadata.get("secret") and v else v
        return out


def _base_type(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner
    return tp


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(ServeSettings)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; defaults stay None so the other sources can fill in."""
    hints = _hints()
    for f in dataclasses.fields(ServeSettings):
        tp = _base_type(hints[f.name])
        helptext = f"{f.metadata['help']} [env {env_name(f.name)}; default {f.default}]"
        if tp is bool:
            parser.add_argument(
                flag_name(f.name), action=argparse.BooleanOptionalAction, default=None,
                help=helptext,
            )  # fmt: skip
        else:
            kwargs: dict[str, Any] = {"type": tp, "default": None, "help": helptext}
            if f.name == "kv_type":
                kwargs["choices"] = KV_TYPES
            parser.add_argument(flag_name(f.name), metavar=f.name.upper(), **kwargs)


def _from_env(name: str, tp: Any, raw: str) -> Any:
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return tp(raw)
    except ValueError as err:
        raise ConfigError(f"{env_name(name)}={raw!r} is not a valid {tp.__name__}") from err


def resolve(
    args: argparse.Namespace | None,
    env: Mapping[str, str] | None = None,
    plan: Plan | None = None,
) -> ServeSettings:
    """Merge flag > environment > plan > default into validated settings."""
    env = os.environ if env is None else env
    hints = _hints()
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServeSettings):
        tp = _base_type(hints[f.name])
        flag = getattr(args, f.name, None) if args is not None else None
        if flag is not None:
            values[f.name] = flag
        elif env.get(env_name(f.name)):
            values[f.name] = _from_env(f.name, tp, env[env_name(f.name)])
        elif plan is not None and f.metadata.get("plan") and hasattr(plan.engine, f.name):
            values[f.name] = getattr(plan.engine, f.name)
    settings = ServeSettings(**values)
    validate(settings)
    return settings


def validate(s: ServeSettings) -> None:
    positive = ("n_ctx", "n_batch", "n_ubatch", "queue_size", "max_body_bytes", "restart_max")
    for name in positive:
        if getattr(s, name) <= 0:
            raise ConfigError(f"{flag_name(name)} must be > 0, got {getattr(s, name)}")
    if s.n_threads is not None and s.n_threads <= 0:
        raise ConfigError(f"--n-threads must be > 0, got {s.n_threads}")
    if s.memory_budget_bytes is not None and s.memory_budget_bytes <= 0:
        raise ConfigError(f"--memory-budget-bytes must be > 0, got {s.memory_budget_bytes}")
    if s.max_tokens_cap is not None and s.max_tokens_cap <= 0:
        raise ConfigError(f"--max-tokens-cap must be > 0, got {s.max_tokens_cap}")
    if not 0 < s.port < 65536:
        raise ConfigError(f"--port must be 1-65535, got {s.port}")
    if s.kv_type not in KV_TYPES:
        raise ConfigError(f"--kv-type must be one of {', '.join(KV_TYPES)}, got {s.kv_type!r}")
    if not -1000 <= s.worker_oom_score_adj <= 1000 or not -1000 <= s.front_oom_score_adj <= 1000:
        raise ConfigError("oom_score_adj values must be within -1000..1000")
    if s.restart_backoff_initial_s <= 0 or s.restart_backoff_max_s < s.restart_backoff_initial_s:
        raise ConfigError("need 0 < --restart-backoff-initial-s <= --restart-backoff-max-s")


def default_threads() -> int:
    """CPUs this process may run on (affinity mask), never ``os.cpu_count()``."""
    return max(1, len(os.sched_getaffinity(0)))


def _read_secret(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read {what}: {err.strerror}", path=path) from err
    value = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not value:
        raise ConfigError(f"{what} is empty", path=path)
    return value


def api_key(s: ServeSettings) -> str | None:
    """The API key from --api-key / SLMGUARD_API_KEY, or --api-key-file."""
    if s.api_key:
        return s.api_key
    if s.api_key_file is not None:
        return _read_secret(s.api_key_file, "API key file")
    return None


def admin_token(s: ServeSettings) -> str | None:
    """The admin token from --admin-token-file; None (admin routes disabled) without it.

    It never falls back to the API key: every API client would then be an admin.
    """
    if s.admin_token_file is not None:
        return _read_secret(s.admin_token_file, "admin token file")
    return None
