"""What a pod prepares before its server starts: its own admin token, and the model from a mirror.

Owns the two init steps of the rendered DaemonSet (``python -m
slmguard.deploy.fleet.podinit ...`` in the image, as the pod's user):

- ``admin-token PATH``: random bytes for this pod alone (``secrets.token_urlsafe``,
  mode 0600), into the pod's memory-backed emptyDir, so no two boards share a
  token and none is in a Secret: ``kubectl exec`` reads it when an operator
  needs the admin routes. A token already there (the pod's containers
  restarted) is kept.
- ``model --url URL --sha256 HEX --size N --cache DIR --name NAME``: the model
  in the node's cache, ``DIR/<sha256>/NAME`` (a hostPath the node keeps across
  pods and rollouts, :data:`slmguard.deploy.fleet.k8s.MODEL_CACHE`), the server
  then mounting that directory read-only. Kept, nothing read, while its stamp
  (``.NAME.stamp``: size, inode, mtime, sha256) matches; hashed once when it
  has none (a model the node's Ansible role put there); else downloaded
  (:mod:`slmguard.deploy.download`: resumed from a partial file, retried with
  growing pauses, hashed as it arrives) and stamped. So a new pod of the same
  model (a plan-only rollout, a restart) downloads nothing.

Stdlib and slmguard's own stdlib-only modules, like :mod:`slmguard.deploy.probe`:
it runs before the server, in the server's image. Exit 0 done, 1 failed (one
line on stderr with why).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from slmguard import atomicio
from slmguard.deploy import escape
from slmguard.deploy.download import Retry, fetch
from slmguard.errors import SlmguardError

#: Random bytes in the pod's admin token (the same as apply's).
TOKEN_ENTROPY_BYTES = 32
#: Tries after the first (pauses 1 s doubling to 30 s); then the kubelet's back-off.
DOWNLOAD_RETRIES = 5
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


def _stamp_of(path: Path, sha256: str) -> dict[str, object]:
    st = path.stat()
    return {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.stamp")


def _stamped(path: Path, sha256: str) -> bool:
    try:
        data = json.loads(_stamp_path(path).read_text())
        return bool(data == _stamp_of(path, sha256))
    except (OSError, ValueError):
        return False


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            h.update(block)
    return h.hexdigest()


def _remember(path: Path, sha256: str) -> None:
    data = json.dumps(_stamp_of(path, sha256)).encode()
    atomicio.write_atomic(_stamp_path(path), data, 0o644)


def model(
    url: str, sha256: str, size: int, cache: Path, name: str, retries: int = DOWNLOAD_RETRIES
) -> tuple[str, int]:
    """The model in the node's cache (see the module docstring): (how, bytes downloaded)."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256) or not 0 < size <= (1 << 40):
        raise InitError("--sha256 must be 64 hex digits and --size 1 B..1 TiB")
    if escape.file_name(name) != name:
        raise InitError(f"--name {name[:80]!r}: not a plain file name")
    directory = cache / sha256
    directory.mkdir(mode=0o755, exist_ok=True)
    dest = directory / name
    if dest.is_file() and not dest.is_symlink():
        if _stamped(dest, sha256):
            return "cached", 0
        if dest.stat().st_size == size and _digest(dest) == sha256:
            _remember(dest, sha256)
            return "verified", 0
        dest.unlink()
    retry = Retry(retries=retries, timeout_s=TIMEOUT_S)
    try:
        got = fetch(url, dest, size, sha256, retry=retry)
    except SlmguardError as err:
        raise InitError(err.message) from err
    _remember(dest, sha256)
    return "downloaded", got.downloaded_bytes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slmguard.deploy.fleet.podinit")
    sub = p.add_subparsers(dest="step", required=True)
    tok = sub.add_parser("admin-token", help="this pod's own admin token")
    tok.add_argument("path", type=Path)
    mod = sub.add_parser("model", help="the model from the fleet's mirror, checked")
    mod.add_argument("--url", required=True)
    mod.add_argument("--sha256", required=True)
    mod.add_argument("--size", type=int, required=True)
    mod.add_argument("--cache", type=Path, required=True, help="the node's model cache")
    mod.add_argument("--name", required=True, help="the model's file name")
    mod.add_argument("--retries", type=int, default=DOWNLOAD_RETRIES, help="tries after the first")
    args = p.parse_args(argv)
    try:
        if args.step == "admin-token":
            made = admin_token(args.path)
            what = "made" if made else "kept"
        else:
            how, got = model(args.url, args.sha256, args.size, args.cache, args.name, args.retries)
            what = f"{how}, {got} bytes downloaded"
    except (InitError, OSError) as err:
        sys.stderr.write(f"podinit {args.step}: {err}\n")
        return 1
    # The kubelet keeps an init container's output with the pod: the one place this prints.
    sys.stdout.write(f"podinit {args.step}: {what}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
