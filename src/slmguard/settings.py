"""Server settings: each declared once, with its type, default and help text.

Owns :class:`ServeSettings`, its validation, the secrets it names and the engine
settings it makes (:func:`engine_settings`: a plan's, with the engine settings given put
over them). Flags and ``SLMGUARD_*`` variables are derived from the declarations by
:mod:`slmguard.options`; the engine's (``--ctx``, ``--n-parallel`` ...) are
:class:`~slmguard.plan.schema.EngineSettings`' own, the ones ``slmguard plan`` takes
too. Precedence, highest first: flag, environment variable, the plan's (or the plan
serve makes for this host), field default. Pure apart from reading the API-key files
named by the settings and, for the default thread count, the CPUs this process may use.

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
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard import options
from slmguard.errors import ConfigError, UsageError
from slmguard.options import option
from slmguard.plan.configs import MAX_SLOTS
from slmguard.plan.overrides import EngineOverrides, ProjectorOverrides
from slmguard.plan.overrides import flag as engine_flag
from slmguard.plan.schema import KV_TYPES, EngineSettings, Plan

ENV_PREFIX = "SLMGUARD_"
#: A name a client may give as ``model`` (``--model-alias``).
MODEL_NAME_RE = re.compile(r"[\x21-\x7e]{1,256}")

#: The derived default max_tokens is never above this (a chat without max_tokens to a base
#: model otherwise runs to the end of its slot: 1,000+ tokens, minutes on a small board).
DEFAULT_MAX_TOKENS_LIMIT = 512


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``slmguard serve`` can be told. Units are in the field names."""

    model: Path | None = option(
        None, "GGUF model file (default: the plan's, checked; else the embedded Gemma 3 270M)"
    )
    plan: Path | None = option(
        None, "plan file from `slmguard plan --json` (engine settings and the model file)"
    )
    llama_server: Path | None = option(
        None,
        "the llama-server binary (default: the one `make` built beside this Python, else "
        "PATH; a plan's engine.llama_server must name that one, or be given here)",
    )
    host: str = option("127.0.0.1", "address to listen on; non-loopback needs an API key")
    port: int = option(8080, "TCP port to listen on")
    api_key: str | None = option(None, "API key clients must send as a Bearer token", secret=True)
    api_key_file: Path | None = option(None, "file holding the API key (first line)")
    admin_token_file: Path | None = option(
        None,
        "file holding the token for the /api/v1 admin routes (default: none; "
        "trim answers 403 without it)",
    )
    state_dir: Path | None = option(None, "state directory (fault logs; default: see README)")
    model_name: str | None = option(None, "model id clients use (default: the file's stem)")
    model_alias: tuple[str, ...] = option(
        (), "another name the model answers to, listed in /v1/models (repeatable)"
    )
    # The engine's settings given over the plan's (--ctx, --n-parallel, --flash-attn ...):
    # each flag is EngineSettings' own declaration (plan.schema), the plan's the default.
    engine: EngineOverrides = options.nested(EngineOverrides, verb="serve")
    # A vision projector (--mmproj, checked against the plan's like the model) and the
    # image bounds (the plan's, or lower): ProjectorSpec's own declarations.
    projector: ProjectorOverrides = options.nested(ProjectorOverrides, verb="serve")
    chat_template_file: Path | None = option(
        None,
        "a Jinja chat template for the engine instead of the model's own (a GGUF without "
        "one, such as the embedded base model, gets ChatML)",
    )
    engine_load_timeout_s: float = option(300.0, "how long the engine may take to load")
    stall_timeout_s: float | None = option(
        None,
        "no engine progress for this long while requests run is a stall (default: "
        "--stall-factor x the longest engine step the front's own probe measured here, at least "
        "--stall-floor-s)",
    )
    stall_floor_s: float = option(15.0, "the derived stall time is never shorter than this")
    stall_factor: float = option(8.0, "the stall time in longest engine steps")
    canary_interval_s: float = option(
        120.0,
        "when idle, prove decode works with a one-token generation (an embedding or a rerank "
        "on such a model) this often (0: off)",
    )
    sessions: bool = option(True, "keep conversations on the server for session_id")
    queue_size: int = option(8, "requests that may wait for an engine slot; more get 429")
    max_body_bytes: int = option(1 << 20, "largest request body accepted; more gets 413")
    max_tokens_cap: int | None = option(None, "upper bound on max_tokens for every request")
    default_max_tokens: int | None = option(
        None,
        "max_tokens of a request that gives none (default: a quarter of one slot's context, "
        f"at most {DEFAULT_MAX_TOKENS_LIMIT})",
    )
    retry_after_s: int = option(2, "Retry-After seconds sent with 429 and 503")
    retry_after_max_s: int = option(
        60,
        "most Retry-After seconds a 503 about an engine on its way back says (its restart "
        "backoff left plus its last load time; never less than --retry-after-s)",
    )
    max_json_depth: int = option(
        64, "deepest nesting of any JSON field of a request; more gets 400"
    )
    max_grammar_bytes: int = option(32 << 10, "largest `grammar` a request may send (bytes)")
    max_grammar_nesting: int = option(
        64, "deepest nesting of parentheses in a grammar or a schema's pattern"
    )
    max_grammar_alternatives: int = option(
        1024, "most alternatives (`|`, anyOf, oneOf) in a grammar, a pattern or a schema list"
    )
    max_repetition: int = option(
        1024, "largest repetition count in a grammar or pattern ({m,n}) or schema (maxItems ...)"
    )
    max_repetition_product: int = option(
        1024,
        "largest product of nested repetition counts in a grammar or a schema's pattern "
        "(a group or rule repeated {0,m} that holds x{0,n}: m x n); siblings add",
    )
    max_grammar_stacks: int = option(
        256,
        "most parse stacks the engine may check one token's first characters against, for "
        "a grammar or a schema's pattern (an ambiguous grammar's paths, simulated before "
        "the engine; 0: not checked)",
    )
    max_schema_bytes: int = option(32 << 10, "largest JSON schema a request may send (bytes)")
    max_schema_depth: int = option(32, "deepest nesting of a JSON schema a request may send")
    max_schema_enum: int = option(256, "most values of one `enum` in a JSON schema")
    engine_oom_score_adj: int = option(1000, "oom_score_adj the engine child starts with")
    front_oom_score_adj: int = option(
        -500, "oom_score_adj the front tries to set (needs CAP_SYS_RESOURCE; logged if denied)"
    )
    restart_backoff_initial_s: float = option(0.5, "first delay before restarting a dead engine")
    restart_backoff_max_s: float = option(30.0, "longest delay between engine restarts")
    restart_max: int = option(5, "engine restarts allowed within --restart-window-s")
    restart_window_s: float = option(60.0, "window for --restart-max; beyond it the server exits")
    governor: bool = option(
        True, "memory governor: shed, cap, trim, shrink slots and context, park the engine"
    )
    memory_budget_bytes: int | None = option(
        None, "memory budget for the governor (default: plan and cgroup limits)"
    )
    shutdown_grace_s: float = option(10.0, "how long a stop waits for in-flight requests")
    header_timeout_s: float = option(
        10.0, "a client must send its request headers within this time"
    )
    body_timeout_s: float = option(30.0, "a client must send its request body within this time")

    def redacted(self) -> dict[str, Any]:
        return options.redacted(self)

    def overrides(self) -> EngineOverrides:
        """The engine settings actually given (flags and ``SLMGUARD_*`` variables), to put
        over a plan's (:func:`engine_settings`)."""
        return self.engine


def flag_name(name: str) -> str:
    """The flag of a setting: an engine setting's as EngineSettings declares it."""
    engine = {f.name for f in dataclasses.fields(EngineSettings)}
    return engine_flag(name) if name in engine else options.default_flag(name)


def env_name(name: str) -> str:
    return options.env_name(ENV_PREFIX, name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (see :mod:`slmguard.options`)."""
    options.add_flags(parser, ServeSettings, ENV_PREFIX)


#: What the engine flags are checked against before this host is planned (serve's own
#: defaults): a setting no engine can run is refused (78) before any model work.
UNPLANNED = EngineSettings(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=1)


def resolve(
    args: argparse.Namespace | None,
    env: Mapping[str, str] | None = None,
    plan: Plan | None = None,
) -> ServeSettings:
    """Flag > environment > default into validated settings; the engine settings given
    are checked over the plan's (``plan``), or over :data:`UNPLANNED` before this host
    is planned (:func:`check_engine`)."""
    env = os.environ if env is None else env
    settings = ServeSettings(**options.collect(ServeSettings, args, env, ENV_PREFIX))
    validate(settings)
    check_engine(engine_settings(plan.engine if plan is not None else UNPLANNED, settings))
    return settings


def deprecations(args: argparse.Namespace | None, env: Mapping[str, str]) -> list[str]:
    """What to tell the user about deprecated settings and old spellings they gave."""
    given = options.collect(ServeSettings, args, env, ENV_PREFIX)["engine"]
    said = options.renamed(args)
    n_ctx = given.get("n_ctx")
    if n_ctx is None:
        return said
    return [
        *said,
        f"--n-ctx / {env_name('n_ctx')} is deprecated: it is the total of all slots "
        f"({n_ctx} tokens here); give --ctx / {env_name('ctx')}, the context per "
        "slot, as `slmguard plan --ctx` takes it",
    ]


def _validate_engine(e: EngineOverrides) -> None:
    """The engine settings given, each alone (their relations: :func:`check_engine`)."""
    for name in ("n_ctx", "n_batch", "n_ubatch", "n_parallel", "n_threads"):
        value = e.get(name)
        if value is not None and value <= 0:
            raise ConfigError(f"{flag_name(name)} must be > 0, got {value}")
    if e.get("kv_type") not in (None, *KV_TYPES):
        raise ConfigError(
            f"--kv-type must be one of {', '.join(KV_TYPES)}, got {e.get('kv_type')!r}"
        )
    cache = e.get("cache_ram_mib")
    if cache is not None and cache < 0:
        raise ConfigError(f"{flag_name('cache_ram_mib')} must be >= 0, got {cache}")
    if e.ctx is not None and e.ctx <= 0:
        raise ConfigError(f"--ctx must be > 0 tokens per slot, got {e.ctx}")
    if e.ctx is not None and e.get("n_ctx") is not None:
        raise ConfigError(
            "give --ctx (context per slot) or the deprecated --n-ctx (total of all slots), not both"
        )


def check_engine(e: EngineSettings) -> None:
    """Engine settings no engine runs, with the flags that set them (78)."""
    if e.n_ctx_slot < 1:
        raise ConfigError(
            f"{flag_name('n_ctx')} {e.n_ctx} leaves no context for {e.n_parallel} slots"
        )
    if e.n_parallel > MAX_SLOTS:
        raise ConfigError(f"{flag_name('n_parallel')} must be 1 to {MAX_SLOTS}, got {e.n_parallel}")
    if e.kv_type != "f16" and not e.flash_attn:
        raise ConfigError(
            f"{flag_name('kv_type')} {e.kv_type} needs {flag_name('flash_attn')} (llama.cpp "
            "quantizes the V cache only with flash attention)"
        )


def validate(s: ServeSettings) -> None:
    _validate_engine(s.engine)
    try:
        s.projector.check(alone=True)  # a plan's projector takes the bounds without --mmproj
    except UsageError as err:
        raise ConfigError(err.message) from err
    positive = (
        "queue_size", "max_body_bytes", "restart_max", "engine_load_timeout_s",
        "header_timeout_s", "body_timeout_s", "stall_floor_s", "stall_factor",
        "max_json_depth", "max_grammar_bytes", "max_grammar_nesting",
        "max_grammar_alternatives", "max_repetition", "max_schema_bytes", "max_schema_depth",
        "max_schema_enum", "max_repetition_product",
    )  # fmt: skip
    for name in positive:
        if getattr(s, name) <= 0:
            raise ConfigError(f"{flag_name(name)} must be > 0, got {getattr(s, name)}")
    if s.max_grammar_stacks < 0:
        raise ConfigError(f"--max-grammar-stacks must be >= 0, got {s.max_grammar_stacks}")
    if s.memory_budget_bytes is not None and s.memory_budget_bytes <= 0:
        raise ConfigError(f"--memory-budget-bytes must be > 0, got {s.memory_budget_bytes}")
    if s.max_tokens_cap is not None and s.max_tokens_cap <= 0:
        raise ConfigError(f"--max-tokens-cap must be > 0, got {s.max_tokens_cap}")
    if not 0 < s.port < 65536:
        raise ConfigError(f"--port must be 1-65535, got {s.port}")
    if s.stall_timeout_s is not None and s.stall_timeout_s <= 0:
        raise ConfigError(f"--stall-timeout-s must be > 0, got {s.stall_timeout_s}")
    if s.canary_interval_s < 0:
        raise ConfigError(f"--canary-interval-s must be >= 0, got {s.canary_interval_s}")
    if s.default_max_tokens is not None and s.default_max_tokens <= 0:
        raise ConfigError(f"--default-max-tokens must be > 0, got {s.default_max_tokens}")
    if not -1000 <= s.engine_oom_score_adj <= 1000 or not -1000 <= s.front_oom_score_adj <= 1000:
        raise ConfigError("oom_score_adj values must be within -1000..1000")
    if not 0 < s.retry_after_s <= s.retry_after_max_s:
        raise ConfigError("need 0 < --retry-after-s <= --retry-after-max-s")
    if s.restart_backoff_initial_s <= 0 or s.restart_backoff_max_s < s.restart_backoff_initial_s:
        raise ConfigError("need 0 < --restart-backoff-initial-s <= --restart-backoff-max-s")
    for alias in s.model_alias:
        if not MODEL_NAME_RE.fullmatch(alias):
            raise ConfigError(f"--model-alias {alias!r}: a model name is 1-256 printable "
                              "characters without spaces")  # fmt: skip


def engine_settings(base: EngineSettings, s: ServeSettings) -> EngineSettings:
    """The engine's settings: ``base`` (a plan's: every field, those serve has no flag
    for included) with serve's engine settings over it (:meth:`ServeSettings.overrides`:
    the fields given, then ``--ctx`` x the slots)."""
    engine: EngineSettings = s.overrides().over(base)
    return engine


def engine_flags(s: ServeSettings, fields: Iterable[str]) -> str:
    """The flags, with their values, that set these engine fields: ``--ctx 8192
    --n-parallel 4`` (the context as it was given: ``--ctx``, else ``--n-ctx``). The same
    values may have come from their ``SLMGUARD_*`` variables; a field serve has no flag
    for, or that was not given, is ``engine.<name>``."""
    e = s.overrides()
    flags = {spec.name: spec.flag for spec in options.specs(ServeSettings, ENV_PREFIX)}
    shown = []
    for name in fields:
        value = e.get(name)
        if name == "n_ctx" and e.ctx is not None:
            shown.append(f"--ctx {e.ctx}")
        elif value is None or name not in flags:
            shown.append(f"engine.{name}")
        elif isinstance(value, bool):
            shown.append(flags[name] if value else "--no-" + flags[name][2:])
        else:
            shown.append(f"{flags[name]} {value}")
    return " ".join(shown)


def default_threads() -> int:
    """Usable CPUs (affinity, cgroup cpuset and cpu.max quota), never ``os.cpu_count()``."""
    from slmguard.host.cpu import usable_threads

    return usable_threads()


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


@dataclass(frozen=True)
class Tokens:
    """The secrets of one server: the clients' API key and the admin token, which must
    differ (ConfigError, 78): the engine views and trimming must not open to every API
    client."""

    api_key: str | None
    admin_token: str | None

    def __post_init__(self) -> None:
        if self.admin_token is not None and self.admin_token == self.api_key:
            raise ConfigError(
                "the admin token equals the API key: every API client would be an admin",
                hint="give --admin-token-file a secret of its own",
            )


def admin_token(s: ServeSettings) -> str | None:
    """The admin token from --admin-token-file; None (admin routes disabled) without it.

    It never falls back to the API key: every API client would then be an admin.
    """
    if s.admin_token_file is not None:
        return _read_secret(s.admin_token_file, "admin token file")
    return None


def default_max_tokens(s: ServeSettings, n_ctx_slot: int) -> int:
    """``max_tokens`` of a request that gives none: ``--default-max-tokens``, else a
    quarter of one slot's context, at most :data:`DEFAULT_MAX_TOKENS_LIMIT`."""
    if s.default_max_tokens is not None:
        return s.default_max_tokens
    return derived_max_tokens(n_ctx_slot)


def derived_max_tokens(n_ctx_slot: int) -> int:
    """A quarter of one slot's context, at most :data:`DEFAULT_MAX_TOKENS_LIMIT`."""
    return max(1, min(DEFAULT_MAX_TOKENS_LIMIT, n_ctx_slot // 4))
