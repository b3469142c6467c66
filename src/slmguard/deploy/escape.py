"""Untrusted text into rendered files: one escaping or validation rule per output format.

A plan, and the model file it was made from, are hostile input (a GGUF's
``general.name`` may hold ``"tiny\\n[Service]\\nExecStartPre=+/bin/touch /x"``). Every
string or number from them that reaches a rendered file goes through one function here,
or is left out; a value that cannot be written safely is refused with
:class:`~slmguard.errors.RefusedError` (78) naming the plan field, nothing written.
The functions, by format: systemd values (:func:`unit_value`: no control character, no
trailing backslash, ``%`` as ``%%``), command lines (:func:`exec_word`,
:func:`exec_path`, :func:`exec_line`, :class:`Verbatim` for our own specifiers),
``Environment=`` (:func:`environment`), unit names (:func:`is_unit_name`), names shown
as text (:func:`label`), numbers (:func:`bounded_int`, :func:`unit_bytes`,
:func:`cpu_ids`), sysctl.d lines (:func:`sysctl_line`), the boot files' ``cma=``
(:func:`memparse_value`), addresses (:func:`listen_address`, :func:`network`), file
names (:func:`file_name`) and shell text to paste (:func:`shell_word`).
``docs/deploy.md`` (Untrusted text) tables the rule per format, with systemd's man pages.

It must not rely on the plan loader having checked anything (it is tested with hostile
:class:`~slmguard.plan.schema.Plan` objects built directly) nor write files.
"""

from __future__ import annotations

import ipaddress
import math
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slmguard.errors import RefusedError
from slmguard.host import kernelargs

#: Longest label (description or comment name) written into a unit, in characters.
LABEL_MAX_CHARS = 64
#: systemd's UNIT_NAME_MAX.
UNIT_NAME_MAX = 255
#: CPU numbers accepted in CPUAffinity=/AllowedCPUs= (systemd's cpu sets hold 8192).
CPU_ID_LIMIT = 8192
#: Longest file name derived from a model's name.
FILE_NAME_MAX = 128
#: Largest memparse value written to a boot file (1 PiB).
MEMPARSE_MAX_BYTES = 1 << 50

_LABEL_PUNCT = frozenset(" .,:+-_/()@")
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:@=+,-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]+")
_SYSCTL_KEY = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)+")
_FILE_CHARS = re.compile(r"[^A-Za-z0-9._+-]")
_DEVICE_NODE = re.compile(r"/dev(/[A-Za-z0-9._+:@-]+)+/?")
_GROUP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def refuse(where: str, value: object, why: str) -> RefusedError:
    """The refusal for ``value`` at plan field ``where`` (the value shown bounded)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        shown = f"an integer of {value.bit_length()} bits"  # repr() of 10**5000 raises
    else:
        shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return RefusedError(
        f"{where}: {shown} {why}; refusing to write it into a unit, sysctl or boot file",
        facts={"field": where, "value": shown},
    )


def _check_printable(text: str, where: str) -> None:
    for ch in text:
        if not ch.isprintable():
            raise refuse(where, text, f"holds the control character {ch!r}")


def label(text: str, max_chars: int = LABEL_MAX_CHARS) -> str:
    """A name made fit for a Description= or a comment: one printable line, bounded.

    Letters and digits (any script) and `` .,:+-_/()@`` are kept, whitespace
    runs become one space, everything else (``%``, ``\\``, quotes, ``=``,
    brackets, control characters) becomes ``_``; longer than ``max_chars``, it
    is cut and ends with ``...``. Never empty.
    """
    chars = [
        ch if (ch.isalnum() or ch in _LABEL_PUNCT) else " " if ch.isspace() else "_" for ch in text
    ]
    out = " ".join("".join(chars).split())
    if len(out) > max_chars:
        out = out[: max_chars - 3].rstrip() + "..."
    return out or "unnamed"


def unit_value(text: str, where: str) -> str:
    """A value for a unit setting that expands specifiers: checked, ``%`` as ``%%``."""
    _check_printable(text, where)
    if text.endswith("\\"):
        raise refuse(where, text, "ends with a backslash (it would continue the line)")
    if text != text.strip():
        raise refuse(where, text, "starts or ends with whitespace")
    return text.replace("%", "%%")


@dataclass(frozen=True)
class Verbatim:
    """An ExecStart= word of our own that carries a specifier on purpose (not escaped)."""

    text: str


def exec_word(word: str, where: str) -> str:
    """One ExecStart= argument, written so systemd passes exactly ``word``."""
    _check_printable(word, where)
    if _PLAIN_WORD.fullmatch(word):
        return word
    quoted = word.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + quoted.replace("%", "%%").replace("$", "$$") + '"'


def exec_path(path: str, where: str) -> str:
    """The program of an ExecStart= line: absolute, no quote, backslash or whitespace.

    systemd expands specifiers in it (``%`` as ``%%``) but not ``$``, and
    refuses to run a program whose name has quotes or backslashes in it
    ("Executable name contains special characters").
    """
    _check_printable(path, where)
    if not path.startswith("/") or any(c.isspace() or c in "\"'\\" for c in path):
        raise refuse(where, path, "is not an absolute path without spaces, quotes or backslashes")
    return path.replace("%", "%%")


def exec_line(words: Sequence[str | Verbatim], where: str) -> str:
    """An ExecStart= value: an absolute program and its arguments, each escaped."""
    exe, *args = words
    if isinstance(exe, Verbatim):
        raise refuse(where, exe.text, "is not a program path")
    out = [exec_path(exe, where)]
    out += [w.text if isinstance(w, Verbatim) else exec_word(w, where) for w in args]
    return " ".join(out)


def environment(assignments: Iterable[tuple[str, str]], where: str) -> str:
    """An Environment= value: ``NAME=value`` assignments, each quoted when it must be."""
    out = []
    for name, value in assignments:
        if not _ENV_NAME.fullmatch(name):
            raise refuse(where, name, "is not an environment variable name")
        _check_printable(value, where)
        text = f"{name}={value}"
        if not _PLAIN_WORD.fullmatch(text):
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        out.append(text.replace("%", "%%"))
    return " ".join(out)


def is_unit_name(name: str, suffix: str) -> bool:
    """A systemd unit name of this type (``.service``, ``.slice``)."""
    return (
        len(name) <= UNIT_NAME_MAX
        and name.endswith(suffix)
        and len(name) > len(suffix)
        and _UNIT_NAME.fullmatch(name) is not None
    )


def bounded_int(value: object, where: str, lo: int, hi: int) -> int:
    """``value`` when it is an integer (not a bool) in ``lo..hi``; refused otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(where, value, "is not an integer")
    if not lo <= value <= hi:
        raise refuse(where, value, f"is outside {lo}..{hi}")
    return value


def unit_bytes(value: object, where: str) -> int:
    """A byte count for MemoryMax= and friends: a positive integer systemd can hold."""
    return bounded_int(value, where, 1, (1 << 63) - 1)


def cpu_ids(cpus: Iterable[object], where: str) -> tuple[int, ...]:
    """CPU numbers for CPUAffinity=/AllowedCPUs=: integers in ``0..CPU_ID_LIMIT-1``."""
    return tuple(bounded_int(c, f"{where}[{i}]", 0, CPU_ID_LIMIT - 1) for i, c in enumerate(cpus))


def device_node(node: str, where: str) -> str:
    """A device path for DeviceAllow=: under /dev, plain characters, no ``..``."""
    if (
        not isinstance(node, str)
        or not _DEVICE_NODE.fullmatch(node)
        or any(part in (".", "..") for part in node.split("/"))
    ):
        raise refuse(where, node, "is not a path under /dev")
    return unit_value(node, where)


def group_name(name: str, where: str) -> str:
    """A group name for SupplementaryGroups=."""
    if not isinstance(name, str) or not _GROUP_NAME.fullmatch(name):
        raise refuse(where, name, "is not a group name")
    return name


def network(text: object, where: str) -> str:
    """A network for IPAddressAllow=: an IPv4/IPv6 address or CIDR, written canonically."""
    try:
        net = ipaddress.ip_network(str(text), strict=False) if isinstance(text, str) else None
    except ValueError:
        net = None
    if net is None:
        raise refuse(where, text, "is not an IP network (ADDRESS or ADDRESS/PREFIX)")
    return str(net)


def listen_address(text: object, where: str) -> str:
    """An address the server binds (``serve --host``): an IP address, written canonically."""
    try:
        addr = ipaddress.ip_address(text) if isinstance(text, str) else None
    except ValueError:
        addr = None
    if addr is None:
        raise refuse(where, text, "is not an IP address to listen on")
    return str(addr)


def json_numbers(data: object, where: str, limit: int = 1 << 63) -> None:
    """Refuse a number in a plan (as a dict) that JSON cannot carry back.

    An integer of magnitude ``limit`` or more (``json.dumps`` of one over 4300
    digits raises ValueError; nothing a plan means is near 2**63), or a float
    that is not finite (``json.dumps`` writes ``NaN``, which is not JSON).
    """
    stack: list[tuple[str, object]] = [(where, data)]
    while stack:
        at, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{at}.{k}", v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{at}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= limit:
            raise refuse(at, value, f"is beyond +-2**{limit.bit_length() - 1}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise refuse(at, value, "is not a finite number")


def sysctl_line(key: str, value: object, lo: int, hi: int, where: str) -> str:
    """One ``key = value`` line of a sysctl.d file: an integer inside the kernel's range."""
    if not _SYSCTL_KEY.fullmatch(key):
        raise refuse(where, key, "is not a sysctl key")
    return f"{key} = {bounded_int(value, where, lo, hi)}"


def memparse_value(n_bytes: object, where: str) -> str:
    """A size for the kernel command line (``cma=512M``): digits and one suffix letter."""
    size = bounded_int(n_bytes, where, 1, MEMPARSE_MAX_BYTES)
    text = kernelargs.format_memparse(size)
    if not re.fullmatch(r"[0-9]+[KMGTPE]?", text):  # pragma: no cover - format_memparse's own
        raise refuse(where, text, "is not a memparse size")
    return text


def file_name(name: str, default: str = "model.gguf") -> str:
    """A file name made from a model's name: ``[A-Za-z0-9._+-]``, no leading dot, bounded."""
    out = _FILE_CHARS.sub("_", name).lstrip(".")
    if len(out) > FILE_NAME_MAX:
        stem, dot, ext = out.rpartition(".")
        keep = FILE_NAME_MAX - len(ext) - 1
        out = stem[:keep] + dot + ext if dot and 0 < len(ext) < 16 else out[:FILE_NAME_MAX]
    return out or default


def shell_word(text: str) -> str:
    """A word of a command line printed for the user to paste into a POSIX shell."""
    return shlex.quote(text)
