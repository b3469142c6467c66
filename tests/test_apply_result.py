"""``apply --json`` and ``--rollout``: the facts a fleet decides from, and undoing one rollout.

- ``apply --json`` prints one JSON object whatever happens: ``changed`` (this
  run wrote or removed a file under the root), the plan's sha256 and the
  rollout before and after, the paths; a second apply says ``changed: false``
  and keeps the rollout that made the deployment;
- a refused apply (78: the plan is above the board's MemTotal; 65: a model
  that is not the plan's) exits with its code, says ``changed: false`` and
  leaves every byte of the root as it was;
- an apply that dies writing (a small file system that fills while the model
  is copied) says ``changed: true``: the board must go back;
- ``rollback --to previous --rollout ID`` goes back only when that rollout
  made the deployment in place (else nothing is written, byte for byte), and
  the deployment it returns to carries its own rollout again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rendertrees import make_board_root, make_model_file, make_plan, snapshot
from slmguard.cli import main
from slmguard.deploy.manifest import load_manifest
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.schema import Plan

GiB = 1 << 30


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """``slmguard ARGV`` in this process: (exit status, stdout as JSON, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), json.loads(out), err


def _plan_file(tmp: Path, name: str, plan: Plan) -> Path:
    path = tmp / f"{name}.json"
    path.write_text(dumps_plan(plan))
    return path


def _plans(tmp: Path) -> tuple[Path, Path, Path]:
    """Plan A and plan B (other limits) for one model file, and that file."""
    model, size, digest = make_model_file(tmp / "models" / "m.gguf")
    a = make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)
    b = make_plan(
        model_path=str(model),
        model_bytes=size,
        model_sha256=digest,
        memory_max_bytes=2 * GiB,
        memory_high_bytes=1536 << 20,
    )
    return _plan_file(tmp, "a", a), _plan_file(tmp, "b", b), model


def _apply(capsys: pytest.CaptureFixture[str], root: Path, plan: Path, *extra: str) -> Any:
    code, out, err = _cli(
        capsys, "apply", "--plan", str(plan), "--root", str(root), "--exec", "/x", "--json", *extra
    )
    assert code == 0, err
    return out


def test_apply_json_says_what_changed_and_which_rollout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, b, _ = _plans(tmp_path)
    first = _apply(capsys, root, a, "--rollout", "r1")
    assert first["changed"] is True and first["exit"] == 0
    assert first["plan_sha256_before"] is None and first["rollout_before"] is None
    assert first["rollout_after"] == "r1" and len(first["plan_sha256_after"]) == 64
    assert {c["path"] for c in first["changes"]} >= {"/etc/slmguard/plan.json"}
    assert first["model"]["installed"] is True
    assert first["next_boot"] == ["/boot/armbianEnv.txt"]

    again = _apply(capsys, root, a, "--rollout", "r2")
    assert again["changed"] is False and again["changes"] == [] and again["next_boot"] == []
    assert again["rollout_after"] == "r1"  # nothing changed: r2 moved nothing
    assert again["plan_sha256_after"] == first["plan_sha256_after"]

    moved = _apply(capsys, root, b, "--rollout", "r2")
    assert moved["changed"] is True
    assert moved["plan_sha256_before"] == first["plan_sha256_after"]
    assert (moved["rollout_before"], moved["rollout_after"]) == ("r1", "r2")
    manifest = load_manifest(root)
    assert manifest is not None and manifest.rollout == "r2"
    assert manifest.previous is not None and manifest.previous.rollout == "r1"


def test_a_refused_apply_says_unchanged_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, _, model = _plans(tmp_path)
    _apply(capsys, root, a, "--rollout", "r1")
    before = snapshot(root)
    # 78: a plan above the board's MemTotal (3.8 GiB here).
    big = make_plan(
        ram_bytes=8 * GiB,
        memory_max_bytes=6 * GiB,
        memory_high_bytes=5 * GiB,
        model_path=str(model),
        model_bytes=model.stat().st_size,
        model_sha256=json.loads(a.read_text())["model"]["sha256"],
    )
    code, out, err = _cli(
        capsys,
        "apply",
        "--plan",
        str(_plan_file(tmp_path, "big", big)),
        "--root",
        str(root),
        "--json",
        "--rollout",
        "r2",
    )
    assert code == 78 and out["exit"] == 78 and out["changed"] is False, err
    assert "MemTotal" in out["error"] or "memory" in out["error"]
    # 65: a model that is not the plan's (same size, other bytes).
    other = tmp_path / "other.gguf"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    other.write_bytes(bytes(data))
    code, out, _ = _cli(
        capsys, "apply", "--plan", str(a), "--model", str(other), "--root", str(root), "--json"
    )
    assert code == 65 and out["exit"] == 65 and out["changed"] is False
    assert snapshot(root) == before


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="mounts a small tmpfs (as root)"
)
def test_an_apply_that_dies_writing_says_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        root = make_board_root(small / "root", "armbian")
        # Bytes to spare (apply's free-space check passes) but inodes for a dozen more files
        # (the manifest and the first files, not all): it fills midway, as a disk filled by
        # another writer does.
        st = os.statvfs(small)
        inodes = st.f_files - st.f_ffree + 12
        subprocess.run(["mount", "-o", f"remount,nr_inodes={inodes}", str(small)], check=True)
        model, size, digest = make_model_file(tmp_path / "models" / "big.gguf", 2 << 20)
        plan = make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)
        code, out, err = _cli(
            capsys,
            "apply",
            "--plan",
            str(_plan_file(tmp_path, "p", plan)),
            "--root",
            str(root),
            "--json",
            "--rollout",
            "r1",
        )
        # A file cannot be created midway: the filesystem has no inode left for it.
        assert code == 73 and out["exit"] == 73, err  # HostWriteError
        assert out["changed"] is True, out
        manifest = load_manifest(root)
        assert manifest is not None and not manifest.complete and manifest.rollout == "r1"
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_rollback_of_a_rollout_touches_only_that_rollout_s_deployment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, b, _ = _plans(tmp_path)
    _apply(capsys, root, a, "--rollout", "r1")
    _apply(capsys, root, b, "--rollout", "r2")
    on_b = snapshot(root)
    base = ["rollback", "--to", "previous", "--root", str(root), "--json"]

    code, out, _ = _cli(capsys, *base, "--rollout", "r1")
    assert code == 0 and out["changed"] is False and out["not_this_rollout"] is True
    assert out["rollout_in_place"] == "r2"
    assert snapshot(root) == on_b  # byte for byte, apply's records included

    code, out, _ = _cli(capsys, *base, "--rollout", "r2")
    assert code == 0 and out["changed"] is True and out["to_initial"] is False
    assert (
        out["plan_sha256"]
        == json.loads((root / "var/lib/slmguard-apply/manifest.json").read_text())["deployment"][
            "plan_sha256"
        ]
    )
    manifest = load_manifest(root)
    assert manifest is not None and manifest.rollout == "r1" and manifest.previous is None
    # r2 is undone; undoing it again moves nothing.
    code, out, _ = _cli(capsys, *base, "--rollout", "r2")
    assert out["changed"] is False and out["not_this_rollout"] is True


def test_a_rollout_id_is_a_plain_label(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, _, _ = _plans(tmp_path)
    before = snapshot(root)
    for bad in ("", "-x", "a b", "x" * 65, "r1\n- hosts: all", "{{ x }}"):
        code, out, _ = _cli(
            capsys, "apply", "--plan", str(a), "--root", str(root), "--json", f"--rollout={bad}"
        )
        assert code == 64 and out["changed"] is False, bad
    assert snapshot(root) == before


def test_a_hostile_rollout_in_the_manifest_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    a, _, _ = _plans(tmp_path)
    _apply(capsys, root, a, "--rollout", "r1")
    path = root / "var/lib/slmguard-apply/manifest.json"
    data = json.loads(path.read_text())
    data["deployment"]["rollout"] = "../../etc"
    path.write_text(json.dumps(data))
    from slmguard.errors import RefusedError

    with pytest.raises(RefusedError, match=r"deployment\.rollout"):
        load_manifest(root)
