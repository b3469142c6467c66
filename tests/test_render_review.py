"""`render --out DIR`: no write through a symlink, no file replaced that render did not write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rendertrees import make_model_file, make_plan, snapshot, write
from slmguard.cli import main
from slmguard.deploy.render import RenderOptions, render_files
from slmguard.deploy.review import RECORD_NAME, write_tree
from slmguard.errors import RefusedError
from slmguard.plan.planfile import dumps_plan

EXE = ["--exec", "/usr/bin/slmguard"]
FILES = render_files(make_plan(), RenderOptions(exec_path="/usr/bin/slmguard"))


def _render(
    tmp_path: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, str]:
    model, size, digest = make_model_file(tmp_path / "m.gguf")
    plan = tmp_path / "plan.json"
    planned = make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)
    plan.write_text(dumps_plan(planned))
    with pytest.raises(SystemExit) as exc:
        main(["render", "--plan", str(plan), "--out", str(out), *EXE, *extra])
    o, e = capsys.readouterr()
    return int(exc.value.code or 0), o + e


def test_a_symlinked_out_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere, "keep", "mine\n")
    (tmp_path / "out").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    code, out = _render(tmp_path, tmp_path / "out", capsys)
    assert code == 78 and "is a symlink" in out, out
    assert snapshot(elsewhere) == before


def test_an_out_that_is_a_file_is_refused_as_in_the_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out").write_text("a file\n")
    code, out = _render(tmp_path, tmp_path / "out", capsys)
    assert code == 78 and "out is in the way (not a directory)" in out, out
    assert len(out.strip().splitlines()) == 1, out
    assert (tmp_path / "out").read_text() == "a file\n"


def test_a_symlinked_directory_inside_out_is_refused_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host_etc = tmp_path / "host-etc"
    write(host_etc, "sysctl.d/99-slmguard.conf", "the host's own\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out/etc").symlink_to(host_etc)
    before = snapshot(host_etc)
    for extra in ((), ("--force",)):
        code, out = _render(tmp_path, tmp_path / "out", capsys, *extra)
        assert code == 78 and "out/etc is a symlink" in out, out
        assert snapshot(host_etc) == before


def test_files_render_did_not_write_are_kept_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    mine = write(out, "etc/sysctl.d/99-slmguard.conf", "my own edit\n")
    before = snapshot(out)
    code, text = _render(tmp_path, out, capsys)
    assert code == 78 and "was not written by an earlier render" in text and "--force" in text
    assert snapshot(out) == before  # refused before anything was written
    code, text = _render(tmp_path, out, capsys, "--force")
    assert code == 0, text
    assert mine.read_text().startswith("# Written by slmguard")


def test_a_link_where_a_file_goes_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = write(tmp_path, "victim", "keep me\n")
    out = tmp_path / "out"
    (out / "etc/slmguard").mkdir(parents=True)
    (out / "etc/slmguard/plan.json").symlink_to(victim)
    with pytest.raises(RefusedError, match="not written by an earlier render"):
        write_tree(FILES, out)
    write_tree(FILES, out, force=True)
    assert victim.read_text() == "keep me\n"
    assert not (out / "etc/slmguard/plan.json").is_symlink()


def test_rendering_again_replaces_its_own_files_and_records_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = write_tree(FILES, out)
    record = json.loads((out / RECORD_NAME).read_text())
    assert record["schema"] == "slmguard.render/1"
    assert set(record["files"]) == {f.path for f in FILES if not f.is_secret}
    (out / "etc/systemd/system/slmguard.service").write_text("edited for review\n")
    assert write_tree(FILES, out) == first
    assert "MemoryMax=2560M" in (out / "etc/systemd/system/slmguard.service").read_text()
    # A directory where a file goes is refused whatever the record says.
    (out / "etc/sysctl.d/99-slmguard.conf").unlink()
    (out / "etc/sysctl.d/99-slmguard.conf").mkdir()
    with pytest.raises(RefusedError, match="is a directory"):
        write_tree(FILES, out, force=True)
