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


def test_the_model_comes_from_the_mirror_checked(
    tmp_path: Path, mirror: tuple[Mirror, Path, int, str]
) -> None:
    m, model, size, digest = mirror
    dest = tmp_path / "models/m.gguf"
    dest.parent.mkdir()
    args = ["model", "--url", m.url("pod", "m.gguf"), "--sha256", digest, "--size", str(size)]
    done = _run(*args, "--dest", str(dest))
    assert done.returncode == 0 and "downloaded" in done.stdout, done.stderr
    assert dest.read_bytes() == model.read_bytes()
    assert m.sent() == {"pod": size}
    again = _run(*args, "--dest", str(dest))
    assert again.returncode == 0 and "already there" in again.stdout
    assert m.sent() == {"pod": size}  # checked where it is, not downloaded again


@pytest.mark.parametrize(
    ("sha", "size", "needle"),
    [
        ("0" * 64, None, "sha256"),
        (None, 1 << 20, "more than the plan's"),
        (None, 4 << 20, "bytes, the plan's model has"),
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
    dest = tmp_path / "m.gguf"
    done = _run(
        "model",
        "--url",
        m.url("pod", "m.gguf"),
        "--sha256",
        sha or digest,
        "--size",
        str(size or real_size),
        "--dest",
        str(dest),
    )
    assert done.returncode == 1 and needle in done.stderr, done.stderr
    assert not dest.exists() and not list(tmp_path.glob(".*part"))


def test_an_unreachable_mirror_fails_after_its_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podinit, "RETRY_DELAY_S", 0.0)
    url = f"http://127.0.0.1:{free_port()}/m.gguf"
    with pytest.raises(podinit.InitError, match="no model after 3 attempts"):
        podinit.model(url, hashlib.sha256(b"").hexdigest(), 10, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())
