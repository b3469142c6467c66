"""A board's neighbours and models deployed (issue 39): render puts each neighbour in the
business slice with MemoryMin=/MemoryLow= from the plan, apply installs every model,
doctor checks the neighbours are there, protected and within their memory."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from rendertrees import GiB, MiB, make_board_root, make_plan, run_cli, write
from rerankmodel import write_embedder, write_reranker
from slmguard.deploy.changes import Change
from slmguard.deploy.modelfile import ModelSource
from slmguard.deploy.render import RenderedFile, RenderOptions, render_files
from slmguard.deploy.space import model_links, needed_bytes
from slmguard.doctor.findings import FAIL, PASS, WARN
from slmguard.doctor.neighbours import check_neighbours
from slmguard.errors import RefusedError
from slmguard.host.snapshot import NeighbourUnit, collect
from slmguard.plan.planfile import load_plan
from slmguard.plan.schema import Neighbour, Plan
from systemdunits import find_systemd_analyze, materialize, values, verify

DROPIN = "/etc/systemd/system/{}.d/50-slmguard-protect.conf"
EXE = ["--exec", "/usr/bin/slmguard"]


def _with_neighbours(*neighbours: Neighbour) -> Plan:
    plan = make_plan()
    held = sum(n.memory_bytes for n in neighbours)
    lim = plan.limits  # the neighbours come out of the inference zone
    limits = dataclasses.replace(
        lim,
        business_reserve_bytes=lim.business_reserve_bytes + held,
        memory_max_bytes=lim.memory_max_bytes - held,
        memory_high_bytes=lim.memory_high_bytes - held,
    )
    return dataclasses.replace(plan, neighbours=neighbours, limits=limits)


def _opts(**kw: object) -> RenderOptions:
    own = Path(sys.executable).parent / "slmguard"
    return RenderOptions(exec_path=str(own if own.exists() else sys.executable), **kw)  # type: ignore[arg-type]


def _text(files: tuple[object, ...], path: str) -> str:
    found = [f for f in files if getattr(f, "path", None) == path]
    assert found, path
    return (found[0].content or b"").decode()  # type: ignore[attr-defined]


PLAN = _with_neighbours(
    Neighbour("whisper", 600 * MiB, unit="whisper.service"),
    Neighbour("tts", 256 * MiB, unit="piper-tts.service", protection="low"),
    Neighbour("camera", 128 * MiB),
)


def test_each_neighbour_unit_gets_its_slice_and_protection() -> None:
    files = render_files(PLAN, _opts(protect=("whisper.service", "mosquitto.service")))
    whisper = _text(files, DROPIN.format("whisper.service"))
    assert values(whisper, "Service", "Slice") == ["business.slice"]
    assert values(whisper, "Service", "MemoryMin") == ["600M"]
    assert values(whisper, "Service", "MemoryLow") == []
    tts = _text(files, DROPIN.format("piper-tts.service"))
    assert values(tts, "Service", "MemoryLow") == ["256M"]
    assert values(tts, "Service", "MemoryMin") == []
    # --protect of a neighbour's unit: one drop-in, the neighbour's; others as before
    assert sum(f.path == DROPIN.format("whisper.service") for f in files) == 1
    assert values(_text(files, DROPIN.format("mosquitto.service")), "Service", "Slice") == [
        "business.slice"
    ]
    # The slice guarantees the board's reserve and the MemoryMin= neighbours; the MemoryLow=
    # one is within its MemoryLow=.
    business = _text(files, "/etc/systemd/system/business.slice")
    assert values(business, "Slice", "MemoryMin") == [f"{512 + 600 + 128}M"]
    assert not any("camera" in f.path for f in files)  # no unit: held, not named


def test_systemd_accepts_the_neighbour_dropins(tmp_path: Path) -> None:
    analyze = find_systemd_analyze()
    units = materialize(render_files(PLAN, _opts()), tmp_path)
    for name in ("whisper.service", "piper-tts.service"):
        (tmp_path / name).write_text("[Service]\nExecStart=/bin/true\n")
        units.append(tmp_path / name)
    assert verify(analyze, units) == ""


@pytest.mark.parametrize(
    ("neighbour", "needle"),
    [
        (Neighbour("w", MiB, unit="../../etc/passwd.service"), "plan.neighbours[0].unit"),
        (Neighbour("w", MiB, unit="a\nExecStartPre=/x.service"), "plan.neighbours[0].unit"),
        (Neighbour("w", MiB, unit="-H.service"), "is not a service name"),
        (Neighbour("w", MiB, unit="a%n.service"), "is not a service name"),
        (Neighbour("w", MiB, unit="a/b.service"), "is not a service name"),
        (Neighbour("w", MiB, unit="w.socket"), "is not a service name"),
        (Neighbour("w", MiB, unit="x" * 300 + ".service"), "is not a service name"),
        (Neighbour("w", MiB, unit="slmguard-watch.service"), "is one of slmguard's own"),
        (Neighbour("w", -1, unit="w.service"), "plan.neighbours[0].memory_bytes"),
        (Neighbour("w", 1 << 70, unit="w.service"), "plan.neighbours[0].memory_bytes"),
    ],
)
def test_hostile_neighbours_are_refused_before_anything_is_written(
    neighbour: Neighbour, needle: str
) -> None:
    """The render layer does not rely on the plan reader: plans built directly."""
    plan = dataclasses.replace(make_plan(), neighbours=(neighbour,))
    with pytest.raises(RefusedError) as info:
        render_files(plan, _opts())
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_neighbours_name_is_only_a_label_in_the_dropin() -> None:
    plan = _with_neighbours(Neighbour("x%n\n[Service]\nExecStart=/bin/sh", MiB, unit="w.service"))
    text = _text(render_files(plan, _opts()), DROPIN.format("w.service"))
    assert values(text, "Service", "ExecStart") == [] and "%n" not in text
    assert "# x_n _Service_ ExecStart_/bin/sh: the plan holds 1M" in text
    assert all(
        line.startswith(("#", "[Service]", "Slice=", "Memory")) for line in text.splitlines()
    )


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A board plan: the embedded Gemma, an on-demand reranker, a pinned embedder and a
    neighbour with its unit (the plan's own JSON, as `plan` writes it)."""
    d = tmp_path_factory.mktemp("board")
    rerank, embed = write_reranker(d / "rerank.gguf"), write_embedder(d / "embed.gguf")
    out = d / "plan.json"
    from slmguard.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            ["plan", "--board", "rk3588-4g", "--model", "embedded", "--model", str(embed),
             "--model", f"{rerank},on-demand,name=rerank", "--neighbour",
             "whisper=600M,unit=whisper.service", "--json", "--out", str(out)]
        )  # fmt: skip
    assert info.value.code == 0
    return out


def _neighbours_finding(root: Path, plan_path: Path, capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    _, out = run_cli(["doctor", "--root", str(root), "--plan", str(plan_path), "--json"], capsys)
    found = [c for c in json.loads(out)["checks"] if c["id"] == "neighbours"]
    assert len(found) == 1
    return found[0]  # type: ignore[no-any-return]


def test_apply_installs_every_model_and_protects_the_neighbour(
    tmp_path: Path, board: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    # doctor before: the unit is missing (fail); installed but not yet protected (warn)
    assert _neighbours_finding(root, board, capsys)["severity"] == FAIL
    write(root, "etc/systemd/system/whisper.service", "[Service]\nExecStart=/bin/true\n")
    before = _neighbours_finding(root, board, capsys)
    assert before["severity"] == WARN and "not in the business slice" in before["summary"]

    code, out = run_cli(["apply", "--plan", str(board), "--root", str(root), *EXE], capsys)
    assert code == 0, out
    assert "systemctl restart whisper.service" in out
    installed = load_plan(root / "etc/slmguard/plan.json")
    plan = load_plan(board)
    for planned, placed in zip(
        (plan.model, *(m.model for m in plan.models)),
        (installed.model, *(m.model for m in installed.models)),
        strict=True,
    ):
        assert placed.path is not None and placed.path.startswith("/var/lib/slmguard-models/")
        assert (placed.sha256, placed.file_bytes) == (planned.sha256, planned.file_bytes)
        assert (root / placed.path.lstrip("/")).stat().st_size == planned.file_bytes
    assert installed.neighbours == plan.neighbours and installed.resident_sets == plan.resident_sets
    dropin = (root / DROPIN.format("whisper.service").lstrip("/")).read_text()
    assert values(dropin, "Service", "MemoryMin") == ["600M"]
    after = _neighbours_finding(root, board, capsys)
    assert after["severity"] == PASS, after

    # the same plan again changes nothing; rollback takes the drop-in and the models away
    code, out = run_cli(["apply", "--plan", str(board), "--root", str(root), *EXE], capsys)
    assert code == 0 and "nothing to change" in out
    code, out = run_cli(["rollback", "--root", str(root)], capsys)
    assert code == 0, out
    assert not (root / DROPIN.format("whisper.service").lstrip("/")).exists()
    assert not (root / "var/lib/slmguard-models").exists() or not any(
        (root / "var/lib/slmguard-models").iterdir()
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="a model may be hard-linked only when root owns it")
def test_apply_counts_the_space_of_each_board_model_it_copies(tmp_path: Path) -> None:
    """apply's free-space check (issue 40) with a board's models (issue 39): one model goes
    in as a hard link (no bytes), the other, not linkable, is copied and counted."""
    spec = make_plan().model
    changes = []
    for name, mode in (("linked.gguf", 0o644), ("copied.gguf", 0o600)):
        src = tmp_path / name
        src.write_bytes(b"\0" * (3 * MiB))
        src.chmod(mode)
        dest = f"/var/lib/slmguard-models/{name}"
        model = ModelSource(src, dataclasses.replace(spec, path=dest, file_bytes=3 * MiB))
        changes.append(Change(RenderedFile(dest, model=model)))
    linked = model_links(changes, tmp_path)
    assert linked == {"/var/lib/slmguard-models/linked.gguf"}
    need = needed_bytes(changes, [], linked=linked)
    assert need["/var/lib/slmguard-models/linked.gguf"] == 4096  # a directory entry
    assert need["/var/lib/slmguard-models/copied.gguf"] > 3 * MiB


def test_a_board_model_planned_from_a_preset_cannot_be_deployed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    code, text = run_cli(
        ["plan", "--board", "rk3588-8g", "--model", "embedded", "--model",
         "preset=qwen2.5-0.5b-instruct,ctx=2048", "--json", "--out", str(out)],
        capsys,
    )  # fmt: skip
    assert code == 0, text
    root = make_board_root(tmp_path / "root", "armbian")
    code, text = run_cli(["apply", "--plan", str(out), "--root", str(root), *EXE], capsys)
    assert code == 78
    assert "plan.models[0] (qwen2.5-0.5b-instruct) was planned for the preset" in text
    assert not (root / "etc/slmguard").exists()


@pytest.mark.parametrize(
    ("effective", "severity", "needle"),
    [
        ({"Slice": "business.slice", "MemoryMin": str(600 * MiB),
          "MemoryPeak": str(590 * MiB)}, PASS, "within their memory"),
        ({"Slice": "business.slice", "MemoryMin": str(600 * MiB),
          "MemoryPeak": str(620 * MiB)}, WARN, "holds 620 MiB, above its declared 600 MiB"),
        ({"Slice": "business.slice", "MemoryMin": str(600 * MiB),
          "MemoryPeak": str(GiB)}, FAIL, "holds 1024 MiB, above its declared 600 MiB"),
        ({"Slice": "business.slice", "MemoryMin": str(300 * MiB), "MemoryPeak": "[not set]",
          "MemoryCurrent": str(200 * MiB)}, WARN, "is protected for 300 MiB only"),
        ({"Slice": "system.slice", "MemoryMin": "0", "MemoryCurrent": str(200 * MiB)}, WARN,
         "not in the business slice with its protection yet"),
    ],
)  # fmt: skip
def test_doctor_reads_what_systemd_says_of_a_neighbour(
    tmp_path: Path, effective: dict[str, str], severity: str, needle: str
) -> None:
    """The live half (``systemctl show`` of the neighbour): its slice, protection, peak."""
    root = make_board_root(tmp_path / "root", "armbian")
    write(root, "etc/systemd/system/whisper.service", "[Service]\nExecStart=/bin/true\n")
    snap = collect(root, neighbour_units=("whisper.service",))
    (found,) = snap.neighbours
    assert found.unit is not None and found.effective is None  # no live systemd under a root
    live = dataclasses.replace(snap, neighbours=(NeighbourUnit("whisper.service", found.unit,
                                                               effective),))  # fmt: skip
    plan = _with_neighbours(Neighbour("whisper", 600 * MiB, unit="whisper.service"))
    finding = check_neighbours(live, plan)
    assert (finding.severity, needle in finding.summary) == (severity, True), finding


def test_doctor_without_neighbours_passes_and_without_a_plan_is_unknown(tmp_path: Path) -> None:
    snap = collect(make_board_root(tmp_path / "root", "armbian"))
    assert check_neighbours(snap, make_plan()).severity == PASS
    assert check_neighbours(snap, None).severity == "unknown"


@pytest.mark.parametrize(
    "target", [["ansible"], ["k8s", "--image", "registry.example/s:1@sha256:" + "0" * 64]]
)
def test_a_fleet_render_checks_every_model_of_a_board_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: list[str]
) -> None:
    """The fleet renders carry a board's every model (no longer refused, 78): each file is
    checked as apply checks it, so a missing board model is 66 naming it, nothing written;
    with it back, the rendered tree names it (tests/test_render_ansible.py and
    tests/test_render_k8s.py deploy it)."""
    from boardfiles import files_plan

    plan, planned = files_plan(tmp_path / "files")
    rerank = Path(str(planned.models[0].model.path))
    data = rerank.read_bytes()
    rerank.unlink()
    argv = ["render", "--target", *target, "--plan", str(plan), "--out", str(tmp_path / "o")]
    code, text = run_cli(argv, capsys)
    assert code == 66 and str(rerank) in text, text
    assert not (tmp_path / "o").exists()
    rerank.write_bytes(data)
    code, text = run_cli(argv, capsys)
    tree = "".join(p.read_text() for p in (tmp_path / "o").rglob("*.y*ml"))
    assert code == 0 and "rerank.gguf" in tree, text


def test_board_model_gives_a_copy_of_each_board_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``apply --board-model FILE`` (what the Ansible role passes: the staged copies), once
    for each of the plan's other models: checked by size and sha256 like the plan's file
    (65 for other bytes), one for each or 64, installed under the copy's name."""
    from boardfiles import files_plan

    root = make_board_root(tmp_path / "root", "armbian")
    plan, planned = files_plan(tmp_path / "files")
    original = Path(str(planned.models[0].model.path))
    copy = tmp_path / "staged/rerank-copy.gguf"
    copy.parent.mkdir()
    copy.write_bytes(original.read_bytes())
    original.unlink()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\7" * (copy.stat().st_size - 4))
    argv = ["apply", "--plan", str(plan), "--root", str(root), *EXE]
    code, text = run_cli(argv, capsys)
    assert code == 66 and str(original) in text, text
    code, text = run_cli([*argv, "--board-model", str(other)], capsys)
    assert code == 65 and "sha256" in text, text
    code, text = run_cli([*argv, "--board-model", str(copy), "--board-model", str(copy)], capsys)
    assert code == 64 and "--board-model given 2 times for a plan of 1 other models" in text
    code, text = run_cli([*argv, "--board-model", str(copy)], capsys)
    assert code == 0, text
    installed = load_plan(root / "etc/slmguard/plan.json").models[0].model
    assert installed.path == "/var/lib/slmguard-models/rerank-copy.gguf"
    assert (root / installed.path.lstrip("/")).read_bytes() == copy.read_bytes()
