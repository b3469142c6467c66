"""Settings declared once: a frozen dataclass's fields become flags and environment variables.

Owns the one mechanism behind the settings of ``slmguard serve``
(:class:`slmguard.settings.ServeSettings`, variables ``SLMGUARD_*``) and
``slmguard watch`` (:class:`slmguard.watch.config.WatchConfig`, variables
``SLMGUARD_WATCH_*``). Each field is declared with :func:`option`: its default,
its help text and, where it differs from the field name, its flag. From the
field list :func:`add_flags` builds one argparse option per field and
:func:`collect` merges, highest first, the flag, the environment variable and
the caller's base values (a plan's, a computed default). Pure: the
environment is passed in.

Example::

    @dataclass(frozen=True)
    class Settings:
        port: int = option(8080, "TCP port to listen on")

    add_flags(parser, Settings, "APP_")            # --port PORT  [env APP_PORT; default 8080]
    Settings(**collect(Settings, args, {"APP_PORT": "9000"}, "APP_"))
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from slmguard.errors import ConfigError

T = TypeVar("T")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def option(
    default: T,
    help: str,
    *,
    flag: str | None = None,
    plan: bool = False,
    secret: bool = False,
    hidden: bool = False,
    choices: Sequence[str] | None = None,
    shown_default: str | None = None,
) -> T:
    """A dataclass field with what the flag needs.

    ``flag`` defaults to ``--field-name``; ``plan`` marks fields a plan file
    supplies; ``secret`` values are redacted in logs; ``hidden`` ones are left
    out of ``--help`` (test hooks); ``shown_default`` is what ``--help`` says
    when the real default is computed elsewhere.
    """
    meta = {"help": help, "flag": flag, "plan": plan, "secret": secret, "hidden": hidden,
            "choices": tuple(choices) if choices else None,
            "shown_default": shown_default}  # fmt: skip
    result: T = dataclasses.field(default=default, metadata=meta)
    return result


@dataclass(frozen=True)
class Spec:
    """One field as an option: its flag, environment variable and value type."""

    name: str
    flag: str
    env: str
    kind: Any  # the value type argparse converts to (bool, int, float, str, Path)
    repeat: bool  # tuple field: the flag may be given several times
    default: Any
    shown_default: str | None
    help: str
    hidden: bool
    choices: tuple[str, ...] | None
    plan: bool
    secret: bool


def _value_type(tp: Any) -> tuple[Any, bool]:
    """(element type, repeatable) of ``X``, ``X | None`` or ``tuple[X, ...]``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is tuple:
        return typing.get_args(tp)[0], True
    return tp, False


def default_flag(name: str) -> str:
    """The flag a field gets unless it names its own: ``n_ctx`` -> ``--n-ctx``."""
    return "--" + name.replace("_", "-")


def env_name(env_prefix: str, name: str) -> str:
    """The environment variable of a field: ``SLMGUARD_`` + ``n_ctx`` -> ``SLMGUARD_N_CTX``."""
    return env_prefix + name.upper()


def specs(cls: type, env_prefix: str) -> list[Spec]:
    """The options of dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, repeat = _value_type(hints[f.name])
        meta = f.metadata
        out.append(
            Spec(
                name=f.name,
                flag=meta.get("flag") or default_flag(f.name),
                env=env_name(env_prefix, f.name),
                kind=kind,
                repeat=repeat,
                default=f.default,
                shown_default=meta.get("shown_default"),
                help=meta.get("help", ""),
                hidden=bool(meta.get("hidden")),
                choices=meta.get("choices"),
                plan=bool(meta.get("plan")),
                secret=bool(meta.get("secret")),
            )
        )
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, env_prefix: str) -> None:
    """One option per field. Defaults stay None so :func:`collect` can tell "not given"."""
    for s in specs(cls, env_prefix):
        default = s.shown_default if s.shown_default is not None else s.default
        shown = f"env {s.env}" if default in (None, ()) else f"env {s.env}; default {default}"
        choices = f" (one of {', '.join(s.choices)})" if s.choices else ""
        text = f"{s.help}{choices} [{shown}]".replace("%", "%%")
        helptext = argparse.SUPPRESS if s.hidden else text
        if s.kind is bool:
            parser.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction,
                                default=None, help=helptext)  # fmt: skip
            continue
        parser.add_argument(
            s.flag,
            dest=s.name,
            type=s.kind,
            action="append" if s.repeat else "store",
            choices=s.choices,
            default=None,
            metavar=s.name.upper(),
            help=helptext,
        )


def parse_env(spec: Spec, raw: str) -> Any:
    """The value of environment variable ``spec.env``; ConfigError names it when invalid."""
    try:
        if spec.repeat:
            return tuple(spec.kind(part) for part in raw.replace(",", " ").split())
        if spec.kind is bool:
            low = raw.strip().lower()
            if low in TRUE_WORDS:
                return True
            if low in FALSE_WORDS:
                return False
            raise ValueError(raw)
        value = spec.kind(raw.strip())
    except ValueError as err:
        raise ConfigError(
            f"{spec.env}={raw!r} is not a valid {getattr(spec.kind, '__name__', spec.kind)}"
        ) from err
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(f"{spec.env}={raw!r}: choose from {', '.join(spec.choices)}")
    return value


def collect(
    cls: type,
    args: argparse.Namespace | None,
    env: Mapping[str, str],
    env_prefix: str,
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``cls``: flag > environment > ``base``; absent ones stay default."""
    values = dict(base or {})
    for s in specs(cls, env_prefix):
        given = getattr(args, s.name, None) if args is not None else None
        if given is not None:
            values[s.name] = tuple(given) if s.repeat else given
        elif env.get(s.env):
            values[s.name] = parse_env(s, env[s.env])
    return values


def redacted(obj: Any) -> dict[str, Any]:
    """The dataclass's fields as a dict, secret values replaced by ``***``."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = "***" if f.metadata.get("secret") and value else value
    return out
