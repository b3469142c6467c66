"""What a pod prepares before its server starts: its own admin token, and the model from a mirror.

Owns the two init steps of the rendered DaemonSet (``python -m
slmguard.deploy.fleet.podinit ...`` in the image, as the pod's user):

- ``admin-token PATH``: random bytes for this pod alone (``secrets.token_urlsafe``,
  mode 0600), into the pod's memory-backed emptyDir, so no two boards share a
  token and none is in a Secret: ``kubectl exec`` reads it when an operator
  needs the admin routes. A token already there (the pod's containers
  restarted) is kept.
- ``model --url URL --sha256 HEX --size N --dest PATH``: the model from the
  fleet's mirror into the pod's disk emptyDir, hashed while it downloads and
  put in place (renamed) only when its size and sha256 are the plan's; a file
  already there with the plan's size is checked by hash before it is kept.
  This keeps the namespace at Pod Security "restricted": no hostPath.
  Downloads are retried three times, 10 s apart; the init container fails
  (and the kubelet retries it with back-off) otherwise.

Stdlib only, like :mod:`slmguard.deploy.probe`: it runs before the server,
in the server's image. Exit 0 done, 1 failed (one line on stderr with why).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

#: Random bytes in the pod's admin token (the same as apply's).
TOKEN_ENTROPY_BYTES = 32
DOWNLOAD_ATTEMPTS = 3
RETRY_DELAY_S = 10.0
CHUNK_BYTES = 1 << 20
TIMEOUT_S = 60.0


class InitError(Exception):
    """An init step that could not be done; the message says why."""


def admin_token(path: Path) -> bool:
    """Make ``path`` (0600) with a fresh token unless it is there; True when made."""
    token = (secrets.token_urlsafe(TOKEN_ENTROPY_BYTES) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    except OSError as err:
        raise InitError(f"{path}: {err.strerror or err}") from err
    with os.fdopen(fd, "wb") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())
    return True


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            h.update(block)
    return h.hexdigest()


def _fetch(url: str, tmp: Path, size: int) -> str:
    """Download ``url`` into ``tmp`` (at most ``size`` bytes); its sha256."""
    h = hashlib.sha256()
    done = 0
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp, tmp.open("wb") as out:
        while block := resp.read(CHUNK_BYTES):
            done += len(block)
            if done > size:
                raise InitError(f"{url}: more than the plan's {size} bytes")
            h.update(block)
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    if done != size:
        raise InitError(f"{url}: {done} bytes, the plan's model has {size}")
    return h.hexdigest()


def model(url: str, sha256: str, size: int, dest: Path) -> bool:
    """Put the model at ``dest`` (see the module docstring); True when it was downloaded."""
    if dest.is_file() and dest.stat().st_size == size and _digest(dest) == sha256:
        return False
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        return _download(url, sha256, size, tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # never a partial file left behind


def _download(url: str, sha256: str, size: int, tmp: Path, dest: Path) -> bool:
    last = ""
    for attempt in range(DOWNLOAD_ATTEMPTS):
        if attempt:
            time.sleep(RETRY_DELAY_S)
        try:
            got = _fetch(url, tmp, size)
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            last = f"{url}: {err}"
            continue
        if got != sha256:
            raise InitError(f"{url}: sha256 {got}, the plan's model is {sha256}")
        os.replace(tmp, dest)
        return True
    raise InitError(f"no model after {DOWNLOAD_ATTEMPTS} attempts: {last}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slmguard.deploy.fleet.podinit")
    sub = p.add_subparsers(dest="step", required=True)
    tok = sub.add_parser("admin-token", help="this pod's own admin token")
    tok.add_argument("path", type=Path)
    mod = sub.add_parser("model", help="the model from the fleet's mirror, checked")
    mod.add_argument("--url", required=True)
    mod.add_argument("--sha256", required=True)
    mod.add_argument("--size", type=int, required=True)
    mod.add_argument("--dest", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.step == "admin-token":
            made = admin_token(args.path)
            what = "made" if made else "kept"
        else:
            made = model(args.url, args.sha256, args.size, args.dest)
            what = "downloaded" if made else "already there"
    except (InitError, OSError) as err:
        sys.stderr.write(f"podinit {args.step}: {err}\n")
        return 1
    # The kubelet keeps an init container's output with the pod: the one place this prints.
    sys.stdout.write(f"podinit {args.step}: {what}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
