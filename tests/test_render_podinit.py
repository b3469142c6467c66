"""The pod's init steps: its own admin token, the model from the mirror checked by sha256.

Run as the rendered DaemonSet runs them (``python -m slmguard.deploy.fleet.podinit``)
against a real HTTP mirror on a loopback port (``fleetsim.Mirror``).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetsim import Mirror
from rendertrees import make_model_file
from serveproc import free_port
from slmguard.deploy.fleet import podinit


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[Mirror, Path, int, str]]:
    model, size, digest = make_model_file(tmp_path / "mirror/m.gguf", 3 << 20)
    m = Mirror({"m.gguf": model})
    try:
        yield m, model, size, digest
    finally:
        m.close()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slmguard.deploy.fleet.podinit", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_each_pod_makes_its_own_token_once(tmp_path: Path) -> None:
    path = tmp_path / "run/admin-token"
    path.parent.mkdir()
    done = _run("admin-token", str(path))
    assert done.returncode == 0 and "made" in done.stdout
    token = path.read_bytes()
    assert path.stat().st_mode & 0o777 == 0o600 and len(token.strip()) >= 40
    again = _run("admin-token", str(path))
    assert again.returncode == 0 and "kept" in again.stdout and path.read_bytes() == token
    other = tmp_path / "run/other"
    assert podinit.admin_token(other) and other.read_bytes() != token


def _model(
    m: Mirror, cache: Path, sha: str, size: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    return _run(
        "model", "--url", m.url("pod", "m.gguf"), "--sha256", sha, "--size", str(size),
        "--cache", str(cache), "--name", "m.gguf", *extra,
    )  # fmt: skip


def test_the_model_is_cached_on_the_node_by_sha256(
    tmp_path: Path, mirror: tuple[Mirror, Path, int, str]
) -> None:
    m, model, size, digest = mirror
    cache = tmp_path / "node/by-sha256"
    cache.mkdir(parents=True)
    done = _model(m, cache, digest, size)
    assert done.returncode == 0 and "downloaded, 3145728 bytes" in done.stdout, done.stderr
    assert (cache / digest / "m.gguf").read_bytes() == model.read_bytes()
    assert m.sent() == {"pod": size}
    # A new pod of the same model (a plan-only rollout, a restart): nothing downloaded.
    again = _model(m, cache, digest, size)
    assert again.returncode == 0 and "cached, 0 bytes" in again.stdout
    assert m.sent() == {"pod": size}
    # A model the node's Ansible role put there (no stamp): hashed once, not downloaded.
    (cache / digest / ".m.gguf.stamp").unlink()
    seeded = _model(m, cache, digest, size)
    assert "verified, 0 bytes" in seeded.stdout and m.sent() == {"pod": size}
    # Rot under the same size and stamp is for serve's sha256 check at start; other bytes
    # without a stamp are found here and downloaded again.
    (cache / digest / ".m.gguf.stamp").unlink()
    (cache / digest / "m.gguf").write_bytes(b"\0" * size)
    fixed = _model(m, cache, digest, size)
    assert "downloaded" in fixed.stdout and m.sent() == {"pod": 2 * size}


@pytest.mark.parametrize(
    ("sha", "size", "needle"),
    [
        ("0" * 64, None, "sha256"),
        (None, 1 << 20, "sha256"),  # the first MiB of a larger file is not the model
        (None, 4 << 20, "closed at"),
    ],
)
def test_a_model_that_is_not_the_plan_s_is_refused(
    tmp_path: Path,
    mirror: tuple[Mirror, Path, int, str],
    sha: str | None,
    size: int | None,
    needle: str,
) -> None:
    m, _, real_size, digest = mirror
    done = _model(m, tmp_path, sha or digest, size or real_size, "--retries", "0")
    assert done.returncode == 1 and needle in done.stderr, done.stderr
    assert not (tmp_path / (sha or digest) / "m.gguf").exists()


def test_an_unreachable_mirror_fails_after_its_tries(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/m.gguf"
    with pytest.raises(podinit.InitError, match="after 2 attempts"):
        podinit.model(url, hashlib.sha256(b"").hexdigest(), 10, tmp_path, "m.gguf", retries=1)
    assert not (tmp_path / hashlib.sha256(b"").hexdigest() / "m.gguf").exists()
