"""`slmguard render`, `apply` and `rollback` as a table: arguments -> exit code + output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rendertrees import make_board_root, make_model_file, make_plan, snapshot
from slmguard.cli import main
from slmguard.plan.planfile import dumps_plan, plan_to_dict


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A board root, a good plan, a plan that cannot fit, and a file that is no plan."""
    root = make_board_root(tmp_path / "root", "armbian")
    model, size, digest = make_model_file(tmp_path / "models/m.gguf")
    kw = {"model_path": str(model), "model_bytes": size, "model_sha256": digest}
    good = tmp_path / "plan.json"
    good.write_text(dumps_plan(make_plan(**kw)))  # type: ignore[arg-type]
    big = tmp_path / "big.json"
    big.write_text(dumps_plan(make_plan(cma_bytes=3 << 30, **kw)))  # type: ignore[arg-type]
    bad = tmp_path / "bad.json"
    data = plan_to_dict(make_plan())
    data["schema"] = "slmguard.plan/9"
    bad.write_text(json.dumps(data))
    return {
        "root": str(root),
        "good": str(good),
        "big": str(big),
        "bad": str(bad),
        "out": str(tmp_path / "out"),
        "missing": str(tmp_path / "nope.json"),
    }


EXE = ["--exec", "/usr/bin/slmguard"]

CASES: list[tuple[str, list[str], int, list[str]]] = [
    (
        "render ok",
        ["render", "--plan", "{good}", "--out", "{out}", *EXE],
        0,
        ["rendered 18 files", "not written: /etc/slmguard/admin-token", "apply` creates it"],
    ),
    (
        "render with root edits",
        ["render", "--plan", "{good}", "--out", "{out}", "--root", "{root}", *EXE],
        0,
        ["armbianEnv.txt", "cma=512M", "fstab"],
    ),
    (
        "render protect",
        ["render", "--plan", "{good}", "--out", "{out}", "--protect", "a.service", *EXE],
        0,
        ["a.service.d/50-slmguard-protect.conf"],
    ),
    ("render no plan flag", ["render", "--out", "{out}"], 64, ["--plan"]),
    ("render missing plan", ["render", "--plan", "{missing}", "--out", "{out}"], 78, ["not found"]),
    ("render other schema", ["render", "--plan", "{bad}", "--out", "{out}"], 78, ["not supported"]),
    ("render refused", ["render", "--plan", "{big}", "--out", "{out}", *EXE], 78, ["half of RAM"]),
    (
        "render bad slice",
        ["render", "--plan", "{good}", "--out", "{out}", "--business-slice", "x", *EXE],
        64,
        ["NAME.slice"],
    ),
    (
        "render relative exec",
        ["render", "--plan", "{good}", "--out", "{out}", "--exec", "slmguard"],
        64,
        ["absolute path"],
    ),
    (
        "apply dry run",
        ["apply", "--plan", "{good}", "--root", "{root}", "--dry-run", *EXE],
        0,
        [
            "+++ b/etc/systemd/system/slmguard.service",
            "+<secret, 44 bytes>",
            "+++ b/var/lib/slmguard-models/m.gguf",
            "dry run: 22 files would change",  # 20 before the recovery unit (and its link)
        ],
    ),
    ("apply refused", ["apply", "--plan", "{big}", "--root", "{root}", *EXE], 78, ["cma="]),
    ("apply without plan", ["apply", "--root", "{root}", *EXE], 64, ["no plan"]),
    ("rollback nothing", ["rollback", "--root", "{root}"], 0, ["nothing to roll back"]),
    (
        "rollback if unfinished, none ran",
        ["rollback", "--root", "{root}", "--if-unfinished"],
        0,
        ["nothing to undo"],
    ),
    (
        "rollback if unfinished with --to",
        ["rollback", "--root", "{root}", "--if-unfinished", "--to", "previous"],
        64,
        ["not allowed with argument"],
    ),
    ("help render", ["render", "--help"], 0, ["Example:"]),
    ("help apply", ["apply", "--help"], 0, ["Example:"]),
    ("help rollback", ["rollback", "--help"], 0, ["Example:"]),
]


@pytest.mark.parametrize(("name", "argv", "code", "needles"), CASES, ids=[c[0] for c in CASES])
def test_cli_table(
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    name: str,
    argv: list[str],
    code: int,
    needles: list[str],
) -> None:
    before = snapshot(Path(env["root"]))
    got, output = _run([a.format(**env) for a in argv], capsys)
    assert got == code, output
    for needle in needles:
        assert needle in output, output
    if argv[0] != "render" or "--root" in argv:
        assert snapshot(Path(env["root"])) == before  # none of these rows changes the root


def test_cli_apply_again_rollback(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(env["root"])
    before = snapshot(root)
    code, out = _run(["apply", "--plan", env["good"], "--root", env["root"], *EXE], capsys)
    # 19 files before the model was installed by apply, 20 before the recovery unit, now 22.
    assert code == 0 and "22 files changed" in out and "slmguard rollback" in out
    assert "created /var/lib/slmguard-models/m.gguf (hard link of " in out
    assert "created /etc/systemd/system/slmguard.service" in out
    assert "created /etc/slmguard/admin-token" in out
    token = (root / "etc/slmguard/admin-token").read_text().strip()
    assert token and token not in out
    assert "replaced /boot/armbianEnv.txt" in out
    # The installed plan is the default for the next apply: nothing to change.
    code, out = _run(["apply", "--root", env["root"], *EXE], capsys)
    assert code == 0 and "nothing to change" in out
    code, out = _run(["rollback", "--root", env["root"]], capsys)
    assert code == 0 and "restored /boot/armbianEnv.txt" in out
    assert "removed /etc/systemd/system/slmguard.service" in out
    assert "removed /etc/slmguard/admin-token" in out
    assert snapshot(root) == before


def test_cli_render_out_tree_matches_apply(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _ = _run(["render", "--plan", env["good"], "--out", env["out"], *EXE], capsys)
    assert code == 0
    out = Path(env["out"])
    unit = out / "etc/systemd/system/slmguard.service"
    assert "MemoryMax=2560M" in unit.read_text()
    assert (out / "etc/sysctl.d/99-slmguard.conf").is_file()
    assert (out / "etc/systemd/system/dphys-swapfile.service").readlink() == Path("/dev/null")
    assert not (out / "boot").exists()  # no --root: no boot edit
    assert not (out / "etc/slmguard/admin-token").exists()  # no secret in a review tree


def test_cli_second_apply_prints_no_stale_notes(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run(["apply", "--plan", env["good"], "--root", env["root"], *EXE], capsys)
    assert code == 0 and "cma=512M takes effect at the next boot" in out
    assert "swap entries in /etc/fstab" in out
    code, out = _run(["apply", "--plan", env["good"], "--root", env["root"], *EXE], capsys)
    assert code == 0 and out.strip().splitlines() == [
        f"nothing to change: {env['root']} already matches the plan"
    ]


def test_cli_one_file_is_singular(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """apply counts in English: "1 file changed", not "1 files changed"."""
    root = Path(env["root"])
    assert _run(["apply", "--plan", env["good"], "--root", env["root"], *EXE], capsys)[0] == 0
    (root / "etc/sysctl.d/99-slmguard.conf").unlink()
    code, out = _run(["apply", "--root", env["root"], "--dry-run", *EXE], capsys)
    assert code == 0 and f"dry run: 1 file would change under {root}" in out, out
    code, out = _run(["apply", "--root", env["root"], *EXE], capsys)
    assert code == 0 and "1 file changed; undo with" in out, out


def _protect_dropin(root: Path, name: str) -> Path:
    return root / f"etc/systemd/system/{name}.d/50-slmguard-protect.conf"


def test_cli_apply_keeps_the_protected_services(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`apply --protect X`, then `apply --plan NEW` without it: X stays protected (it was
    dropped before); --no-protect drops it, --protect names the whole list."""
    root = Path(env["root"])
    model, size, digest = make_model_file(tmp_path / "models/m.gguf")
    newer = tmp_path / "newer.json"
    newer.write_text(
        dumps_plan(
            make_plan(
                memory_high_bytes=(2 << 30) - (64 << 20),
                model_path=str(model),  # type: ignore[arg-type]
                model_bytes=size,  # type: ignore[arg-type]
                model_sha256=digest,  # type: ignore[arg-type]
            )
        )
    )
    apply = ["apply", "--root", env["root"], *EXE]
    code, _ = _run([*apply, "--plan", env["good"], "--protect", "nginx.service"], capsys)
    assert code == 0 and _protect_dropin(root, "nginx.service").is_file()
    code, out = _run([*apply, "--plan", str(newer)], capsys)
    assert code == 0 and "replaced /etc/systemd/system/slmguard.service" in out, out
    assert "note: keeping --protect nginx.service from the deployment in place" in out
    assert _protect_dropin(root, "nginx.service").is_file()
    # The whole list when given: another service instead.
    code, out = _run([*apply, "--protect", "redis.service"], capsys)
    assert code == 0 and _protect_dropin(root, "redis.service").is_file()
    assert not _protect_dropin(root, "nginx.service").exists()
    code, out = _run([*apply, "--no-protect", "--protect", "redis.service"], capsys)
    assert code == 64 and "contradict" in out
    code, out = _run([*apply, "--no-protect"], capsys)
    assert code == 0 and not _protect_dropin(root, "redis.service").exists(), out
    code, out = _run(apply, capsys)
    assert code == 0 and "keeping --protect" not in out and "nothing to change" in out


_PROTECT_NGINX = "/etc/systemd/system/nginx.service.d/50-slmguard-protect.conf"


def _lines(out: str, *, drop: str = "") -> list[str]:
    return [line.replace(drop, "") for line in out.splitlines() if not line.startswith("dry run")]


@pytest.mark.parametrize("to", ["nothing", "previous"])
def test_cli_rollback_dry_run_says_what_it_would_do_and_writes_nothing(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path, to: str
) -> None:
    """rollback --dry-run prints the lines the rollback then prints ("would be " before
    each) and leaves the root byte for byte as it was."""
    root = Path(env["root"])
    apply = ["apply", "--root", env["root"], "--plan", env["good"], *EXE]
    assert _run([*apply, "--protect", "nginx.service"], capsys)[0] == 0
    if to == "previous":
        assert _run([*apply, "--no-protect"], capsys)[0] == 0
    before = snapshot(root)
    rollback = ["rollback", "--root", env["root"], "--to", to]
    code, dry = _run([*rollback, "--dry-run"], capsys)
    assert code == 0 and snapshot(root) == before
    assert "nothing written" in dry.splitlines()[-1]
    restored = "restored" if to == "previous" else "removed"
    assert f"would be {restored} {_PROTECT_NGINX}" in dry
    code, done = _run(rollback, capsys)
    assert code == 0 and snapshot(root) != before
    assert _lines(dry, drop="would be ") == _lines(done)
