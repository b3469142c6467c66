"""``doctor --verify-model``: rot in the installed model is found, where apply's stamp is fooled.

A board root with a plan applied (a stand-in GGUF model); a bit of the
installed model flips with its mtime kept, as rot on an SD card does. apply
(which trusts its stamp: size, inode, mtime) still finds nothing to change;
``doctor --plan /etc/slmguard/plan.json --verify-model`` reads every byte and
fails ``model.sha256``; without the flag the check is not run at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rendertrees import make_board_root, make_model_file, make_plan
from slmguard.cli import main
from slmguard.plan.planfile import dumps_plan


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


def _doctor(capsys: pytest.CaptureFixture[str], root: Path, *extra: str) -> tuple[int, Any]:
    code, out = _cli(
        capsys,
        "doctor",
        "--json",
        "--root",
        str(root),
        "--plan",
        str(root / "etc/slmguard/plan.json"),
        *extra,
    )
    return code, json.loads(out)


def _finding(report: Any) -> Any:
    found = [c for c in report["checks"] if c["id"] == "model.sha256"]
    return found[0] if found else None


def test_verify_model_finds_a_flipped_bit_the_stamp_misses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    model, size, digest = make_model_file(tmp_path / "models" / "m.gguf", 256 << 10)
    plan = tmp_path / "plan.json"
    plan.write_text(
        dumps_plan(make_plan(model_path=str(model), model_bytes=size, model_sha256=digest))
    )
    code, _ = _cli(capsys, "apply", "--plan", str(plan), "--root", str(root), "--exec", "/x")
    assert code == 0
    installed = root / "var/lib/slmguard-models/m.gguf"

    _, report = _doctor(capsys, root)
    assert _finding(report) is None  # not asked: not run
    _, report = _doctor(capsys, root, "--verify-model")
    assert _finding(report)["severity"] == "pass"

    st = installed.stat()
    with installed.open("r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0x04]))
    os.utime(installed, ns=(st.st_atime_ns, st.st_mtime_ns))

    code, out = _cli(capsys, "apply", "--plan", str(plan), "--root", str(root), "--exec", "/x")
    assert code == 0 and "nothing to change" in out  # apply trusts its stamp
    code, report = _doctor(capsys, root, "--verify-model")
    finding = _finding(report)
    assert code == 2 and finding["severity"] == "fail", finding
    assert "not the plan's model" in finding["summary"]
    assert {e["label"] for e in finding["evidence"]} >= {"sha256 now", "plan's sha256"}


def test_verify_model_needs_a_plan_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    plan = tmp_path / "preset.json"
    plan.write_text(dumps_plan(make_plan(model_path=None)))
    code, out = _cli(capsys, "doctor", "--root", str(root), "--plan", str(plan), "--verify-model")
    assert code == 3 and "--verify-model needs a plan" in out


def _flip(path: Path) -> None:
    """One bit of ``path`` flipped in the middle, its mtime kept (rot on the card)."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)[0]
        f.seek(st.st_size // 2)
        f.write(bytes([byte ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_verify_model_hashes_every_file_of_a_board_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A board plan with a second model and a projector (issues 39, 42): each installed file
    gets its own finding naming it; a flipped bit in the board model or the projector fails
    that file's finding only, and a file gone is a failure naming it."""
    from boardfiles import files_plan

    root = make_board_root(tmp_path / "root", "armbian")
    plan, _ = files_plan(tmp_path / "files")
    code, out = _cli(capsys, "apply", "--plan", str(plan), "--root", str(root), "--exec", "/x")
    assert code == 0, out
    models = root / "var/lib/slmguard-models"
    ids = ("model.sha256", "model.sha256.models[0]", "model.sha256.projector")
    names = ("m.gguf", "rerank.gguf", "mmproj-tiny.gguf")

    def findings() -> tuple[int, dict[str, Any]]:
        code, report = _doctor(capsys, root, "--verify-model")
        return code, {c["id"]: c for c in report["checks"] if c["id"] in ids}

    _, report = _doctor(capsys, root)
    assert not any(c["id"].startswith("model.sha256") for c in report["checks"])  # not asked
    _, found = findings()
    assert [found[i]["severity"] for i in ids] == ["pass"] * 3
    for i, name in zip(ids, names, strict=True):
        assert f"/var/lib/slmguard-models/{name}:" in found[i]["summary"]

    _flip(models / "rerank.gguf")
    _flip(models / "mmproj-tiny.gguf")
    code, found = findings()
    assert code == 2
    assert [found[i]["severity"] for i in ids] == ["pass", "fail", "fail"]
    assert (
        "/var/lib/slmguard-models/rerank.gguf is not the plan's model"
        in (found["model.sha256.models[0]"]["summary"])
    )
    assert (
        "/var/lib/slmguard-models/mmproj-tiny.gguf is not the plan's projector"
        in (found["model.sha256.projector"]["summary"])
    )
    (models / "mmproj-tiny.gguf").unlink()
    _, found = findings()
    gone = found["model.sha256.projector"]
    assert gone["severity"] == "fail" and "mmproj-tiny.gguf" in gone["summary"], gone
