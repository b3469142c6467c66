"""A plan with a vision projector deploys it like the model: checked, installed, named.

``apply`` checks the plan's projector file by size and sha256 (65 when it changed, 66
when it is gone), installs it beside the model in /var/lib/slmguard-models, the
installed plan names it, and the server's unit passes it (``serve --mmproj``); rollback
removes it. The fleet renderers carry it too (the k8s manifests here, the Ansible role
in tests/test_render_ansible.py). The real engine serving what apply installed:
tests/test_serve_vision.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rendertrees import make_board_root, make_model_file, make_plan, snapshot
from slmguard.cli import main
from slmguard.deploy.modelfile import MODEL_DIR
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.schema import Plan, ProjectorSpec

EXE = ["--exec", "/usr/bin/slmguard"]
UNIT = "etc/systemd/system/slmguard.service"


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


def _vision_plan(tmp: Path, projector_name: str = "mmproj-tiny.gguf") -> tuple[Path, Plan]:
    model, size, digest = make_model_file(tmp / "models/m.gguf")
    mmproj, vsize, vdigest = make_model_file(tmp / "models" / projector_name, 8 << 10)
    plan = make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)
    projector = ProjectorSpec(
        path=str(mmproj), file_bytes=vsize, name="tiny", projector_type="gemma3",
        tokens_per_image=16, sha256=vdigest, max_images=3,
    )  # fmt: skip
    engine = dataclasses.replace(plan.engine, n_batch=512, n_ubatch=512)
    plan = dataclasses.replace(plan, engine=engine, projector=projector)
    path = tmp / "plan.json"
    path.write_text(dumps_plan(plan))
    return path, load_plan(path)  # its relations hold


def test_apply_installs_the_projector_and_the_unit_passes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    plan_path, plan = _vision_plan(tmp_path)
    assert plan.projector is not None
    before = snapshot(root)
    code, out = _cli(["apply", "--plan", str(plan_path), "--root", str(root), *EXE], capsys)
    assert code == 0, out
    dest = f"{MODEL_DIR}/mmproj-tiny.gguf"
    assert f"created {dest} (" in out and f"of {plan.projector.path})" in out
    installed = root / dest.lstrip("/")
    assert installed.read_bytes() == Path(plan.projector.path).read_bytes()
    deployed = load_plan(root / "etc/slmguard/plan.json").projector
    assert deployed == dataclasses.replace(plan.projector, path=dest)
    unit = (root / UNIT).read_text()
    start = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert f" serve --plan /etc/slmguard/plan.json --mmproj {dest} " in start
    assert "16 tokens an image, fixed by the projector: no --image-max-tokens" in unit
    assert "at most 3 images of 8388608 bytes" in unit
    code, out = _cli(["apply", "--root", str(root), *EXE], capsys)  # the installed plan
    assert code == 0 and "nothing to change" in out, out
    code, out = _cli(["rollback", "--root", str(root)], capsys)
    assert code == 0 and f"removed {dest}" in out, out
    assert snapshot(root) == before


def test_a_projector_changed_or_gone_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    plan_path, plan = _vision_plan(tmp_path)
    assert plan.projector is not None
    before = snapshot(root)
    mmproj = Path(plan.projector.path)
    mmproj.write_bytes(b"GGUF" + b"\1" * (plan.projector.file_bytes - 4))  # same size
    code, out = _cli(["apply", "--plan", str(plan_path), "--root", str(root), *EXE], capsys)
    assert code == 65 and "sha256" in out, out
    mmproj.unlink()
    code, out = _cli(["apply", "--plan", str(plan_path), "--root", str(root), *EXE], capsys)
    assert code == 66 and str(mmproj) in out and "--mmproj" in out, out
    assert snapshot(root) == before


def test_render_names_the_projector_it_does_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_path, plan = _vision_plan(tmp_path)
    assert plan.projector is not None
    out_dir = tmp_path / "out"
    code, out = _cli(["render", "--plan", str(plan_path), "--out", str(out_dir), *EXE], capsys)
    assert code == 0, out
    v = plan.projector
    assert (
        f"not written: {MODEL_DIR}/mmproj-tiny.gguf (the projector, {v.file_bytes} bytes, "
        f"sha256 {v.sha256}" in out
    )
    assert f"--mmproj {MODEL_DIR}/mmproj-tiny.gguf" in (out_dir / UNIT).read_text()


def test_a_projector_named_as_the_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_path, _ = _vision_plan(tmp_path / "a")
    plan = load_plan(plan_path)
    assert plan.projector is not None
    other, size, digest = make_model_file(tmp_path / "b/m.gguf", plan.projector.file_bytes)
    clash = dataclasses.replace(plan.projector, path=str(other), file_bytes=size, sha256=digest)
    plan_path.write_text(dumps_plan(dataclasses.replace(plan, projector=clash)))
    code, out = _cli(["render", "--plan", str(plan_path), "--out", str(tmp_path / "o"), *EXE],
                     capsys)  # fmt: skip
    assert code == 78 and f"both be installed as {MODEL_DIR}/m.gguf" in out, out


def test_the_k8s_manifests_carry_the_projector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No longer refused (78): the plan's ConfigMap names the installed projector, the
    server is passed it (the Ansible role: tests/test_render_ansible.py)."""
    plan_path, plan = _vision_plan(tmp_path)
    assert plan.projector is not None
    out_dir = tmp_path / "out"
    image = "registry.example/slmguard:0.1.0@sha256:" + "0" * 64
    argv = ["render", "--target", "k8s", "--plan", str(plan_path), "--out", str(out_dir)]
    code, out = _cli([*argv, "--image", image], capsys)
    assert code == 0, out
    (configmap,) = out_dir.glob("*/plan-configmap.yaml")
    assert plan.projector.sha256 is not None and plan.projector.sha256 in configmap.read_text()
    assert f'"{MODEL_DIR}/mmproj-tiny.gguf"' in configmap.read_text()
    (daemonset,) = out_dir.glob("*/daemonset.yaml")
    assert f'- "--mmproj"\n            - "{MODEL_DIR}/mmproj-tiny.gguf"' in daemonset.read_text()


def test_mmproj_gives_a_copy_of_the_planned_projector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--mmproj FILE`` deploys a copy with the plan's size and sha256 (the planned file
    gone); another file is 65; a plan without a projector is 78."""
    root = make_board_root(tmp_path / "root", "armbian")
    plan_path, plan = _vision_plan(tmp_path)
    assert plan.projector is not None
    planned = Path(plan.projector.path)
    copy = tmp_path / "elsewhere/mmproj-copy.gguf"
    copy.parent.mkdir()
    copy.write_bytes(planned.read_bytes())
    planned.unlink()
    argv = ["apply", "--plan", str(plan_path), "--root", str(root), *EXE]
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\2" * (plan.projector.file_bytes - 4))
    code, out = _cli([*argv, "--mmproj", str(other)], capsys)
    assert code == 65 and "sha256" in out, out
    code, out = _cli([*argv, "--mmproj", str(copy)], capsys)
    assert code == 0, out
    dest = f"{MODEL_DIR}/mmproj-copy.gguf"
    assert (root / dest.lstrip("/")).read_bytes() == copy.read_bytes()
    assert f"--mmproj {dest}" in (root / UNIT).read_text()
    bare = tmp_path / "bare.json"
    bare.write_text(dumps_plan(dataclasses.replace(plan, projector=None)))
    code, out = _cli(["render", "--plan", str(bare), "--out", str(tmp_path / "o"),
                      "--mmproj", str(copy), *EXE], capsys)  # fmt: skip
    assert code == 78 and "no vision projector" in out, out
