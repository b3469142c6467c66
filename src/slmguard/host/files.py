"""One small-file read for every reader in ``host/``: the bytes, or why not, told apart.

Owns :func:`read` and :class:`FileRead` (a ``/proc``, ``/sys`` or debugfs file, a unit
file, a boot file), :data:`ROOT`, and the wording of each outcome. A read gives at most
``max_bytes`` (the rest cut, ``truncated`` set) or one of three failures, which a caller
must not confuse: **absent** (ENOENT, or ENOTDIR: the kernel lacks the feature),
**needs root** (EACCES, EPERM: debugfs is mode 0700) and **another errno** (EINVAL or
ENODATA from a switched-off sensor, EIO from a driver, EOPNOTSUPP under ``psi=0``). Each
caller takes its convention from the result, as psutil's ``cat(fallback=)`` does:
``.text`` (None on any failure), ``.error``, ``.optional()`` (None when absent, else
raise), ``.require()`` (:class:`~slmguard.errors.HostReadError`). It opens without
blocking (a FIFO planted in a fixture root does not hang a read); it never writes,
lists directories or opens devices (``/dev/kmsg`` is :mod:`slmguard.host.kmsg`'s).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.errors import HostReadError

#: The live host's root; every reader takes another for a fixture tree.
ROOT = Path("/")

NEEDS_ROOT = "needs root"

#: The default bound. The largest kernel files read whole: ``/proc/<pid>/maps`` of a
#: process at ``vm.max_map_count`` (65530 lines of about 100 bytes), ``/proc/cpuinfo`` of
#: a many-core server, ``mountinfo`` of a busy container host.
MAX_BYTES = 16 << 20
#: A sysfs attribute is a value, not a table: anything longer is a broken or hostile driver.
ATTR_BYTES = 64 << 10

_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR})
_DENIED = frozenset({errno.EACCES, errno.EPERM})
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_CHUNK = 64 << 10


def os_error_text(err: OSError) -> str:
    """:data:`NEEDS_ROOT` for EACCES/EPERM, else the errno's text."""
    if isinstance(err, PermissionError) or err.errno in _DENIED:
        return NEEDS_ROOT
    return err.strerror or type(err).__name__


def read_error(path: Path, err: OSError, missing: str = "missing") -> HostReadError:
    """The HostReadError for ``err`` at ``path`` (a read or a listing); the caller raises it
    ``from err``. ``missing`` words an absent file."""
    if err.errno in _ABSENT:
        return HostReadError(path, missing)
    if isinstance(err, PermissionError) or err.errno in _DENIED:
        return HostReadError(path, "permission denied")
    return HostReadError(path, err.strerror or str(err))


@dataclass(frozen=True)
class FileRead:
    """What one read gave: ``data``, or the ``cause`` it failed with (see the module docstring)."""

    name: Path | str  # as the caller gave it (a str on the governor's per-fd path: no Path built)
    data: bytes | None = None
    cause: OSError | None = field(default=None, compare=False)
    truncated: bool = False  # the file held more than the read's bound

    @property
    def path(self) -> Path:
        return Path(self.name)

    @property
    def absent(self) -> bool:
        """No such file (ENOENT), or a path through a file (ENOTDIR)."""
        return self.cause is not None and self.cause.errno in _ABSENT

    @property
    def needs_root(self) -> bool:
        return self.cause is not None and self.cause.errno in _DENIED

    @property
    def error(self) -> str | None:
        """Why a file that is there gave nothing (:data:`NEEDS_ROOT` or the errno's text);
        None when it was read or is absent."""
        if self.cause is None or self.absent:
            return None
        return os_error_text(self.cause)

    @property
    def text(self) -> str | None:
        """The bytes as UTF-8 (undecodable bytes replaced); None when not read."""
        return None if self.data is None else self.data.decode("utf-8", errors="replace")

    def integer(self) -> int | None:
        """The text as an integer; None when not read or not a number."""
        text = self.text
        if text is None:
            return None
        try:
            return int(text.strip())
        except ValueError:
            return None

    def require_bytes(self, missing: str = "missing") -> bytes:
        """The bytes; :class:`HostReadError` naming the path and why when not read."""
        if self.data is not None:
            return self.data
        assert self.cause is not None  # a FileRead holds one or the other
        raise read_error(self.path, self.cause, missing) from self.cause

    def require(self, missing: str = "missing") -> str:
        """The text; :class:`HostReadError` naming the path and why when not read."""
        return self.require_bytes(missing).decode("utf-8", errors="replace")

    def optional(self) -> str | None:
        """The text; None when absent; :class:`HostReadError` for any other failure."""
        return None if self.absent else self.require()


def read(path: Path | str, max_bytes: int = MAX_BYTES) -> FileRead:
    """Read at most ``max_bytes`` of ``path``. Never raises for an OS error: the result says."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as err:
        return FileRead(path, cause=err)
    chunks: list[bytes] = []
    left = max_bytes + 1  # one byte more tells a file of exactly max_bytes from a longer one
    try:
        while left > 0:
            chunk = os.read(fd, min(left, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as err:
        return FileRead(path, cause=err)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        return FileRead(path, data[:max_bytes], truncated=True)
    return FileRead(path, data)


def read_attr(path: Path | str) -> FileRead:
    """:func:`read` bounded to :data:`ATTR_BYTES`: one sysfs attribute (a value, not a table)."""
    return read(path, ATTR_BYTES)


def probe(path: Path) -> str:
    """Whether ``path`` exists: ``"yes"``, ``"no"`` or :data:`NEEDS_ROOT` (a directory on
    the way is not searchable, as ``/sys/kernel/debug`` is for other users)."""
    try:
        path.stat()
    except PermissionError:
        return NEEDS_ROOT
    except OSError:
        return "no"
    return "yes"
