"""Settings declared once: a frozen dataclass's fields become flags and environment variables.

Owns the one mechanism behind the settings of ``slmguard serve`` (``SLMGUARD_*``), ``watch``
(``SLMGUARD_WATCH_*``) and the engine settings ``plan`` and ``serve`` share (the plan's
:class:`~slmguard.plan.schema.EngineSettings`). A field is declared with :func:`option` (or
:func:`metadata` where it has other metadata too): default, help and, where they differ
from the field name, its flag, its old spellings (still accepted, reported by
:func:`renamed`) and the verbs that take it. A field made by :func:`group` holds the fields
of another declaration given on the command line, by name; :func:`nested` puts another
settings class's options among the fields'. :func:`add_flags` builds one argparse option
per field, :func:`collect` merges flag > environment > base. Pure: the environment is
passed in.

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
#: Where the parsers record the old spellings they were given (:func:`renamed`).
RENAMED = "_renamed_options"


def metadata(
    help: str,
    *,
    flag: str | None = None,
    old: Sequence[str] = (),
    old_values: bool = False,
    verbs: Sequence[str] | None = None,
    plan: bool = False,
    secret: bool = False,
    hidden: bool = False,
    choices: Sequence[str] | None = None,
    shown_default: str | None = None,
    metavar: str | None = None,
) -> dict[str, Any]:
    """What the flag of a field needs (see :func:`option`)."""
    return {"help": help, "flag": flag, "old": tuple(old), "old_values": old_values,
            "verbs": None if verbs is None else tuple(verbs), "plan": plan, "secret": secret,
            "hidden": hidden, "choices": tuple(choices) if choices else None,
            "shown_default": shown_default, "metavar": metavar}  # fmt: skip


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
    when the real default is computed elsewhere. :func:`metadata` takes also ``old``
    (former spellings of the flag), ``old_values`` (a switch that also takes the old
    ``--flag on|off`` form) and ``verbs`` (the verbs whose parsers take it).
    """
    meta = metadata(help, flag=flag, plan=plan, secret=secret, hidden=hidden, choices=choices,
                    shown_default=shown_default)  # fmt: skip
    result: T = dataclasses.field(default=default, metadata=meta)
    return result


def group(cls: type, verb: str | None = None) -> Any:
    """A field holding the fields of ``cls`` given on the command line, by name (a dict):
    their options are ``cls``'s own declarations of the fields ``verb`` takes (None: the
    verb of the settings that hold it)."""
    return dataclasses.field(default_factory=dict, metadata={"group": cls, "verb": verb})


def nested(cls: type, verb: str | None = None) -> Any:
    """A field holding a ``cls`` made of its options (those ``verb`` takes), which are
    flags of the enclosing settings' command line like their own."""
    return dataclasses.field(default_factory=cls, metadata={"nested": cls, "verb": verb})


@dataclass(frozen=True)
class Spec:
    """One field as an option: its flag, environment variable and value type.

    ``path`` is where the value goes: the field's name, or a :func:`group` or
    :func:`nested` field's name and then the field's (``("engine", "fields",
    "n_parallel")``); ``name`` is the last, also the argparse ``dest``.
    """

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
    path: tuple[str, ...] = ()
    old: tuple[str, ...] = ()
    old_values: bool = False
    metavar: str | None = None


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


def env_name(env_prefix: str | None, name: str) -> str:
    """The environment variable of a field: ``SLMGUARD_`` + ``n_ctx`` -> ``SLMGUARD_N_CTX``
    ("" without a prefix: the flag has no variable)."""
    return "" if env_prefix is None else env_prefix + name.upper()


def specs(cls: type, env_prefix: str | None, verb: str | None = None) -> list[Spec]:
    """The options of dataclass ``cls``, in field order: its own fields (those ``verb``
    takes, when a field names its verbs) and those of its :func:`group` and
    :func:`nested` fields."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        inner = meta.get("group") or meta.get("nested")
        if inner is not None:
            out += [
                dataclasses.replace(s, path=(f.name, *s.path))
                for s in specs(inner, env_prefix, meta["verb"] or verb)
            ]
            continue
        verbs = meta.get("verbs")
        if verbs is not None and verb not in verbs:
            continue
        kind, repeat = _value_type(hints[f.name])
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
                path=(f.name,),
                old=tuple(meta.get("old") or ()),
                old_values=bool(meta.get("old_values")),
                metavar=meta.get("metavar"),
            )
        )
    return out


def _record(namespace: argparse.Namespace, message: str) -> None:
    said = getattr(namespace, RENAMED, None) or []
    setattr(namespace, RENAMED, [*said, message])


class _Renamed(argparse.Action):
    """An old spelling of a flag: stores as the new one and records the rename."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: Any, option_string: str | None = None,
    ) -> None:  # fmt: skip
        _record(namespace, f"{option_string} is now {self.new} (the old spelling still works)")
        setattr(namespace, self.dest, values)


class Switch(argparse.Action):
    """``--name`` / ``--no-name``, and the old ``--name on|off`` (recorded as renamed)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        strings = [x for s in option_strings for x in (s, "--no-" + s[2:])]
        kwargs.update(nargs="?", metavar="on|off")
        super().__init__(strings, dest, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: Any, option_string: str | None = None,
    ) -> None:  # fmt: skip
        flag = option_string or self.option_strings[0]
        negative = flag.startswith("--no-")
        if values is None:
            setattr(namespace, self.dest, not negative)
            return
        if negative or values not in ("on", "off"):
            parser.error(f"argument {flag}: expected no value (or the old on|off), got {values!r}")
        new = self.option_strings[0] if values == "on" else self.option_strings[1]
        _record(namespace, f"{flag} {values} is now {new} (the old spelling still works)")
        setattr(namespace, self.dest, values == "on")

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The verbs' help: a :class:`Switch` shows as ``--name, --no-name`` (its old value
    form is not advertised)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Switch):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, Switch):
            return ""
        return super()._format_args(action, default_metavar)


def _help(s: Spec, env: bool) -> str:
    default = s.shown_default if s.shown_default is not None else s.default
    shown = [f"env {s.env}"] if env else []
    if default not in (None, (), dataclasses.MISSING):
        shown.append(f"default {default}")
    choices = f" (one of {', '.join(s.choices)})" if s.choices else ""
    tail = f" [{'; '.join(shown)}]" if shown else ""
    return f"{s.help}{choices}{tail}".replace("%", "%%")


def add_spec_flags(parser: argparse.ArgumentParser, found: Sequence[Spec], env: bool) -> None:
    """One option per spec (its old spellings hidden beside it); defaults stay None so
    :func:`collect` can tell "not given". ``env``: the help names the variables."""
    for s in found:
        helptext = argparse.SUPPRESS if s.hidden else _help(s, env)
        if s.kind is bool:
            action: Any = Switch if s.old_values else argparse.BooleanOptionalAction
            parser.add_argument(s.flag, dest=s.name, action=action, default=None, help=helptext)
            continue
        metavar = s.metavar or s.name.upper()
        common: dict[str, Any] = {"dest": s.name, "type": s.kind, "choices": s.choices,
                                  "default": None, "metavar": metavar}  # fmt: skip
        parser.add_argument(
            s.flag, action="append" if s.repeat else "store", help=helptext, **common
        )
        for old in s.old:
            parser.add_argument(old, action=_Renamed, new=s.flag, help=argparse.SUPPRESS, **common)


def add_flags(
    parser: argparse.ArgumentParser, cls: type, env_prefix: str | None, verb: str | None = None
) -> None:
    """One option per field of ``cls`` (see :func:`specs`), with its variable in the help
    (``env_prefix`` None: flags without variables)."""
    add_spec_flags(parser, specs(cls, env_prefix, verb), env=env_prefix is not None)


def renamed(args: argparse.Namespace | None) -> list[str]:
    """What to tell the user about the old spellings they gave (``--slots is now
    --n-parallel (the old spelling still works)``)."""
    return list(getattr(args, RENAMED, None) or [])


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


def given(
    found: Sequence[Spec], args: argparse.Namespace | None, env: Mapping[str, str] | None
) -> dict[tuple[str, ...], Any]:
    """The values given for ``found``, by path: flag, else environment variable."""
    out: dict[tuple[str, ...], Any] = {}
    for s in found:
        value = getattr(args, s.name, None) if args is not None else None
        if value is not None:
            out[s.path] = tuple(value) if s.repeat else value
        elif env is not None and s.env and env.get(s.env):
            out[s.path] = parse_env(s, env[s.env])
    return out


def _nest(cls: type, values: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    """Keyword arguments for ``cls`` from values by path: a :func:`group` field gets a dict
    of its own, a :func:`nested` field the class it holds."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        inner = {p[1:]: v for p, v in values.items() if p[0] == f.name and len(p) > 1}
        if "group" in f.metadata:
            out[f.name] = {p[-1]: v for p, v in inner.items()}
        elif "nested" in f.metadata:
            out[f.name] = f.metadata["nested"](**_nest(f.metadata["nested"], inner))
        elif (f.name,) in values:
            out[f.name] = values[(f.name,)]
    return out


def collect(
    cls: type,
    args: argparse.Namespace | None,
    env: Mapping[str, str] | None,
    env_prefix: str | None,
    base: Mapping[str, Any] | None = None,
    verb: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``cls``: flag > environment > ``base``; absent ones stay default
    (``env`` None: no environment variables)."""
    values: dict[tuple[str, ...], Any] = {(k,): v for k, v in (base or {}).items()}
    values.update(given(specs(cls, env_prefix, verb), args, env))
    return _nest(cls, values)


def redacted(obj: Any) -> dict[str, Any]:
    """The dataclass's fields as a dict, secret values replaced by ``***``."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = "***" if f.metadata.get("secret") and value else value
    return out
