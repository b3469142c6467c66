"""The deployed service serves the planned model: checked, installed, named in the plan.

Preset plans need ``--model FILE`` (78 without); the file is checked against
the plan (65 for a file plan whose file differs, 78 for a GGUF that is not the
preset's model); apply installs it under /var/lib/slmguard-models (a hard link
or a copy), the installed plan names it with size and sha256, and rollback
removes it without touching the source.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from rendertrees import make_board_root, make_model_file, make_plan, snapshot
from slmguard.cli import main
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.modelfile import MODEL_DIR, ModelSource, planned_model
from slmguard.deploy.render import RenderOptions, render_deployment
from slmguard.deploy.rollback import rollback
from slmguard.deploy.target import TargetState
from slmguard.deploy.units import service_unit
from slmguard.deploy.writer import RootWriter
from slmguard.errors import (
    ConfigError,
    ModelError,
    ModelMismatchError,
    ModelNotFoundError,
    RefusedError,
    WrongModelError,
)
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.schema import Plan

OPTS = RenderOptions(exec_path="/usr/bin/slmguard")
EXE = ["--exec", "/usr/bin/slmguard"]
REAL_MODEL = Path("/var/lib/slmguard/models/gemma-3-270m-q4_k_m.gguf")


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


def _file_plan(model: Path, size: int, digest: str | None) -> Plan:
    return make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _written_gguf(
    path: Path, arch: str = "llama", n_layer: int = 2, n_ctx_train: int = 4096
) -> Path:
    w = GGUFWriter(path, arch)
    w.add_name("tiny")
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.context_length", n_ctx_train)
    w.add_uint32(f"{arch}.feed_forward_length", 128)
    w.add_uint32(f"{arch}.attention.head_count", 4)
    w.add_uint32(f"{arch}.attention.head_count_kv", 2)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(500)])
    w.add_tensor("token_embd.weight", np.ones((500, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("verb", ["render", "apply"])
def test_a_preset_plan_without_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    plan = tmp_path / "preset.json"
    plan.write_text(dumps_plan(make_plan(model_path=None)))
    before = snapshot(root)
    where = ["--out", str(tmp_path / "out")] if verb == "render" else ["--root", str(root)]
    code, out = _cli([verb, "--plan", str(plan), *where, *EXE], capsys)
    assert code == 78, out
    assert "preset 'gemma-3-270m-it'" in out and "--model FILE" in out
    assert len(out.strip().splitlines()) <= 2  # the error and its hint
    assert snapshot(root) == before and not (tmp_path / "out").exists()


@pytest.mark.skipif(not REAL_MODEL.is_file(), reason="the real model is not prepared")
def test_a_preset_plan_deploys_the_given_real_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan --preset` then `apply --model REAL`: installed, named, hashed, rolled back."""
    root = make_board_root(tmp_path / "root", "armbian")
    plan = tmp_path / "plan.json"
    code, out = _cli(
        [
            "plan",
            "--preset",
            "gemma-3-270m-it",
            "--board",
            "rk3588-4g",
            "--json",
            "--out",
            str(plan),
        ],
        capsys,
    )
    assert code == 0, out
    assert load_plan(plan).model.path is None
    before = snapshot(root)
    real_sha = _sha(REAL_MODEL)
    code, out = _cli(
        ["apply", "--plan", str(plan), "--root", str(root), "--model", str(REAL_MODEL), *EXE],
        capsys,
    )
    assert code == 0, out
    installed = root / MODEL_DIR.lstrip("/") / REAL_MODEL.name
    # The source lives in the services' state directory: copied, never linked.
    assert f"created {MODEL_DIR}/{REAL_MODEL.name} (copy of {REAL_MODEL})" in out
    assert not os.path.samefile(installed, REAL_MODEL)
    assert _sha(installed) == real_sha
    deployed = load_plan(root / "etc/slmguard/plan.json").model
    assert deployed.path == f"{MODEL_DIR}/{REAL_MODEL.name}"
    assert (deployed.file_bytes, deployed.sha256) == (REAL_MODEL.stat().st_size, real_sha)
    assert deployed.preset == "gemma-3-270m-it" and deployed.arch == "gemma3"
    # Applying the installed plan again (no --plan, no --model): nothing to change.
    code, out = _cli(["apply", "--root", str(root), *EXE], capsys)
    assert code == 0 and "nothing to change" in out, out
    code, out = _cli(["rollback", "--root", str(root)], capsys)
    assert code == 0 and f"removed {MODEL_DIR}/{REAL_MODEL.name}" in out
    assert snapshot(root) == before and _sha(REAL_MODEL) == real_sha


def test_a_gguf_that_is_not_the_presets_model_is_refused(tmp_path: Path) -> None:
    other = _written_gguf(tmp_path / "llama-2-layers.gguf")
    with pytest.raises(WrongModelError, match="is llama with 2 layers") as err:
        planned_model(make_plan(model_path=None), other)
    assert "the plan (preset gemma-3-270m-it) is for gemma3 with 18 layers" in err.value.message
    assert err.value.exit_code == 78
    same_shape = _written_gguf(tmp_path / "g.gguf", arch="gemma3", n_layer=18, n_ctx_train=32768)
    spec = planned_model(make_plan(model_path=None), same_shape).spec
    assert spec.path == f"{MODEL_DIR}/g.gguf"
    assert (spec.file_bytes, spec.sha256) == (same_shape.stat().st_size, _sha(same_shape))


def test_a_file_plan_whose_file_changed_is_refused(tmp_path: Path) -> None:
    model, size, digest = make_model_file(tmp_path / "m.gguf")
    planned_model(_file_plan(model, size, digest), None)
    with pytest.raises(ModelMismatchError, match=f"the plan expects {size + 1:,} bytes") as err:
        planned_model(_file_plan(model, size + 1, digest), None)
    assert err.value.exit_code == 65
    with pytest.raises(ModelMismatchError, match="sha256 is"):
        planned_model(_file_plan(model, size, "0" * 64), None)
    with pytest.raises(ModelNotFoundError):
        planned_model(_file_plan(tmp_path / "gone.gguf", size, digest), None)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match="not a regular file"):  # and does not hang
        planned_model(_file_plan(fifo, size, digest), None)
    # A hostile plan naming a secret with its size: not a GGUF, never installed 0644.
    shadow = tmp_path / "shadow"
    shadow.write_bytes(b"root:$6$secret:19000:0:99999:7:::\n")
    shadow.chmod(0o600)
    with pytest.raises(ModelError, match="not a GGUF file"):
        planned_model(_file_plan(shadow, shadow.stat().st_size, None), None)
    # --model may name the same file elsewhere (moved to the board): same size and sha256.
    moved = tmp_path / "elsewhere/m.gguf"
    moved.parent.mkdir()
    moved.write_bytes(model.read_bytes())
    got = planned_model(_file_plan(tmp_path / "planned-here.gguf", size, digest), moved)
    assert got.source == moved and got.sha256 == digest
    # A plan without a sha256 (made before it was recorded): plan again.
    with pytest.raises(ConfigError, match="without its sha256"):
        planned_model(_file_plan(model, size, None), None)


def test_apply_links_a_root_owned_model_and_copies_any_other(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    model, size, digest = make_model_file(tmp_path / "models/m.gguf")
    plan = _file_plan(model, size, digest)
    result = apply_plan(plan, OPTS, root, model=planned_model(plan, None))
    installed = root / "var/lib/slmguard-models/m.gguf"
    assert result.model_install == "hard link" and os.path.samefile(installed, model)
    rollback(root)
    assert not installed.exists() and model.read_bytes()  # the source stays
    model.chmod(0o600)  # the service user could not read a link of it: copied, 0644
    result = apply_plan(plan, OPTS, root, model=planned_model(plan, None))
    assert result.model_install == "copy" and not os.path.samefile(installed, model)
    assert stat.S_IMODE(installed.stat().st_mode) == 0o644 and _sha(installed) == digest
    again = apply_plan(plan, OPTS, root, model=planned_model(plan, None))
    assert not again.changed


def test_the_service_user_can_read_the_installed_model(tmp_path: Path) -> None:
    """Whatever the umask: every directory on the way 0755, the model and plan 0644, root's.

    The unit's sandbox allows reading it: not under /home, /root or /run/user
    (ProtectHome=yes stays yes even when the source is in a home directory), not
    in /tmp (PrivateTmp), and read-only like all of /var (ProtectSystem=strict).
    """
    root = make_board_root(tmp_path / "root", "armbian")
    model, size, digest = make_model_file(tmp_path / "home/pi/models/m.gguf")
    plan = _file_plan(model, size, digest)
    with umask(0o077):  # the directories apply creates (/etc/slmguard, /var/lib/...)
        apply_plan(plan, OPTS, root, model=planned_model(plan, None))
    for dest in ("/var/lib/slmguard-models/m.gguf", "/etc/slmguard/plan.json"):
        path = root / dest.lstrip("/")
        assert stat.S_IMODE(path.stat().st_mode) & 0o004, dest
        for parent in path.relative_to(root).parents:
            if parent != Path("."):
                assert stat.S_IMODE((root / parent).stat().st_mode) & 0o005 == 0o005, parent
    unit = (root / "etc/systemd/system/slmguard.service").read_text()
    assert "ProtectHome=yes" in unit and "ProtectSystem=strict" in unit and "PrivateTmp=yes" in unit
    # A plan made from a file in a home directory: the unit serves the installed copy,
    # so the home directories stay hidden (serving it in place needed ProtectHome=read-only).
    home = make_plan(model_path="/home/pi/models/m.gguf", model_bytes=size, model_sha256=digest)
    source = ModelSource(model, replace(home.model, path=f"{MODEL_DIR}/m.gguf"))
    files = render_deployment(home, OPTS, TargetState(), source).files
    served = next(f for f in files if f.path == "/etc/systemd/system/slmguard.service")
    assert "ProtectHome=yes" in (served.content or b"").decode()
    assert "ProtectHome=read-only" in service_unit(home, OPTS)
    assert "InaccessiblePaths" not in unit and "TemporaryFileSystem" not in unit
    assert (
        "ExecStart=/usr/bin/slmguard serve --plan /etc/slmguard/plan.json "
        "--admin-token-file %d/admin-token"
    ) in unit


def test_a_new_model_replaces_the_old_and_rollback_removes_both(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    a = make_model_file(tmp_path / "models/a.gguf")
    b = make_model_file(tmp_path / "models/b.gguf", size=32 << 10)
    for path, size, digest in (a, b):
        plan = _file_plan(path, size, digest)
        result = apply_plan(plan, OPTS, root, model=planned_model(plan, None))
    assert [r.path for r in result.removals] == ["/var/lib/slmguard-models/a.gguf"]
    assert not (root / "var/lib/slmguard-models/a.gguf").exists()
    deployed = json.loads((root / "etc/slmguard/plan.json").read_text())["model"]
    assert deployed["path"] == "/var/lib/slmguard-models/b.gguf" and deployed["sha256"] == b[2]
    rollback(root)
    assert snapshot(root) == before


def test_a_file_apply_did_not_put_at_the_model_path_is_not_replaced(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    model, size, digest = make_model_file(tmp_path / "models/m.gguf")
    theirs = root / "var/lib/slmguard-models/m.gguf"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"someone else's file\n")
    before = snapshot(root)
    plan = _file_plan(model, size, digest)
    with pytest.raises(RefusedError, match="was not installed by slmguard apply"):
        apply_plan(plan, OPTS, root, model=planned_model(plan, None))
    assert snapshot(root) == before


def test_an_odd_model_file_name_is_installed_under_a_plain_name(tmp_path: Path) -> None:
    model, size, digest = make_model_file(tmp_path / "my model (v2)\n$x%n.gguf")
    got = planned_model(_file_plan(model, size, digest), None)
    assert got.dest == f"{MODEL_DIR}/my_model__v2___x_n.gguf"


def test_a_copy_that_does_not_hash_as_checked_is_not_put_in_place(tmp_path: Path) -> None:
    model, _, _ = make_model_file(tmp_path / "m.gguf")
    w = RootWriter(tmp_path)
    with pytest.raises(ModelError, match="changed while it was copied"):
        w.copy("/copy.gguf", model, sha256="0" * 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_dry_run_and_render_name_the_model_without_writing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    model, size, digest = make_model_file(tmp_path / "m.gguf")
    plan = tmp_path / "plan.json"
    plan.write_text(dumps_plan(_file_plan(model, size, digest)))
    code, out = _cli(["apply", "--plan", str(plan), "--root", str(root), "--dry-run", *EXE], capsys)
    assert code == 0 and f"+<model, {size} bytes, sha256 {digest}, from {model}>" in out
    code, out = _cli(["render", "--plan", str(plan), "--out", str(tmp_path / "out"), *EXE], capsys)
    assert code == 0 and f"not written: {MODEL_DIR}/m.gguf (the model, {size} bytes" in out
    rendered = load_plan(tmp_path / "out/etc/slmguard/plan.json").model
    assert (rendered.path, rendered.sha256) == (f"{MODEL_DIR}/m.gguf", digest)
    assert not (tmp_path / "out/var").exists()
