"""Boot files that carry the kernel command line: parse them, edit one argument.

Owns four plain-text formats on the boot partition (:data:`KNOWN_BOOT_FILES`): Armbian's
``armbianEnv.txt``, Rockchip's ``uEnv.txt``, ``extlinux.conf`` (Jetson, U-Boot distro
boot) and the Pi's ``cmdline.txt``. Parsers are pure (text in, arguments out) and refuse
what they do not understand with :class:`~slmguard.errors.BootFileError` naming the line;
the editor changes one ``key=value`` argument, leaves every other byte as it was and
refuses an edit after which the booting entry has no ``root=``;
:func:`read_boot_args` is the thin reader (doctor's ``cma=``). It never writes files
(:mod:`slmguard.deploy.apply` does); splitting and editing the argument string itself
is :mod:`slmguard.host.kernelargs`'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import BootFileError
from slmguard.host import files
from slmguard.host.kernelargs import (
    arg_value,
    cma_bytes,
    has_root,
    set_arg,
    tokens,
)

# Armbian's (and Orange Pi's) U-Boot ``env import -t`` lines ``key=value``; boot.cmd builds
# the command line from ``root=${rootdev}`` plus ``extraargs``, where extra arguments go.
ARMBIAN = "armbian"
# Rockchip's: the same ``key=value`` form with the whole command line in ``bootargs=``.
UENV = "uenv"
# ``LABEL`` stanzas with one ``APPEND`` line each; ``DEFAULT`` names the one that boots
# (the first label when absent).
EXTLINUX = "extlinux"
# Raspberry Pi's (``/boot/cmdline.txt`` before Bookworm): the whole command line, one line.
CMDLINE = "cmdline"

#: Where each format lives, relative to the root, in the order they are probed.
KNOWN_BOOT_FILES: tuple[tuple[str, str], ...] = (
    ("boot/armbianEnv.txt", ARMBIAN),
    ("boot/orangepiEnv.txt", ARMBIAN),
    ("boot/uEnv.txt", UENV),
    ("boot/extlinux/extlinux.conf", EXTLINUX),
    ("boot/firmware/cmdline.txt", CMDLINE),
    ("boot/cmdline.txt", CMDLINE),
)

_BY_NAME = {
    "armbianEnv.txt": ARMBIAN,
    "orangepiEnv.txt": ARMBIAN,
    "uEnv.txt": UENV,
    "extlinux.conf": EXTLINUX,
    "cmdline.txt": CMDLINE,
}

# U-Boot environment variable names: letters, digits, '_', '.', '-'.
_ENV_LINE = re.compile(r"^(?P<key>[A-Za-z0-9_.\-]+)=(?P<value>.*)$")
_EXTLINUX_LINE = re.compile(r"^(?P<indent>\s*)(?P<kw>[A-Za-z_]+)(?:(?P<sep>\s+)(?P<rest>.*))?$")


@dataclass(frozen=True)
class BootArgs:
    """The kernel arguments a boot file gives the entry that boots."""

    path: Path
    kind: str  # ARMBIAN | UENV | EXTLINUX
    args: tuple[str, ...]

    def value(self, key: str) -> str | None:
        """The value of the last ``key=...`` argument (the kernel uses the last), or None."""
        return arg_value(self.args, key)

    @property
    def cma_bytes(self) -> int | None:
        """Size of the ``cma=`` pool in bytes (``cma=size[@start[-end]]``), None if unset."""
        return cma_bytes(self.args)


def kind_for_path(path: Path | str) -> str:
    """The format of a boot file, from its name; BootFileError for unknown names."""
    name = Path(path).name
    try:
        return _BY_NAME[name]
    except KeyError:
        raise BootFileError(
            path,
            "unknown boot file (slmguard edits armbianEnv.txt, orangepiEnv.txt, "
            "uEnv.txt, extlinux.conf and cmdline.txt)",
        ) from None


# -- U-Boot environment files (armbianEnv.txt, uEnv.txt) -----------------------


@dataclass(frozen=True)
class _EnvLine:
    lineno: int
    key: str
    value_start: int  # offset of the value inside the line
    value: str


def _check_text(text: str, path: Path | str) -> None:
    if "\x00" in text:
        raise BootFileError(path, "contains NUL bytes: not a text boot file")


def _content_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line without CR) of every line that is not blank or a ``#`` comment."""
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if line.strip() and not line.lstrip().startswith("#"):
            yield i, line


def _env_lines(text: str, path: Path | str) -> dict[str, _EnvLine]:
    _check_text(text, path)
    found: dict[str, _EnvLine] = {}
    for i, line in _content_lines(text):
        m = _ENV_LINE.match(line)
        if not m:
            raise BootFileError(path, f"not a key=value line: {line[:60]!r}", lineno=i)
        key = m["key"]
        if key in found:
            raise BootFileError(
                path,
                f"{key}= is set twice (lines {found[key].lineno} and {i}); "
                "refusing to guess which one U-Boot uses",
                lineno=i,
            )
        found[key] = _EnvLine(i, key, m.start("value"), m["value"])
    return found


def parse_armbian_env(text: str, path: Path | str = "armbianEnv.txt") -> tuple[str, ...]:
    """Kernel arguments from armbianEnv.txt: ``root=<rootdev>`` then ``extraargs``."""
    env = _env_lines(text, path)
    args: list[str] = []
    if "rootdev" in env and env["rootdev"].value.strip():
        args.append("root=" + env["rootdev"].value.strip())
    if "extraargs" in env:
        args.extend(tokens(env["extraargs"].value))
    return tuple(args)


def parse_uenv(text: str, path: Path | str = "uEnv.txt") -> tuple[str, ...]:
    """Kernel arguments from a Rockchip uEnv.txt (the ``bootargs=`` value)."""
    env = _env_lines(text, path)
    if "bootargs" not in env:
        raise BootFileError(path, "no bootargs= line: cannot find the kernel command line")
    return tokens(env["bootargs"].value)


def _edit_env(text: str, path: Path | str, var: str, key: str, value: str) -> str:
    env = _env_lines(text, path)
    lines = text.splitlines(keepends=True)
    if var in env:
        entry = env[var]
        raw = lines[entry.lineno - 1]
        body = raw.rstrip("\r\n")
        ending = raw[len(body) :]
        new_value = set_arg(body[entry.value_start :], key, value)
        lines[entry.lineno - 1] = body[: entry.value_start] + new_value + ending
        return "".join(lines)
    ending = "\r\n" if lines and lines[-1].endswith("\r\n") else "\n"
    prefix = "" if not text or text.endswith("\n") else ending
    return f"{text}{prefix}{var}={key}={value}{ending}"


# -- extlinux.conf ------------------------------------------------------------------


@dataclass(frozen=True)
class ExtlinuxLabel:
    name: str
    lineno: int
    append: str | None  # the APPEND text, None when the label has no APPEND line
    append_lineno: int | None


@dataclass(frozen=True)
class ExtlinuxConf:
    labels: tuple[ExtlinuxLabel, ...]
    default: str  # the label that boots

    def booting(self) -> ExtlinuxLabel:
        return next(label for label in self.labels if label.name == self.default)


def parse_extlinux(text: str, path: Path | str = "extlinux.conf") -> ExtlinuxConf:
    """The labels of an extlinux.conf and which one boots."""
    _check_text(text, path)
    labels: list[ExtlinuxLabel] = []
    default: str | None = None
    current: dict[str, object] | None = None

    def close() -> None:
        if current is not None:
            labels.append(ExtlinuxLabel(**current))  # type: ignore[arg-type]

    for i, line in _content_lines(text):
        m = _EXTLINUX_LINE.match(line)
        if not m:
            raise BootFileError(path, f"not a KEYWORD line: {line[:60]!r}", lineno=i)
        kw, rest = m["kw"].upper(), (m["rest"] or "").strip()
        if kw == "LABEL":
            if not rest:
                raise BootFileError(path, "LABEL without a name", lineno=i)
            close()
            current = {"name": rest, "lineno": i, "append": None, "append_lineno": None}
        elif kw == "DEFAULT":
            if current is not None:
                raise BootFileError(path, "DEFAULT inside a LABEL stanza", lineno=i)
            default = rest
        elif kw == "APPEND":
            if current is None:
                raise BootFileError(
                    path, "APPEND outside a LABEL (U-Boot ignores global APPEND)", lineno=i
                )
            if current["append"] is not None:
                raise BootFileError(
                    path,
                    f"label {current['name']!r} has two APPEND lines "
                    f"({current['append_lineno']} and {i})",
                    lineno=i,
                )
            current["append"] = rest
            current["append_lineno"] = i
    close()
    if not labels:
        raise BootFileError(path, "no LABEL stanza: nothing boots from this file")
    names = [label.name for label in labels]
    if default is None:
        default = names[0]
    elif default not in names:
        raise BootFileError(path, f"DEFAULT {default!r} names no LABEL (labels: {names})")
    return ExtlinuxConf(tuple(labels), default)


def parse_extlinux_args(text: str, path: Path | str = "extlinux.conf") -> tuple[str, ...]:
    """Kernel arguments of the label that boots (``${cbootargs}`` stays literal)."""
    label = parse_extlinux(text, path).booting()
    return tokens(label.append or "")


def _edit_extlinux(text: str, path: Path | str, key: str, value: str) -> str:
    label = parse_extlinux(text, path).booting()
    if label.append_lineno is None:
        raise BootFileError(
            path,
            f"label {label.name!r} has no APPEND line: adding {key}= would boot without root=",
            lineno=label.lineno,
        )
    lines = text.splitlines(keepends=True)
    raw = lines[label.append_lineno - 1]
    body = raw.rstrip("\r\n")
    ending = raw[len(body) :]
    m = _EXTLINUX_LINE.match(body)
    if m is None or m["rest"] is None:  # parse_extlinux accepted it; kept for mypy
        raise BootFileError(path, "unreadable APPEND line", lineno=label.append_lineno)
    start = m.start("rest")
    lines[label.append_lineno - 1] = body[:start] + set_arg(body[start:], key, value) + ending
    return "".join(lines)


# -- Raspberry Pi cmdline.txt ------------------------------------------------------------


def _cmdline_line(text: str, path: Path | str) -> int:
    """Index of the one non-blank line (the firmware passes only one line on)."""
    _check_text(text, path)
    used = [i for i, line in enumerate(text.splitlines()) if line.strip()]
    if len(used) > 1:
        raise BootFileError(
            path,
            f"{len(used)} non-empty lines: cmdline.txt must hold the command line on one line",
            lineno=used[1] + 1,
        )
    return used[0] if used else -1


def parse_cmdline_txt(text: str, path: Path | str = "cmdline.txt") -> tuple[str, ...]:
    """Kernel arguments from a Raspberry Pi cmdline.txt."""
    i = _cmdline_line(text, path)
    return tokens(text.splitlines()[i]) if i >= 0 else ()


def _edit_cmdline_txt(text: str, path: Path | str, key: str, value: str) -> str:
    i = _cmdline_line(text, path)
    if i < 0:
        return f"{key}={value}\n"
    lines = text.splitlines(keepends=True)
    body = lines[i].rstrip("\r\n")
    lines[i] = set_arg(body, key, value) + lines[i][len(body) :]
    return "".join(lines)


# -- dispatch -----------------------------------------------------------------------------


def parse_boot_file(kind: str, text: str, path: Path | str) -> tuple[str, ...]:
    """Kernel arguments for any supported format."""
    if kind == ARMBIAN:
        return parse_armbian_env(text, path)
    if kind == UENV:
        return parse_uenv(text, path)
    if kind == EXTLINUX:
        return parse_extlinux_args(text, path)
    if kind == CMDLINE:
        return parse_cmdline_txt(text, path)
    raise BootFileError(path, f"unknown boot file kind {kind!r}")


def set_boot_arg(kind: str, text: str, key: str, value: str, path: Path | str) -> str:
    """``text`` with the kernel argument ``key=value`` set for the entry that boots.

    Refuses (BootFileError) when the file cannot be parsed, or when the result
    would have no ``root=`` argument (the board would not find its root file
    system). Setting a value that is already there returns ``text`` unchanged.
    """
    before = parse_boot_file(kind, text, path)
    if arg_value(before, key) == value and sum(a.startswith(key + "=") for a in before) == 1:
        return text
    if kind == ARMBIAN:
        new = _edit_env(text, path, "extraargs", key, value)
    elif kind == UENV:
        new = _edit_env(text, path, "bootargs", key, value)
    elif kind == EXTLINUX:
        new = _edit_extlinux(text, path, key, value)
    elif kind == CMDLINE:
        new = _edit_cmdline_txt(text, path, key, value)
    else:
        raise BootFileError(path, f"unknown boot file kind {kind!r}")
    after = parse_boot_file(kind, new, path)
    if not has_root(after):
        what = "rootdev=" if kind == ARMBIAN else "root="
        raise BootFileError(
            path,
            f"after setting {key}={value} the boot entry would have no root= argument "
            f"(the file has no {what}); refusing to write a board that cannot boot",
        )
    return new


def find_boot_file(root: Path) -> tuple[Path, str] | None:
    """The first known boot file present under ``root`` and its kind."""
    for rel, kind in KNOWN_BOOT_FILES:
        if (root / rel).is_file():
            return root / rel, kind
    return None


def read_boot_args(root: Path = Path("/"), boot_file: str | None = None) -> BootArgs | None:
    """Parse the board's boot file under ``root`` (``boot_file`` or the first known one).

    Returns None when there is no boot file. Raises HostReadError when it cannot
    be read and BootFileError when it cannot be parsed.
    """
    if boot_file is not None:
        path = root / boot_file.lstrip("/")
        kind = kind_for_path(path)
        if not path.exists():
            return None
    else:
        found = find_boot_file(root)
        if found is None:
            return None
        path, kind = found
    data = files.read(path).require_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BootFileError(path, "not UTF-8 text") from err
    return BootArgs(path, kind, parse_boot_file(kind, text, path))
