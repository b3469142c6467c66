"""Server settings: each declared once, with its type, default and help text.

Owns :class:`ServeSettings`, its validation, the secrets it names and the
engine settings it makes (:func:`engine_settings`). The command-line flags
(``--n-ctx``) and environment variables (``SLMGUARD_N_CTX``) are derived from
the field list by :mod:`slmguard.options`, so no option is written three
times. Precedence, highest first: flag, environment variable, plan file (the
fields marked ``plan=True``: each is the ``plan.engine`` field of its name),
field default. Pure apart from reading the API-key files named by the settings
and, for the default thread count, the CPUs this process may use.

Example::

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = resolve(parser.parse_args(["--port", "9000"]), env={}, plan=None)
    settings.port  # 9000
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slmguard import options
from slmguard.errors import ConfigError
from slmguard.options import option
from slmguard.plan.configs import MAX_SLOTS
from slmguard.plan.inputs import PlanChoices
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
    ctx: int | None = option(
        None,
        "context per slot in tokens, as `slmguard plan --ctx` (default: planned for this "
        "host; with --plan, the plan's)",
    )
    n_ctx: int = option(
        2048,
        "deprecated: the total context of all slots (llama-server's -c); give --ctx, the "
        "context per slot, instead",
        plan=True,
        shown_default="planned",
    )
    n_batch: int = option(
        512, "logical batch size for prompt processing", plan=True, shown_default="planned"
    )
    n_ubatch: int = option(
        512, "physical batch size for prompt processing", plan=True, shown_default="planned"
    )
    n_threads: int | None = option(
        None,
        "engine threads (default: usable CPUs: the affinity mask and the cgroup's cpuset, "
        "capped by its cpu.max quota)",
        plan=True,
    )
    kv_type: str = option(
        "f16", "KV cache type", plan=True, choices=KV_TYPES, shown_default="planned"
    )
    use_mlock: bool = option(False, "lock the model in RAM (mlock)", plan=True)
    use_mmap: bool = option(True, "map the model file instead of reading it", plan=True)
    swa_full: bool = option(True, "full-size KV cache for sliding-window layers", plan=True)
    n_parallel: int = option(
        1, "engine slots: generations decoded together", plan=True, shown_default="planned"
    )
    kv_unified: bool = option(False, "one KV cache shared by the slots", plan=True)
    flash_attn: bool = option(
        False, "flash attention (a quantized V cache needs it)", plan=True,
        shown_default="planned",
    )  # fmt: skip
    cache_ram_mib: int = option(0, "llama-server's prompt cache in RAM (MiB; 0: none)", plan=True)
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


def flag_name(name: str) -> str:
    return options.default_flag(name)


def env_name(name: str) -> str:
    return options.env_name(ENV_PREFIX, name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (see :mod:`slmguard.options`)."""
    options.add_flags(parser, ServeSettings, ENV_PREFIX)


def resolve(
    args: argparse.Namespace | None,
    env: Mapping[str, str] | None = None,
    plan: Plan | None = None,
) -> ServeSettings:
    """Merge flag > environment > plan > default into validated settings."""
    env = os.environ if env is None else env
    base = {}
    if plan is not None:
        for spec in options.specs(ServeSettings, ENV_PREFIX):
            # A plan=True field is the plan.engine field of its name (tested: a
            # rename on either side fails here, never silently).
            value = getattr(plan.engine, spec.name) if spec.plan else None
            if value is not None:
                base[spec.name] = spec.kind(value) if spec.kind is Path else value
    values = options.collect(ServeSettings, args, env, ENV_PREFIX, base)
    given = options.collect(ServeSettings, args, env, ENV_PREFIX)
    if given.get("ctx") is not None:
        if given.get("n_ctx") is not None:
            raise ConfigError(
                "give --ctx (context per slot) or the deprecated --n-ctx (total of all "
                "slots), not both"
            )
        if given["ctx"] > 0:  # the total is per slot x slots, as the plan writes it
            values["n_ctx"] = given["ctx"] * values.get("n_parallel", 1)
    settings = ServeSettings(**values)
    validate(settings)
    return settings


def deprecations(args: argparse.Namespace | None, env: Mapping[str, str]) -> list[str]:
    """What to tell the user about deprecated settings they gave."""
    given = options.collect(ServeSettings, args, env, ENV_PREFIX)
    if given.get("n_ctx") is None:
        return []
    return [
        f"--n-ctx / {env_name('n_ctx')} is deprecated: it is the total of all slots "
        f"({given['n_ctx']} tokens here); give --ctx / {env_name('ctx')}, the context per "
        "slot, as `slmguard plan --ctx` takes it"
    ]


def host_planning(
    args: argparse.Namespace | None, env: Mapping[str, str] | None = None
) -> tuple[Path | None, int | None, PlanChoices]:
    """What serve asks the host's planner for when there is no plan: the model, the
    context per slot and the choices the flags and environment fixed. The deprecated
    ``--n-ctx`` keeps its meaning: that total over ``--n-parallel`` slots (1 unless given).
    Values that are out of range are left to the planner's default and refused by
    :func:`validate` afterwards, with the flag's name."""
    env = os.environ if env is None else env
    given = options.collect(ServeSettings, args, env, ENV_PREFIX)
    slots = given.get("n_parallel")
    slots = slots if slots is not None and 1 <= slots <= MAX_SLOTS else None
    ctx = given.get("ctx")
    if given.get("n_ctx") is not None:
        slots = slots or 1
        ctx = given["n_ctx"] // slots
    engine = {
        "n_parallel": slots,
        "flash_attn": given.get("flash_attn"),
        "kv_unified": given.get("kv_unified") or None,
        "cache_ram_mib": max(0, given.get("cache_ram_mib") or 0) or None,
    }
    choices = PlanChoices(engine={k: v for k, v in engine.items() if v is not None})
    return given.get("model"), ctx if ctx is not None and ctx > 0 else None, choices


def validate(s: ServeSettings) -> None:
    positive = (
        "n_ctx", "n_batch", "n_ubatch", "queue_size", "max_body_bytes", "restart_max",
        "n_parallel", "engine_load_timeout_s", "header_timeout_s", "body_timeout_s",
        "stall_floor_s", "stall_factor", "max_json_depth", "max_grammar_bytes",
        "max_grammar_nesting", "max_grammar_alternatives", "max_repetition", "max_schema_bytes",
        "max_schema_depth", "max_schema_enum", "max_repetition_product",
    )  # fmt: skip
    for name in positive:
        if getattr(s, name) <= 0:
            raise ConfigError(f"{flag_name(name)} must be > 0, got {getattr(s, name)}")
    if s.max_grammar_stacks < 0:
        raise ConfigError(f"--max-grammar-stacks must be >= 0, got {s.max_grammar_stacks}")
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
    if s.stall_timeout_s is not None and s.stall_timeout_s <= 0:
        raise ConfigError(f"--stall-timeout-s must be > 0, got {s.stall_timeout_s}")
    if s.canary_interval_s < 0:
        raise ConfigError(f"--canary-interval-s must be >= 0, got {s.canary_interval_s}")
    if s.cache_ram_mib < 0:
        raise ConfigError(f"--cache-ram-mib must be >= 0, got {s.cache_ram_mib}")
    if s.ctx is not None and s.ctx <= 0:
        raise ConfigError(f"--ctx must be > 0 tokens per slot, got {s.ctx}")
    if _slot_shape(s).n_ctx_slot < 1:
        raise ConfigError(f"--n-ctx {s.n_ctx} leaves no context for {s.n_parallel} slots")
    if s.n_parallel > MAX_SLOTS:
        raise ConfigError(f"--n-parallel must be 1 to {MAX_SLOTS}, got {s.n_parallel}")
    if s.default_max_tokens is not None and s.default_max_tokens <= 0:
        raise ConfigError(f"--default-max-tokens must be > 0, got {s.default_max_tokens}")
    if s.kv_type != "f16" and not s.flash_attn:
        raise ConfigError(f"--kv-type {s.kv_type} needs --flash-attn (llama.cpp quantizes the "
                          "V cache only with flash attention)")  # fmt: skip
    if not -1000 <= s.engine_oom_score_adj <= 1000 or not -1000 <= s.front_oom_score_adj <= 1000:
        raise ConfigError("oom_score_adj values must be within -1000..1000")
    if s.restart_backoff_initial_s <= 0 or s.restart_backoff_max_s < s.restart_backoff_initial_s:
        raise ConfigError("need 0 < --restart-backoff-initial-s <= --restart-backoff-max-s")
    for alias in s.model_alias:
        if not MODEL_NAME_RE.fullmatch(alias):
            raise ConfigError(f"--model-alias {alias!r}: a model name is 1-256 printable "
                              "characters without spaces")  # fmt: skip


def _slot_shape(s: ServeSettings) -> EngineSettings:
    return EngineSettings(
        n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch, n_threads=1,
        n_parallel=s.n_parallel, kv_unified=s.kv_unified,
    )  # fmt: skip


def engine_settings(s: ServeSettings, plan: Plan | None) -> EngineSettings:
    """The engine's settings: the plan's (every field, those serve has no flag for
    included), with serve's own where it has a flag. Those already hold flag >
    environment > plan > default (:func:`resolve`); ``n_threads`` unset is the
    CPUs this process may use."""
    base = plan.engine if plan is not None else _slot_shape(s)
    return replace(
        base,
        n_ctx=s.n_ctx,
        n_batch=s.n_batch,
        n_ubatch=s.n_ubatch,
        n_threads=s.n_threads or default_threads(),
        kv_type=s.kv_type,
        use_mmap=s.use_mmap,
        use_mlock=s.use_mlock,
        swa_full=s.swa_full,
        n_parallel=s.n_parallel,
        kv_unified=s.kv_unified,
        flash_attn=s.flash_attn,
        cache_ram_mib=s.cache_ram_mib,
    )


def engine_flags(s: ServeSettings, fields: Iterable[str]) -> str:
    """The flags, with their values, that set these engine fields: ``--ctx 8192
    --n-parallel 4`` (the context as it was given: ``--ctx``, else ``--n-ctx``). The same
    values may have come from their ``SLMGUARD_*`` variables."""
    shown = []
    for name in fields:
        if name == "n_ctx" and s.ctx is not None:
            shown.append(f"--ctx {s.ctx}")
            continue
        if not hasattr(s, name):  # an engine field serve has no flag for
            shown.append(f"engine.{name}")
            continue
        value = getattr(s, name)
        flag = flag_name(name)
        if isinstance(value, bool):
            shown.append(flag if value else "--no-" + flag[2:])
        else:
            shown.append(f"{flag} {value}")
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
