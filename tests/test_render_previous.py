"""Plans as versions: apply keeps the deployment it replaces, ``rollback --to previous`` goes back.

- one plan back restores every byte, mode and mtime of the previous deployment
  (the plan, the units, a dropped and an added drop-in, the boot file, the
  model from its kept hard link), and the full rollback still returns to
  before the first apply;
- after the first apply, one plan back is the state before it; going back
  twice says so and changes nothing;
- an apply that dies midway (while saving the previous deployment, or while
  writing the targets) leaves a manifest that still describes the last
  finished deployment: going back restores it, and an apply run again keeps
  it as the previous one instead of the half-written state;
- an apply cut off midway (a power cut) is undone at the next boot
  (``rollback --if-unfinished``, slmguard-recover.service): back to the last
  finished deployment, or the stock board when the first apply was cut; a finished
  apply is left alone;
- a damaged kept file or a hostile previous record refuses, nothing touched;
- a model apply hashed is not read again while its stamp (size, inode,
  mtime) matches, and is hashed again when it changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from rendertrees import make_board_root, make_model_file, make_plan, run_cli, snapshot
from slmguard import atomicio
from slmguard.deploy import target
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.digests import load_digests
from slmguard.deploy.manifest import APPLY_DIR, apply_dir, load_manifest
from slmguard.deploy.modelfile import planned_model
from slmguard.deploy.render import RenderOptions
from slmguard.deploy.rollback import rollback, rollback_previous, rollback_unfinished
from slmguard.errors import HostWriteError, ModelMismatchError, RefusedError
from slmguard.plan import model as plan_model
from slmguard.plan.schema import Plan

OPTS = RenderOptions(exec_path="/usr/bin/slmguard", protect=("nginx.service",))
OTHER_OPTS = RenderOptions(exec_path="/usr/bin/slmguard", protect=("redis.service",))
APPLY = APPLY_DIR.lstrip("/")


def deployment(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under ``root`` except apply's own records (the manifest, kept files)."""
    return {k: v for k, v in snapshot(root).items() if not k.startswith(APPLY)}


def _model(tmp: Path, name: str, fill: int, size: int = 64 << 10) -> tuple[Path, int, str]:
    """A stand-in GGUF whose bytes depend on ``fill`` (file plans check size and sha256)."""
    path, size, _ = make_model_file(tmp / "models" / name, size)
    data = b"GGUF" + bytes([fill]) * 4 + path.read_bytes()[8:]
    path.write_bytes(data)
    return path, size, hashlib.sha256(data).hexdigest()


def _plans(tmp: Path) -> tuple[Plan, Plan]:
    """Plan A and plan B: another model (another name), other limits and cma=."""
    m1, s1, d1 = _model(tmp, "m1.gguf", 1)
    m2, s2, d2 = _model(tmp, "m2.gguf", 2)
    a = make_plan(model_path=str(m1), model_bytes=s1, model_sha256=d1)
    b = make_plan(
        model_path=str(m2),
        model_bytes=s2,
        model_sha256=d2,
        memory_max_bytes=2 << 30,
        memory_high_bytes=1536 << 20,
        cma_bytes=1 << 30,
    )
    return a, b


def _apply(root: Path, plan: Plan, opts: RenderOptions = OPTS) -> object:
    digests = load_digests(root)
    model = planned_model(plan, None, root, digests=digests)
    return apply_plan(plan, opts, root, model=model, digests=digests)


def test_one_plan_back_is_the_previous_deployment_byte_for_byte(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    a, b = _plans(tmp_path)
    _apply(root, a)
    on_a = deployment(root)
    result = _apply(root, b, OTHER_OPTS)
    assert result.previous_kept  # type: ignore[attr-defined]
    on_b = deployment(root)
    assert on_b != on_a
    assert "var/lib/slmguard-models/m2.gguf" in on_b
    assert "var/lib/slmguard-models/m1.gguf" not in on_b  # the old model: stale, removed

    back = rollback_previous(root)
    assert not back.nothing and not back.to_initial
    assert "/var/lib/slmguard-models/m1.gguf" in back.restored
    assert "/var/lib/slmguard-models/m2.gguf" in back.removed
    assert "/etc/systemd/system/redis.service.d" in back.removed_dirs
    assert deployment(root) == on_a  # bytes, modes, mtimes, links and directories
    manifest = load_manifest(root)
    assert manifest is not None and manifest.previous is None and manifest.complete
    assert not any(p.name.startswith("previous-") for p in apply_dir(root).iterdir())

    again = rollback_previous(root)
    assert again.no_previous and deployment(root) == on_a
    rollback(root)
    assert snapshot(root) == before


def test_after_the_first_apply_one_plan_back_is_before_it(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "uenv")
    before = snapshot(root)
    a, _ = _plans(tmp_path)
    _apply(root, a)
    back = rollback_previous(root)
    assert back.to_initial and back.restored
    assert snapshot(root) == before
    assert rollback_previous(root).nothing


def test_the_model_kept_is_a_hard_link_and_comes_back_with_its_inode(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "extlinux")
    # Large enough to be kept as a link (a small file's bytes are copied), and B's
    # model has A's file name but other bytes: the same destination, replaced.
    m1, s1, d1 = _model(tmp_path / "a", "m1.gguf", 1, 2 << 20)
    a = make_plan(model_path=str(m1), model_bytes=s1, model_sha256=d1, cma_bytes=None)
    m, size, digest = _model(tmp_path / "b", "m1.gguf", 7, 2 << 20)
    b = make_plan(model_path=str(m), model_bytes=size, model_sha256=digest, cma_bytes=None)
    _apply(root, a)
    installed = root / "var/lib/slmguard-models/m1.gguf"
    ino = installed.stat().st_ino
    _apply(root, b)
    assert installed.stat().st_ino != ino
    kept = list(apply_dir(root).glob("previous-*/var/lib/slmguard-models/m1.gguf"))
    assert len(kept) == 1 and kept[0].stat().st_ino == ino  # a link, not a copy
    rollback_previous(root)
    assert installed.stat().st_ino == ino


def _failing_after(monkeypatch: pytest.MonkeyPatch, n: int, where: str) -> None:
    """Make the (n+1)-th atomic write whose path contains ``where`` fail (ENOSPC).

    apply's own files count only when ``where`` names them (``/previous-``).
    """
    real = atomicio.write_atomic
    seen = [0]

    def write(path: Path, data: bytes, *args: object, **kw: object) -> None:
        own = APPLY_DIR in str(path) and APPLY_DIR not in where and "/previous-" not in where
        if where in str(path) and not own:
            seen[0] += 1
            if seen[0] > n:
                raise OSError(28, "No space left on device")
        real(path, data, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(atomicio, "write_atomic", write)


def _b_died(
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
    where: str,
    deployment: Callable[[Path], dict[str, tuple[object, ...]]] = deployment,
) -> tuple[Path, Plan, dict[str, tuple[object, ...]]]:
    """A root on plan A whose apply of plan B died at the (n+1)-th write matching ``where``:
    (the root, plan B, ``deployment(root)`` as it was on A)."""
    root = make_board_root(tmp / "root", "armbian")
    a, b = _plans(tmp)
    _apply(root, a)
    on_a = deployment(root)
    _failing_after(monkeypatch, n, where)
    with pytest.raises(HostWriteError):
        _apply(root, b, OTHER_OPTS)
    monkeypatch.undo()
    return root, b, on_a


def test_an_apply_that_dies_writing_the_targets_can_go_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _, on_a = _b_died(tmp_path, monkeypatch, 2, "/etc/systemd/system/")
    assert deployment(root) != on_a  # half written
    manifest = load_manifest(root)
    assert manifest is not None and not manifest.complete
    assert manifest.previous is not None and not manifest.previous.initial

    rollback_previous(root)
    assert deployment(root) == on_a


def test_an_apply_cut_off_midway_is_undone_at_boot_and_a_finished_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _, on_a = _b_died(tmp_path, monkeypatch, 2, "/etc/systemd/system/")
    on_b_half = deployment(root)
    assert on_b_half != on_a  # half of plan B, what a power cut there leaves
    code, out = run_cli(["rollback", "--root", str(root), "--if-unfinished"], capsys)
    assert code == 0 and "did not finish" in out and "back on the previous plan" in out
    assert deployment(root) == on_a
    manifest = load_manifest(root)
    assert manifest is not None and manifest.complete and manifest.previous is None
    # The next boot: the last apply finished (the recovery's own), nothing is touched.
    again = rollback_unfinished(root)
    assert again.nothing and not again.unfinished and deployment(root) == on_a
    code, out = run_cli(["rollback", "--root", str(root), "--if-unfinished"], capsys)
    assert code == 0 and "nothing to undo" in out


def test_the_recovery_removes_the_temporary_a_cut_write_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power cut inside an atomic write leaves its temporary (created, not renamed in;
    the systest's power-cut-apply found one in the VM): the boot's recovery removes it,
    and nothing that only looks like one."""
    root, _, on_a = _b_died(tmp_path, monkeypatch, 2, "/etc/systemd/system/")
    manifest = load_manifest(root)
    assert manifest is not None
    unit = sorted(p for p in manifest.paths() if p.startswith("/etc/systemd/system/"))[0]
    cut = root / unit.lstrip("/")
    left = cut.with_name(f".{cut.name}{atomicio.TMP_INFIX}4242")
    left.write_bytes(b"half")
    others = [cut.with_name(f".{cut.name}{atomicio.TMP_INFIX}x1"),
              cut.with_name(f".unrecorded.conf{atomicio.TMP_INFIX}7")]  # fmt: skip
    for other in others:
        other.write_bytes(b"not apply's")
    back = rollback_unfinished(root)
    assert back.unfinished and "/" + str(left.relative_to(root)) in back.removed
    assert not left.exists() and all(o.exists() for o in others)
    for other in others:
        other.unlink()
    assert deployment(root) == on_a


def test_a_first_apply_cut_off_midway_is_undone_to_the_stock_board(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    a, _ = _plans(tmp_path)
    _failing_after(monkeypatch, 3, "/etc/")
    with pytest.raises(HostWriteError):
        _apply(root, a)
    monkeypatch.undo()
    # Written first, so a cut anywhere later finds it at the next boot.
    assert (root / "etc/systemd/system/sysinit.target.wants/slmguard-recover.service").is_symlink()
    assert (root / "etc/slmguard/plan.json").exists()  # and a part of the plan
    back = rollback_unfinished(root)
    assert back.unfinished and back.to_initial
    assert snapshot(root) == before
    assert rollback_unfinished(root).nothing


def test_an_apply_run_again_after_one_died_keeps_the_last_finished_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, b, on_a = _b_died(tmp_path, monkeypatch, 3, "/etc/")
    _apply(root, b, OTHER_OPTS)  # finishes B: the half-written state is not "previous"
    manifest = load_manifest(root)
    assert manifest is not None and manifest.complete
    rollback_previous(root)
    assert deployment(root) == on_a


def test_an_apply_that_dies_saving_the_previous_plan_touched_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, b, on_a = _b_died(tmp_path, monkeypatch, 1, "/previous-", deployment=snapshot)
    after = snapshot(root)
    # Only the half-kept files of the new generation appeared; the manifest is A's.
    assert {k for k in after if k not in on_a} <= {
        k for k in after if k.startswith(f"{APPLY}/previous-2")
    }
    assert {k: v for k, v in after.items() if k in on_a} == on_a
    _apply(root, b, OTHER_OPTS)
    manifest = load_manifest(root)
    assert manifest is not None and manifest.previous is not None
    kept = {
        str(p.relative_to(apply_dir(root) / manifest.previous.base))
        for p in (apply_dir(root) / manifest.previous.base).rglob("*")
        if p.is_file()
    }
    files = manifest.previous.entries
    assert kept == {str(e["path"]).lstrip("/") for e in files if e.get("kind") == "file"}
    rollback_previous(root)
    assert deployment(root) == {k: v for k, v in on_a.items() if not k.startswith(APPLY)}


def test_an_apply_that_dies_the_first_time_still_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_board_root(tmp_path / "root", "extlinux")
    before = snapshot(root)
    a, _ = _plans(tmp_path)
    _failing_after(monkeypatch, 2, "/etc/")
    with pytest.raises(HostWriteError):
        _apply(root, a)
    monkeypatch.undo()
    rollback_previous(root)
    assert snapshot(root) == before


def test_a_damaged_kept_file_refuses_and_changes_nothing(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, b = _plans(tmp_path)
    _apply(root, a)
    _apply(root, b, OTHER_OPTS)
    (kept,) = apply_dir(root).glob("previous-*/etc/slmguard/plan.json")
    kept.write_text("{}\n")
    on_b = snapshot(root)
    with pytest.raises(RefusedError, match="missing or damaged"):
        rollback_previous(root)
    assert snapshot(root) == on_b


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("path", "/etc/../shadow", "path"),
        ("backup", "backup/etc/slmguard/plan.json", "not a valid file record"),
        ("sha256", "0" * 63, "not a valid file record"),
    ],
)
def test_a_hostile_previous_record_is_refused(
    tmp_path: Path, field: str, value: str, message: str
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, b = _plans(tmp_path)
    _apply(root, a)
    _apply(root, b, OTHER_OPTS)
    path = apply_dir(root) / "manifest.json"
    data = json.loads(path.read_text())
    entry = next(e for e in data["previous"]["entries"] if e.get("kind") == "file")
    entry[field] = value
    path.write_text(json.dumps(data))
    on_b = snapshot(root)
    with pytest.raises(RefusedError, match=message):
        rollback_previous(root)
    assert snapshot(root) == on_b


def test_a_stamped_model_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, _ = _plans(tmp_path)
    _apply(root, a)

    def no_read(*args: object, **kw: object) -> object:
        raise AssertionError("the model was read")

    with monkeypatch.context() as m:
        m.setattr(plan_model, "model_file", no_read)
        m.setattr(target, "sha256_file", no_read)
        again = _apply(root, a)
    assert not again.changed  # type: ignore[attr-defined]

    # Bytes changed in place with the size and mtime put back: the stamp still vouches
    # (the documented limit), so it is trusted without a read.
    src = Path(str(a.model.path))
    st = src.stat()
    with src.open("r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not _apply(root, a).changed  # type: ignore[attr-defined]
    # A write that moves the mtime: hashed again, and refused as not the plan's model.
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(ModelMismatchError):
        _apply(root, a)


def test_a_stamp_file_of_the_wrong_shape_is_ignored(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, _ = _plans(tmp_path)
    _apply(root, a)
    stamps = apply_dir(root) / "digests.json"
    assert json.loads(stamps.read_text())["entries"]
    stamps.write_text('{"schema": "slmguard.digests/1", "entries": [{"path": 1}]}')
    assert load_digests(root).entries == []
    stamps.write_text("[" * 100000)
    assert load_digests(root).entries == []
    assert not _apply(root, a).changed  # type: ignore[attr-defined]
    assert json.loads(stamps.read_text())["entries"]  # hashed once more, stamped again


def testrun_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slmguard.plan.planfile import dumps_plan

    root = make_board_root(tmp_path / "root", "armbian")
    a, b = _plans(tmp_path)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(dumps_plan(a))
    pb.write_text(dumps_plan(b))
    base = ["apply", "--root", str(root), "--exec", "/usr/bin/slmguard"]
    code, text = run_cli([*base, "--plan", str(pa)], capsys)
    assert code == 0 and "previous plan kept" not in text
    on_a = deployment(root)
    code, text = run_cli([*base, "--plan", str(pb)], capsys)
    assert code == 0 and "slmguard rollback --to previous --root" in text
    code, text = run_cli(["rollback", "--to", "previous", "--root", str(root)], capsys)
    assert code == 0 and "restored /etc/slmguard/plan.json" in text
    assert "back on the previous plan (plan.json sha256 " in text
    assert deployment(root) == on_a
    code, text = run_cli(["rollback", "--to", "previous", "--root", str(root)], capsys)
    assert code == 0 and "nothing to roll back" in text
    code, text = run_cli(["rollback", "--to", "later", "--root", str(root)], capsys)
    assert code == 64 and "invalid choice" in text
