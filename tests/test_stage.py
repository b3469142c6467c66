"""``slmguard stage``: the board's kind first, then the plan and a model checked by sha256.

Against a real mirror on a loopback port (``fleetsim.Mirror``) whose faults
happen on the socket: a connection closed mid-file, a 503, a 200 to a range
request, a file of other bytes.

- a dropped download resumes where it stopped (``Range``), the whole file is
  sent once and read once; a ``.part`` from an earlier run is resumed;
- the tries are bounded (``--retries``), a 404 is final at once; a mirror
  ignoring ``Range`` still gives the right file; a mirror serving other bytes
  is refused (65) and nothing is staged;
- a staged model of the right size and wrong bytes is found (hashed once),
  deleted and downloaded again; a stamped one is not read at all, and a bit
  flipped with its mtime kept is found only by ``--verify``;
- a model the board holds already (the installed one, stamped) is linked, not
  downloaded;
- a board of another kind, or another slmguard, is refused (78) before
  anything is downloaded or written;
- ``--gate-passed`` records the deployment in place; ``stage`` reports it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetsim import KINDS, Fault, Mirror, make_root
from slmguard import __version__
from slmguard.cli import main
from slmguard.deploy.digests import load_digests
from slmguard.deploy.download import Retry, fetch, part_path
from slmguard.errors import DownloadError, ModelMismatchError
from slmguard.plan.inputs import plan_for
from slmguard.plan.planfile import dumps_plan

SIZE = 3 << 20
RK3588 = KINDS[0]
RPI = KINDS[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("model") / "m.gguf"
    data = b"GGUF" + hashlib.sha256(b"seed").digest() * (SIZE // 32)
    path.write_bytes(data[:SIZE])
    return path, hashlib.sha256(data[:SIZE]).hexdigest()


@pytest.fixture
def mirror(model: tuple[Path, str]) -> Iterator[Mirror]:
    m = Mirror({model[0].name: model[0]})
    yield m
    m.close()


def _no_pause(pauses: list[float]) -> Any:
    return pauses.append


# ------------------------------------------------------------------- the download


def test_a_dropped_download_resumes_and_is_read_once(
    tmp_path: Path, model: tuple[Path, str], mirror: Mirror
) -> None:
    path, digest = model
    mirror.fail("b1", Fault(drop_after=SIZE * 2 // 5))
    pauses: list[float] = []
    dest = tmp_path / "m.gguf"
    got = fetch(mirror.url("b1", path.name), dest, SIZE, digest, sleep=_no_pause(pauses))
    assert dest.read_bytes() == path.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o644 and not part_path(dest).exists()
    assert got.attempts == 2 and pauses == [1.0]
    assert mirror.requests("b1") == [None, f"bytes={SIZE * 2 // 5}-"]
    assert mirror.sent()["b1"] == SIZE == got.downloaded_bytes  # every byte sent once


def test_a_partial_file_of_an_earlier_run_is_resumed(
    tmp_path: Path, model: tuple[Path, str], mirror: Mirror
) -> None:
    path, digest = model
    dest = tmp_path / "m.gguf"
    part_path(dest).write_bytes(path.read_bytes()[: SIZE // 3])
    got = fetch(mirror.url("b2", path.name), dest, SIZE, digest)
    assert got.resumed_bytes == SIZE // 3 and got.downloaded_bytes == SIZE - SIZE // 3
    assert mirror.sent()["b2"] == SIZE - SIZE // 3
    assert dest.read_bytes() == path.read_bytes()


def test_the_tries_are_bounded_and_a_404_is_final(
    tmp_path: Path, model: tuple[Path, str], mirror: Mirror
) -> None:
    path, digest = model
    mirror.fail("b3", Fault(drop_after=1000, drops=100))
    pauses: list[float] = []
    dest = tmp_path / "m.gguf"
    with pytest.raises(DownloadError) as err:
        fetch(
            mirror.url("b3", path.name),
            dest,
            SIZE,
            digest,
            retry=Retry(retries=3, first_pause_s=1, max_pause_s=3),
            sleep=_no_pause(pauses),
        )
    assert err.value.attempts == 4 and pauses == [1, 2, 3]
    assert err.value.done_bytes == 4000 == part_path(dest).stat().st_size  # kept to resume
    assert not dest.exists()
    with pytest.raises(DownloadError) as err:
        fetch(
            mirror.url("b3", "nothing.gguf"), tmp_path / "n.gguf", SIZE, digest, sleep=_no_pause([])
        )
    assert err.value.attempts == 1 and "404" in err.value.problem
    # A 503 twice, then the file.
    mirror.fail("b4", Fault(status=503, statuses=2))
    got = fetch(mirror.url("b4", path.name), tmp_path / "o.gguf", SIZE, digest, sleep=_no_pause([]))
    assert got.attempts == 3


def test_a_mirror_ignoring_ranges_or_serving_other_bytes(
    tmp_path: Path, model: tuple[Path, str], mirror: Mirror
) -> None:
    path, digest = model
    mirror.fail("b5", Fault(drop_after=SIZE // 2, ignore_range=True))
    dest = tmp_path / "m.gguf"
    got = fetch(mirror.url("b5", path.name), dest, SIZE, digest, sleep=_no_pause([]))
    assert dest.read_bytes() == path.read_bytes() and got.attempts == 2
    other = hashlib.sha256(b"another file").hexdigest()
    with pytest.raises(ModelMismatchError):
        fetch(mirror.url("b6", path.name), tmp_path / "x.gguf", SIZE, other)
    assert not (tmp_path / "x.gguf").exists() and not part_path(tmp_path / "x.gguf").exists()


# ------------------------------------------------------------------- slmguard stage


@pytest.fixture
def board(tmp_path: Path, model: tuple[Path, str]) -> tuple[Path, Path]:
    """An RK3588 board root and the plan for it (the real planner, the stand-in model's size)."""
    root = make_root(tmp_path / "board", RK3588)
    plan, _ = plan_for(Path("/"), preset="gemma-3-270m-it", board=RK3588.board)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(dumps_plan(plan))
    return root, plan_file


def _stage(
    capsys: pytest.CaptureFixture[str], root: Path, plan: Path, model: tuple[Path, str], *extra: str
) -> tuple[int, dict[str, Any]]:
    path, digest = model
    argv = [
        "stage",
        "--root",
        str(root),
        "--plan",
        str(plan),
        "--model-name",
        path.name,
        "--model-size",
        str(SIZE),
        "--model-sha256",
        digest,
        "--retries",
        "1",
        "--json",
        *extra,
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, _ = capsys.readouterr()
    return int(exc.value.code or 0), json.loads(out)


def test_stage_downloads_once_then_reads_nothing(
    board: tuple[Path, Path],
    model: tuple[Path, str],
    mirror: Mirror,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, plan = board
    url = mirror.url("s1", model[0].name)
    code, first = _stage(capsys, root, plan, model, "--model-url", url)
    assert code == 0 and first["changed"] and first["plan_written"]
    assert first["model"]["how"] == "downloaded" and first["model"]["downloaded_bytes"] == SIZE
    staged = Path(first["model"]["path"])
    assert staged.read_bytes() == model[0].read_bytes()
    assert load_digests(root).trusted(staged) == model[1]  # apply will not read it again
    code, again = _stage(capsys, root, plan, model, "--model-url", url)
    assert code == 0 and not again["changed"]
    assert again["model"]["how"] == "kept" and again["model"]["read_bytes"] == 0
    assert mirror.sent()["s1"] == SIZE


def test_a_corrupt_staged_model_is_found_and_downloaded_again(
    board: tuple[Path, Path],
    model: tuple[Path, str],
    mirror: Mirror,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, plan = board
    url = mirror.url("s2", model[0].name)
    _, first = _stage(capsys, root, plan, model, "--model-url", url)
    staged = Path(first["model"]["path"])
    # A bit flips on the card, the mtime kept: the stamp still vouches for the file...
    st = staged.stat()
    with staged.open("r+b") as f:
        f.seek(SIZE // 2)
        byte = f.read(1)
        f.seek(SIZE // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    _, kept = _stage(capsys, root, plan, model, "--model-url", url)
    assert kept["model"]["how"] == "kept"
    # ... --verify hashes it, deletes it and downloads it again.
    _, verified = _stage(capsys, root, plan, model, "--model-url", url, "--verify")
    assert verified["model"]["how"] == "downloaded" and verified["model"]["discarded_wrong_bytes"]
    assert verified["model"]["read_bytes"] == SIZE
    assert staged.read_bytes() == model[0].read_bytes()
    # A staged file of the right size and wrong bytes, unstamped (a bad copy): hashed once.
    staged.unlink()
    staged.write_bytes(b"\0" * SIZE)
    _, again = _stage(capsys, root, plan, model, "--model-url", url)
    assert again["model"]["how"] == "downloaded" and again["model"]["discarded_wrong_bytes"]
    assert staged.read_bytes() == model[0].read_bytes()
    assert mirror.sent()["s2"] == 3 * SIZE


def test_a_model_on_the_board_is_linked_not_downloaded(
    board: tuple[Path, Path],
    model: tuple[Path, str],
    mirror: Mirror,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, plan = board
    installed = root / "var/lib/slmguard-models" / model[0].name
    installed.parent.mkdir(parents=True)
    installed.write_bytes(model[0].read_bytes())
    digests = load_digests(root)
    digests.remember(installed, model[1])
    digests.save(create=True)
    _, out = _stage(capsys, root, plan, model, "--model-url", mirror.url("s3", model[0].name))
    assert out["model"]["how"] == "linked" and out["model"]["downloaded_bytes"] == 0
    assert Path(out["model"]["path"]).stat().st_ino == installed.stat().st_ino
    assert "s3" not in mirror.sent()


def test_another_kind_or_version_is_refused_before_anything_is_written(
    tmp_path: Path, model: tuple[Path, str], mirror: Mirror, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_root(tmp_path / "pi", RPI)
    plan, _ = plan_for(Path("/"), preset="gemma-3-270m-it", board=RK3588.board)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(dumps_plan(plan))
    before = sorted(str(p) for p in root.rglob("*"))
    url = mirror.url("s4", model[0].name)
    code, out = _stage(capsys, root, plan_file, model, "--model-url", url)
    assert code == 78 and "not a rk3588-8g" in out["error"]
    code, out = _stage(
        capsys, root, plan_file, model, "--model-url", url, "--expect-version", "0.0.1"
    )
    assert code == 78 and __version__ in out["error"]
    assert sorted(str(p) for p in root.rglob("*")) == before
    assert "s4" not in mirror.sent()


def test_the_gate_record_follows_the_deployment(
    board: tuple[Path, Path],
    model: tuple[Path, str],
    mirror: Mirror,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from slmguard.deploy.manifest import MANIFEST_DEST, Manifest

    root, plan = board
    url = mirror.url("s5", model[0].name)
    manifest = root / MANIFEST_DEST.lstrip("/")
    manifest.parent.mkdir(parents=True, exist_ok=True)
    m = Manifest(str(root), plan_sha256="a" * 64, gen=2, rollout="r1")
    manifest.write_text(m.to_json())
    _, out = _stage(capsys, root, plan, model, "--model-url", url)
    assert out["gated"] is False and out["deployment"]["rollout"] == "r1"
    with pytest.raises(SystemExit):
        main(["stage", "--root", str(root), "--gate-passed", "--json"])
    assert json.loads(capsys.readouterr()[0])["changed"] is True
    _, out = _stage(capsys, root, plan, model, "--model-url", url)
    assert out["gated"] is True
    m.gen, m.rollout = 3, "r2"  # another apply: not gated yet
    manifest.write_text(m.to_json())
    _, out = _stage(capsys, root, plan, model, "--model-url", url)
    assert out["gated"] is False


def test_stage_reads_the_plan_from_stdin(
    board: tuple[Path, Path],
    model: tuple[Path, str],
    mirror: Mirror,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, plan = board
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(plan.read_bytes())))
    code, out = _stage(capsys, root, Path("-"), model, "--check")
    assert code == 0 and out["kind"]["severity"] == "pass" and out["changed"] is False
    assert not (root / "var/lib/slmguard-fleet").exists()


def test_a_board_s_other_files_are_staged_beside_the_model_and_kept(
    board: tuple[Path, Path],
    model: tuple[Path, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A board model and a projector (issues 39, 42), staged like the model: downloaded
    once, checked by sha256, kept (nothing read) the next time; a file the plan no longer
    names leaves the staging directory; the flags go together (64)."""
    root, plan = board
    files = {}
    for name, seed in (("rerank.gguf", b"r"), ("mmproj-tiny.gguf", b"v")):
        data = b"GGUF" + hashlib.sha256(seed).digest() * 1000
        (tmp_path / name).write_bytes(data)
        files[name] = (len(data), hashlib.sha256(data).hexdigest())
    m = Mirror({model[0].name: model[0], **{n: tmp_path / n for n in files}})
    try:

        def flags(names: list[str]) -> list[str]:
            out = []
            for n in names:
                size, digest = files[n]
                out += ["--file-name", n, "--file-size", str(size), "--file-sha256", digest]
                out += ["--file-url", m.url("f1", n)]
            return out

        url = m.url("f1", model[0].name)
        code, first = _stage(capsys, root, plan, model, "--model-url", url, *flags(list(files)))
        assert code == 0 and first["changed"], first
        assert [f["how"] for f in first["files"]] == ["downloaded", "downloaded"]
        for f, name in zip(first["files"], files, strict=True):
            staged = Path(f["path"])
            assert staged.name == name and staged.read_bytes() == (tmp_path / name).read_bytes()
            assert staged.parent.name == files[name][1][:16]
        code, again = _stage(capsys, root, plan, model, "--model-url", url, *flags(list(files)))
        assert not again["changed"] and [f["how"] for f in again["files"]] == ["kept", "kept"]
        assert sum(f["read_bytes"] for f in again["files"]) == 0
        # the projector dropped from the plan: its staged file goes, the others stay
        code, fewer = _stage(capsys, root, plan, model, "--model-url", url, *flags(["rerank.gguf"]))
        gone = Path(first["files"][1]["path"]).parent
        assert fewer["changed"] and fewer["pruned"] == [str(gone)]
        assert Path(first["files"][0]["path"]).is_file() and Path(first["model"]["path"]).is_file()
        assert not Path(first["files"][1]["path"]).exists()
        assert m.sent()["f1"] == SIZE + sum(size for size, _ in files.values())
    finally:
        m.close()
    with pytest.raises(SystemExit) as exc:
        main(["stage", "--root", str(root), "--plan", str(plan), "--file-name", "x.gguf"])
    assert exc.value.code == 64
    assert "go together" in capsys.readouterr().err
