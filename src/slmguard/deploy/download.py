"""One file from a mirror: resumed, retried within a bound, hashed once as it arrives.

Owns fetching a file of known size and sha256 over http(s) into ``NAME.part``
beside its destination, and renaming it there only when every byte is in and
the sha256 matches. A ``.part`` left by a dropped connection or an earlier run
is resumed (``Range: bytes=N-``): its bytes are hashed once from the disk, the
rest as they arrive, so the file is read exactly once in all. A try that fails
(a refused or dropped connection, a timeout, a 5xx, 408 or 429) is retried
after a growing pause, at most ``retries`` times; a 4xx is final at once. What
the mirror sends is hostile: never more than the expected size is written, a
206 must be the range asked for, a 200 to a range restarts from the first byte,
and a whole file with another sha256 is deleted (once more from scratch when
part of it was resumed, then refused: 65).

Writes only the ``.part`` and the destination named by the caller
(:mod:`slmguard.deploy.stage` confines them); reads nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from slmguard import atomicio
from slmguard.errors import DownloadError, HostWriteError, ModelMismatchError

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(done_bytes, total_bytes)`` while the file comes in."""

BLOCK_BYTES = 1 << 20
#: HTTP statuses worth another try (the rest of 4xx are final).
RETRY_STATUSES = (408, 429)
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19})")
USER_AGENT = "slmguard-stage"


@dataclass(frozen=True)
class Retry:
    """How hard a download tries: ``retries`` more tries after the first, pausing
    ``first_pause_s`` doubled each time up to ``max_pause_s``; ``timeout_s`` per
    connect and per read.

    Example::

        Retry(retries=5, timeout_s=60)   # six tries, pauses 1, 2, 4, 8, 16 s
    """

    retries: int = 5
    timeout_s: float = 60.0
    first_pause_s: float = 1.0
    max_pause_s: float = 30.0

    def pause_s(self, attempt: int) -> float:
        return float(min(self.first_pause_s * (2 ** (attempt - 1)), self.max_pause_s))


DEFAULT_RETRY = Retry()


@dataclass(frozen=True)
class Fetched:
    """What a download moved: ``downloaded_bytes`` over the network, ``resumed_bytes``
    kept from an earlier try or run, the tries it took."""

    downloaded_bytes: int
    resumed_bytes: int
    attempts: int


class _TryFailed(Exception):
    """One try went wrong in a way another try may fix."""


class _Final(Exception):
    """The mirror said no for good (a 4xx)."""


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...
    def hexdigest(self) -> str: ...


@dataclass
class _Part:
    """The partial file as it stands: its bytes so far, their sha256, what came this run."""

    out: BinaryIO
    h: _Hasher
    have: int
    got: int = 0

    def add(self, block: bytes) -> None:
        try:
            self.out.write(block)
        except OSError as err:
            raise HostWriteError(self.out.name, err.strerror or str(err)) from err
        self.h.update(block)
        self.have += len(block)
        self.got += len(block)

    def restart(self) -> None:
        self.out.truncate(0)
        self.h, self.have = hashlib.sha256(), 0


def _opener() -> urllib.request.OpenerDirector:
    """http and https only (with the environment's proxy): no file:// or ftp://, even by a
    redirect."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def part_path(dest: Path) -> Path:
    """Where the file grows until it is whole: ``NAME.part`` beside ``dest``."""
    return dest.with_name(dest.name + ".part")


def _open_part(part: Path) -> BinaryIO:
    """The partial file for appending (never through a link), 0600 until it is whole."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(part, flags, 0o600), "ab")


def _hash_prefix(part: Path, size: int) -> tuple[_Hasher, int]:
    """The sha256 of what an earlier run left (read once), and its length; a file longer than
    the whole (not ours) is emptied."""
    h = hashlib.sha256()
    try:
        fd = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return h, 0
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > size:
            os.truncate(part, 0)
            return h, 0
        done = 0
        while block := f.read(BLOCK_BYTES):
            h.update(block)
            done += len(block)
    return h, done


def _check_range(resp: http.client.HTTPResponse, have: int, size: int) -> None:
    match = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
    if match is None or int(match[1]) != have or int(match[3]) != size:
        raise _TryFailed(f"a 206 for another range ({resp.headers.get('Content-Range')!r})")


def _one_try(url: str, part: _Part, size: int, retry: Retry, progress: ProgressFn | None) -> None:
    """One connection, adding to ``part`` what it brings. Raises _TryFailed or _Final."""
    headers = {"User-Agent": USER_AGENT}
    if part.have:
        headers["Range"] = f"bytes={part.have}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        with _opener().open(request, timeout=retry.timeout_s) as resp:
            if resp.status == 206:
                _check_range(resp, part.have, size)
            elif part.have:  # a 200 to a range: the whole file again, from its first byte
                part.restart()
            while part.have < size and (block := resp.read(min(BLOCK_BYTES, size - part.have + 1))):
                if part.have + len(block) > size:
                    raise _TryFailed(f"the mirror sends more than the {size} bytes expected")
                part.add(block)
                if progress is not None:
                    progress(part.have, size)
    except urllib.error.HTTPError as err:
        err.close()  # it holds the response and its socket
        if 400 <= err.code < 500 and err.code not in RETRY_STATUSES:
            raise _Final(f"HTTP {err.code} {err.reason}") from None
        raise _TryFailed(f"HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        reason = getattr(err, "reason", None) or err
        raise _TryFailed(f"{type(err).__name__}: {reason}") from None
    finally:
        part.out.flush()
    if part.have < size:
        raise _TryFailed(f"the connection closed at {part.have} of {size} bytes")


SleepFn = Callable[[float], None]


def _download(
    url: str, path: Path, size: int, retry: Retry, progress: ProgressFn | None, sleep: SleepFn
) -> tuple[str, Fetched]:
    """``path`` whole (``size`` bytes) and its sha256, within ``retry``'s bound."""
    h, have = _hash_prefix(path, size)
    attempts = 0
    with _open_part(path) as out:
        part = _Part(out, h, have)
        while part.have < size:
            attempts += 1
            try:
                _one_try(url, part, size, retry, progress)
            except _Final as err:
                raise DownloadError(
                    url, str(err), attempts=attempts, done_bytes=part.have
                ) from None
            except _TryFailed as err:
                if attempts > retry.retries:
                    raise DownloadError(
                        url, str(err), attempts=attempts, done_bytes=part.have
                    ) from None
                sleep(retry.pause_s(attempts))
        os.fsync(out.fileno())
    return part.h.hexdigest(), Fetched(part.got, have, attempts)


def fetch(
    url: str,
    dest: Path,
    size: int,
    sha256: str,
    *,
    retry: Retry = DEFAULT_RETRY,
    progress: ProgressFn | None = None,
    sleep: SleepFn = time.sleep,
) -> Fetched:
    """``url`` as ``dest`` (mode 0644), ``size`` bytes with ``sha256`` (see the module docstring).

    Raises DownloadError (69) when the tries run out or the mirror refuses,
    ModelMismatchError (65) when the whole file is not the one asked for,
    HostWriteError (73) when the file cannot be written.
    """
    part = part_path(dest)
    total = Fetched(0, 0, 0)
    for fresh in (False, True):
        try:
            digest, got = _download(url, part, size, retry, progress, sleep)
        except OSError as err:
            raise HostWriteError(part, err.strerror or str(err)) from err
        total = Fetched(
            total.downloaded_bytes + got.downloaded_bytes,
            total.resumed_bytes + got.resumed_bytes,
            total.attempts + got.attempts,
        )
        if digest == sha256:
            break
        part.unlink()
        if fresh or got.resumed_bytes == 0:
            raise ModelMismatchError(
                url,
                "sha256",
                sha256,
                digest,
                hint="the mirror serves another file under this name: fix the mirror",
            )
        # Part of it came from an earlier run and the whole is wrong: once more, from scratch.
    try:
        os.chmod(part, 0o644)
        os.replace(part, dest)
        atomicio.fsync_dir(dest.parent)
    except OSError as err:
        with contextlib.suppress(OSError):
            part.unlink()
        raise HostWriteError(dest, err.strerror or str(err)) from err
    return total
